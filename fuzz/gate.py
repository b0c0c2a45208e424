"""A completion gate that holds every finished transfer until the fuzz harness releases it.

The real write or read has already happened when a completion reaches the gate (the bytes are
in the slot, or in the GPU page); only its report to the scheduler waits.  Releasing one held
completion at a time, chosen by transfer id, makes Hypothesis -- not thread timing -- decide
which pending write or read the core learns about next.  A batch's completion is held, and
released, as one, under its name (its first transfer id); counts are per block transfer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import trio

from statekv.ids import TransferId
from statekv.messages import (
    Completion,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    is_read,
    outcomes,
)

PASSED_KINDS = ("written", "write failed", "read", "read failed")


def _kind(outcome: Completion) -> str:
    """The PASSED_KINDS entry of one block transfer's outcome."""
    if isinstance(outcome, SlotWritten):
        return "written"
    if isinstance(outcome, SlotWriteFailed):
        return "write failed"
    return "read failed" if isinstance(outcome, SlotReadFailed) else "read"


class FuzzGate:
    """:class:`io_actors.actors.gate.CompletionGate` holding completions by transfer id."""

    def __init__(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._held: dict[TransferId, tuple[Completion, trio.Event]] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._open = False
        self._passed = {kind: 0 for kind in PASSED_KINDS}

    async def hold(self, completion: Completion) -> None:
        with self._lock:
            if self._open:
                self._pass_locked(completion)
                return
            event = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            self._held[completion.transfer] = (completion, event)
        self._notify()
        await event.wait()
        with self._lock:
            self._pass_locked(completion)

    def _pass_locked(self, completion: Completion) -> None:
        for outcome in outcomes(completion):  # counted per block transfer, as pools count
            self._passed[_kind(outcome)] += 1

    def passed(self) -> dict[str, int]:
        """Block transfers let through to the scheduler so far, by kind (see PASSED_KINDS):
        the harness's own count of what each pool reported."""
        with self._lock:
            return dict(self._passed)

    def held(self) -> dict[TransferId, Completion]:
        """Completions waiting at the gate, by transfer id."""
        with self._lock:
            return {tid: held[0] for tid, held in self._held.items()}

    def counts(self) -> tuple[int, int, int, int]:
        """Block transfers held: (writes, reads, failed writes, failed reads)."""
        writes = reads = failed_writes = failed_reads = 0
        with self._lock:
            for completion, _event in self._held.values():
                for outcome in outcomes(completion):
                    if isinstance(outcome, SlotReadFailed):
                        failed_reads += 1
                    elif isinstance(outcome, SlotWriteFailed):
                        failed_writes += 1
                    if is_read(outcome):
                        reads += 1
                    else:
                        writes += 1
        return writes, reads, failed_writes, failed_reads

    def jobs(self) -> tuple[int, int]:
        """Completions held (a batch is one): (write jobs, read jobs)."""
        with self._lock:
            reads = sum(1 for completion, _event in self._held.values() if is_read(completion))
            return len(self._held) - reads, reads

    def release(self, tid: TransferId) -> Completion:
        """Let the completion of transfer `tid` through to the scheduler."""
        with self._lock:
            completion, event = self._held.pop(tid)
            token = self._token
        assert token is not None
        token.run_sync_soon(event.set)
        return completion

    def open(self) -> None:
        """Let every held completion through, and every later one pass at once."""
        with self._lock:
            self._open = True
            held = list(self._held.values())
            self._held.clear()
            token = self._token
        if token is None:
            return
        for _completion, event in held:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                return
