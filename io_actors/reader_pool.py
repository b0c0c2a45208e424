"""The reader pool actor: N workers reading disk slots back into GPU pages (onboard).

* Each worker thread owns a staging buffer -- pinned when CUDA is present: pageable staging
  makes the host -> device copy run at about a sixth of the pinned rate and secretly
  synchronous -- and, with CUDA, a stream of its own, so reads overlap one another.
* A read writes its GPU page only after the copy-stream fence taken at dispatch (the page may
  have just been emptied by a GPU -> host copy), and reports SlotRead only after its bytes are
  complete on the device (the stream is synchronized first).  The scheduler publishes the
  block as ready on that report, never earlier.
* A store that reads straight into device memory (GPUDirect Storage) skips the staging.
* Any failure (I/O error, short read, header or checksum mismatch) reports SlotReadFailed:
  the bytes are never published and the waiting requests fall back to recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import torch

from io_actors.gate import CompletionGate
from io_actors.interfaces import Fence, SlotStore
from io_actors.worker_threads import WorkerThreads
from statekv.errors import TransferFailed
from statekv.ids import PageId
from statekv.messages import Completion, ReadSlot, SlotRead, SlotReadFailed

log = logging.getLogger(__name__)


@attrs.frozen
class ReadJob:
    command: ReadSlot
    fence: Fence


class SlotReader:
    """One worker thread's executor, with its own staging buffer and stream."""

    def __init__(
        self, store: SlotStore, gpu_page: Callable[[PageId], torch.Tensor],
        new_staging: Callable[[], torch.Tensor], device: torch.device,
    ) -> None:
        self._store = store
        self._gpu_page = gpu_page
        self._cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None
        if self._cuda:
            torch.cuda.set_device(device)  # a worker thread starts on device 0 otherwise
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        if not store.device_reads:
            # Page aligned (O_DIRECT reads land in it without a bounce buffer) and pinned
            # when the host pool is (KVPools logs why when pinning is refused).
            self._staging = new_staging()

    def execute(self, job: ReadJob) -> Completion:
        cmd = job.command
        try:
            dst = self._gpu_page(cmd.gpu_page)
            if self._staging is None:
                job.fence.wait()
                self._store.read(cmd.slot, cmd.key, dst)
                if self._cuda:
                    torch.cuda.current_stream(dst.device).synchronize()
            else:
                self._store.read(cmd.slot, cmd.key, self._staging)
                job.fence.wait()
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        dst.copy_(self._staging, non_blocking=True)
                    # Published only once the bytes are on the device; the staging buffer is
                    # reused by this worker's next read.
                    self._stream.synchronize()
                else:
                    dst.copy_(self._staging)
        except TransferFailed as exc:
            log.warning("onboard of block %d from slot %d failed: %s", cmd.block, cmd.slot, exc)
            return SlotReadFailed(transfer=cmd.transfer, cause=str(exc))
        return SlotRead(transfer=cmd.transfer)

    def close(self) -> None:
        self._staging = None
        self._stream = None


class ReaderPool(WorkerThreads[ReadJob]):
    """Onboard reads, executed by `workers` threads of their own."""

    def __init__(
        self,
        store: SlotStore,
        gpu_page: Callable[[PageId], torch.Tensor],
        *,
        new_staging: Callable[[], torch.Tensor],
        device: torch.device,
        workers: int,
        queue_depth: int,
        gate: CompletionGate,
        report: Callable[[Completion], Awaitable[None]],
    ) -> None:
        super().__init__(
            "reader", workers=workers, queue_depth=queue_depth,
            make_worker=lambda _index: SlotReader(store, gpu_page, new_staging, device),
            gate=gate, report=report, is_failure=lambda c: isinstance(c, SlotReadFailed),
        )
