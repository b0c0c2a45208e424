"""The writer pool actor: N workers draining one bounded queue of spill writes.

* One bounded queue of capacity ``write_queue_depth`` feeds every worker; a full queue blocks
  only the scheduler's spill feeder task (backpressure on spills), never the serving loop's
  step.
* Each write first waits on the copy-stream fence taken when it was dispatched, so it reads
  its host page only after the GPU -> host copy that filled it has completed.
* A failed write (I/O error, short write, no space) reports SlotWriteFailed with its cause,
  logged once with the slot; the core then keeps the block on host.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import torch

from io_actors.gate import CompletionGate
from io_actors.interfaces import Fence, SlotStore
from io_actors.slot_format import SlotMeta
from io_actors.worker_threads import WorkerThreads
from statekv.errors import TransferFailed
from statekv.ids import PageId
from statekv.messages import Completion, SlotWriteFailed, SlotWritten, WriteSlot

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
    command: WriteSlot
    fence: Fence


class SlotWriter:
    """One worker thread's executor."""

    def __init__(self, store: SlotStore, host_page: Callable[[PageId], torch.Tensor]) -> None:
        self._store = store
        self._host_page = host_page

    def execute(self, job: WriteJob) -> Completion:
        cmd = job.command
        try:
            job.fence.wait()
            self._store.write(cmd.slot, cmd.key, self._host_page(cmd.host_page),
                              slot_meta(cmd))
        except TransferFailed as exc:
            log.warning("spill of block %d to slot %d failed: %s", cmd.block, cmd.slot, exc)
            return SlotWriteFailed(transfer=cmd.transfer, cause=str(exc))
        return SlotWritten(transfer=cmd.transfer)

    def close(self) -> None:
        return None


class WriterPool(WorkerThreads[WriteJob]):
    """Spill writes, executed by `workers` threads of their own."""

    def __init__(
        self,
        store: SlotStore,
        host_page: Callable[[PageId], torch.Tensor],
        *,
        workers: int,
        queue_depth: int,
        gate: CompletionGate,
        report: Callable[[Completion], Awaitable[None]],
    ) -> None:
        super().__init__(
            "writer", workers=workers, queue_depth=queue_depth,
            make_worker=lambda _index: SlotWriter(store, host_page),
            gate=gate, report=report, is_failure=lambda c: isinstance(c, SlotWriteFailed),
        )
