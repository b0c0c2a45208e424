"""The reader pool actor: N workers reading disk slots back into GPU pages (onboard).

* A job is one ``ReadSlots`` batch, executed as one ``read_many`` (vector I/O) and reported as
  one ``BatchFinished`` with an outcome per block.
* Each worker thread owns a staging buffer of ``max_batch_blocks`` blocks -- pinned when CUDA
  is present: pageable staging makes the host -> device copy run at about a sixth of the
  pinned rate and secretly synchronous -- and, with CUDA, a stream of its own, so batches
  overlap one another.
* A read writes its GPU page only after the copy-stream fence taken at dispatch (the page may
  have just been emptied by a GPU -> host copy), and reports SlotRead only after its bytes are
  complete on the device: the batch's host -> device copies are enqueued together and the
  worker's stream is synchronized once per batch, not once per block.  The scheduler
  publishes a block as ready on that report, never earlier.
* A store that reads straight into device memory (kvikio, GPUDirect Storage) skips the
  staging.
* A block whose read fails (I/O error, short read, header or checksum mismatch) is reported
  SlotReadFailed and its page is never copied or published; the batch's other blocks land
  (the waiting requests of the failed one fall back to recompute).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import torch

from io_actors.gate import CompletionGate
from io_actors.interfaces import Fence, SlotIO, SlotStore
from io_actors.worker_threads import WorkerThreads
from statekv.ids import PageId
from statekv.messages import (
    BatchFinished,
    Completion,
    ReadSlots,
    SlotRead,
    SlotReadFailed,
    TransferOutcome,
)

log = logging.getLogger(__name__)


@attrs.frozen
class ReadJob:
    command: ReadSlots
    fence: Fence


class SlotReader:
    """One worker thread's executor, with its own staging buffer and stream."""

    def __init__(
        self, store: SlotStore, gpu_page: Callable[[PageId], torch.Tensor],
        new_staging: Callable[[int], torch.Tensor], device: torch.device, batch_blocks: int,
    ) -> None:
        self._store = store
        self._gpu_page = gpu_page
        self._cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._staging: list[torch.Tensor] = []
        if self._cuda:
            torch.cuda.set_device(device)  # a worker thread starts on device 0 otherwise
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        if not store.device_reads:
            # Page aligned (O_DIRECT reads land in it without a bounce buffer) and pinned
            # when the host pool is (KVPools logs why when pinning is refused).
            whole = new_staging(batch_blocks)
            size = whole.numel() // batch_blocks
            self._staging = [whole[i * size : (i + 1) * size] for i in range(batch_blocks)]

    def execute(self, job: ReadJob) -> Completion:
        reads = job.command.reads
        pages = [self._gpu_page(cmd.gpu_page) for cmd in reads]
        if not self._staging:
            job.fence.wait()
            results = self._store.read_many(
                [SlotIO(cmd.slot, cmd.key, page) for cmd, page in zip(reads, pages, strict=True)]
            )
            if self._cuda:
                torch.cuda.current_stream(pages[0].device).synchronize()
        else:
            staging = self._staging
            results = self._store.read_many(
                [SlotIO(cmd.slot, cmd.key, staging[i]) for i, cmd in enumerate(reads)]
            )
            job.fence.wait()
            landed = [i for i, error in enumerate(results) if error is None]
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    for i in landed:
                        pages[i].copy_(staging[i], non_blocking=True)
                # Published only once the bytes are on the device; the staging buffer is
                # reused by this worker's next batch.  One wait for the whole batch.
                self._stream.synchronize()
            else:
                for i in landed:
                    pages[i].copy_(staging[i])
        outcomes: list[TransferOutcome] = []
        for cmd, error in zip(reads, results, strict=True):
            if error is None:
                outcomes.append(SlotRead(transfer=cmd.transfer))
            else:
                log.warning("onboard of block %d from slot %d failed: %s", cmd.block, cmd.slot,
                            error)
                outcomes.append(SlotReadFailed(transfer=cmd.transfer, cause=str(error)))
        return BatchFinished(outcomes=tuple(outcomes))

    def close(self) -> None:
        self._staging = []
        self._stream = None


class ReaderPool(WorkerThreads[ReadJob]):
    """Onboard reads, executed by `workers` threads of their own."""

    def __init__(
        self,
        store: SlotStore,
        gpu_page: Callable[[PageId], torch.Tensor],
        *,
        new_staging: Callable[[int], torch.Tensor],
        device: torch.device,
        batch_blocks: int,
        workers: int,
        queue_depth: int,
        gate: CompletionGate,
        report: Callable[[Completion], Awaitable[None]],
    ) -> None:
        super().__init__(
            "reader", workers=workers, queue_depth=queue_depth,
            make_worker=lambda _index: SlotReader(
                store, gpu_page, new_staging, device, batch_blocks
            ),
            gate=gate, report=report,
        )
