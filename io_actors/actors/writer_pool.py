"""The writer pool actor: N workers draining one bounded queue of spill writes.

* One bounded queue of capacity ``write_queue_depth`` feeds every worker; a full queue blocks
  only the scheduler's spill feeder task (backpressure on spills), never the serving loop's
  step.
* A job is one ``WriteSlots`` batch: one wait on the copy-stream fence taken for its host
  pages when it was dispatched (so every host page is read only after the GPU -> host copy
  that filled it has completed, and no later copy is waited for), one ``write_many`` call
  (vector I/O), one ``BatchFinished`` report.
* A failed write (I/O error, short write, no space) is reported as that block's
  SlotWriteFailed with its cause, logged with the slot; the core keeps that block on host.
  The batch's other blocks landed or failed on their own.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import torch

from io_actors.actors.foreground import Foreground
from io_actors.actors.gate import CompletionGate
from io_actors.actors.worker_threads import WorkerThreads
from io_actors.memory.host_checksums import HostChecksums
from io_actors.storage.interfaces import Fence, SlotIO, SlotStore
from io_actors.storage.slot_format import SlotMeta
from statekv.ids import PageId
from statekv.messages import (
    BatchFinished,
    Completion,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
    WriteSlot,
    WriteSlots,
)

log = logging.getLogger(__name__)
_U32 = 2**32 - 1


def slot_meta(cmd: WriteSlot) -> SlotMeta | None:
    """What the slot header stores so that a later process can restore the block."""
    if cmd.parent is None:
        return None
    return SlotMeta(
        parent=cmd.parent, depth=cmd.depth, reuse_count=min(cmd.reuse_count, _U32),
        expiry=cmd.expiry, written_at=cmd.issued_at, sequence=cmd.transfer,
    )


@attrs.frozen
class WriteJob:
    command: WriteSlots
    fence: Fence


class SlotWriter:
    """One worker thread's executor."""

    def __init__(
        self, store: SlotStore, host_page: Callable[[PageId], torch.Tensor],
        checksums: HostChecksums | None = None,
    ) -> None:
        self._store = store
        self._host_page = host_page
        # KVPools.host_checksums, read after the fence (the kernel that wrote an entry ran on
        # the copy stream before it): no CPU pass over the payload where an entry is current.
        self._checksums = checksums

    def execute(self, job: WriteJob) -> Completion:
        writes = job.command.writes
        page = self._host_page
        job.fence.wait()
        checksums = self._checksums
        results = self._store.write_many([
            SlotIO(cmd.slot, cmd.key, page(cmd.host_page),
                   None if checksums is None else checksums.of(cmd.host_page),
                   slot_meta(cmd))
            for cmd in writes
        ])
        outcomes: list[TransferOutcome] = []
        for cmd, error in zip(writes, results, strict=True):
            if error is None:
                outcomes.append(SlotWritten(transfer=cmd.transfer))
            else:
                log.warning("spill of block %d to slot %d failed: %s", cmd.block, cmd.slot,
                            error)
                outcomes.append(SlotWriteFailed(transfer=cmd.transfer, cause=str(error)))
        return BatchFinished(outcomes=tuple(outcomes))

    def close(self) -> None:
        return None


class WriterPool(WorkerThreads[WriteJob]):
    """Spill writes, executed by `workers` threads of their own."""

    def __init__(
        self,
        store: SlotStore,
        host_page: Callable[[PageId], torch.Tensor],
        *,
        checksums: HostChecksums | None = None,
        workers: int,
        queue_depth: int,
        gate: CompletionGate,
        report: Callable[[Completion], Awaitable[None]],
        foreground: Foreground | None = None,
    ) -> None:
        super().__init__(
            "writer", workers=workers, queue_depth=queue_depth,
            make_worker=lambda _index: SlotWriter(store, host_page, checksums),
            gate=gate, report=report, foreground=foreground,
        )
