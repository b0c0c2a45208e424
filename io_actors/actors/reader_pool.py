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
* A ``PrefetchSlots`` job (a queued request's disk blocks, statekv.messages rule 6) reads
  straight into the blocks' pinned host pages, after the copy-stream fence (a page may have
  just been the source of a host -> GPU copy), and reports like an onboard.
* Every batch's landed bytes and the seconds its store call took are reported
  (``measured``): the core's disk read-rate estimate for cost-aware onboarding.  The clock is
  read here, in the actor, never in the core.
* A block whose read fails (I/O error, short read, header or checksum mismatch) is reported
  SlotReadFailed and its page is never copied or published; the batch's other blocks land
  (the waiting requests of the failed one fall back to recompute).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import attrs
import torch

from io_actors.actors.foreground import Foreground
from io_actors.actors.gate import CompletionGate
from io_actors.actors.worker_threads import WorkerThreads
from io_actors.memory.host_checksums import HostChecksums
from io_actors.storage.interfaces import BatchOutcome, Fence, SlotIO, SlotStore
from statekv.ids import PageId
from statekv.messages import (
    BatchFinished,
    Completion,
    PrefetchSlot,
    PrefetchSlots,
    ReadSlot,
    ReadSlots,
    SlotRead,
    SlotReadFailed,
    TransferOutcome,
)

log = logging.getLogger(__name__)


@attrs.frozen
class ReadJob:
    command: ReadSlots | PrefetchSlots
    fence: Fence


Measured = Callable[[int, float], None]
"""Called with (bytes landed, seconds the store call took) after each batch."""


class SlotReader:
    """One worker thread's executor, with its own staging buffer and stream."""

    def __init__(
        self, store: SlotStore, gpu_page: Callable[[PageId], torch.Tensor],
        new_staging: Callable[[int], torch.Tensor], device: torch.device, batch_blocks: int,
        *, host_page: Callable[[PageId], torch.Tensor] | None = None,
        checksums: HostChecksums | None = None,
        measured: Measured | None = None,
    ) -> None:
        self._store = store
        self._gpu_page = gpu_page
        self._host_page = host_page
        self._checksums = checksums
        self._measured = measured
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

    def _timed_read(self, items: list[SlotIO]) -> BatchOutcome:
        start = time.perf_counter()
        results = self._store.read_many(items)
        seconds = time.perf_counter() - start
        landed = sum(item.buffer.numel() * item.buffer.element_size()
                     for item, error in zip(items, results, strict=True) if error is None)
        if self._measured is not None and landed and seconds > 0:
            self._measured(landed, seconds)
        return results

    def _prefetch(self, job: ReadJob, reads: tuple[PrefetchSlot, ...]) -> BatchOutcome:
        host_page = self._host_page
        if host_page is None:
            raise RuntimeError("this reader has no host pool: it cannot prefetch")
        job.fence.wait()
        if self._checksums is not None:
            # The pages' checksums were their earlier bytes': a spill from one of these pages
            # (a host copy of a block recalled from PREFETCHED, once its disk copy was
            # displaced) checksums it on the CPU.  Before the read, which may land in part.
            self._checksums.overwritten([cmd.host_page for cmd in reads])
        return self._timed_read([SlotIO(cmd.slot, cmd.key, host_page(cmd.host_page))
                                 for cmd in reads])

    def execute(self, job: ReadJob) -> Completion:
        command = job.command
        if isinstance(command, PrefetchSlots):
            return self._report(command.reads, self._prefetch(job, command.reads), "prefetch")
        reads = command.reads
        pages = [self._gpu_page(cmd.gpu_page) for cmd in reads]
        if not self._staging:
            job.fence.wait()
            results = self._timed_read(
                [SlotIO(cmd.slot, cmd.key, page) for cmd, page in zip(reads, pages, strict=True)]
            )
            if self._cuda:
                torch.cuda.current_stream(pages[0].device).synchronize()
        else:
            staging = self._staging
            results = self._timed_read(
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
        return self._report(reads, results, "onboard")

    @staticmethod
    def _report(reads: Sequence[ReadSlot | PrefetchSlot], results: BatchOutcome,
                what: str) -> Completion:
        outcomes: list[TransferOutcome] = []
        for cmd, error in zip(reads, results, strict=True):
            if error is None:
                outcomes.append(SlotRead(transfer=cmd.transfer))
            else:
                log.warning("%s of block %d from slot %d failed: %s", what, cmd.block,
                            cmd.slot, error)
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
        foreground: Foreground | None = None,
        host_page: Callable[[PageId], torch.Tensor] | None = None,
        checksums: HostChecksums | None = None,
        measured: Measured | None = None,
    ) -> None:
        super().__init__(
            "reader", workers=workers, queue_depth=queue_depth,
            make_worker=lambda _index: SlotReader(
                store, gpu_page, new_staging, device, batch_blocks, host_page=host_page,
                checksums=checksums, measured=measured,
            ),
            gate=gate, report=report, foreground=foreground,
        )
