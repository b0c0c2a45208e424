"""Which copy batches a forward pass must wait for: the last batch that touched each GPU page.

The copy engine runs every host <-> GPU page copy on one CUDA copy stream, in command order,
and records an event after each batch.  A forward pass (the compute stream) must not touch a
GPU page before the last copy that touched it has completed:

* *into* the page (host -> GPU): the step reads the bytes the copy brings (a read before the
  copy completed would see the page's previous content);
* *out of* the page (GPU -> host, a spill or a write-through): the page may have been freed
  by that eviction and handed to a request whose step now writes new K/V into it (a write
  before the copy completed would send the new bytes to the host page instead of the old
  ones).  A step that only reads such a page (a shared, immutable full block) would not need
  the wait, but telling the two apart needs the step's write set, which the cache does not
  see; waiting costs that rare case some overlap, never correctness.

So the ledger keeps, per GPU page, the sequence number of the last batch that touched it in
either direction, and the step waits only for the newest such batch among its own pages.
The other direction of each hazard -- a copy must not read a GPU page before the forward
pass that writes it finished, nor overwrite one that an earlier forward pass still reads --
is the copy engine's: the copy stream waits for the compute stream before every batch.

Because one stream runs the batches in order, batch ``k`` completing (or the compute stream
waiting for it) implies the same for every batch before it: one watermark, ``settled``,
says "every batch up to here needs no more waiting", and a step issues at most one stream
wait, for the newest batch among its pages.  Waiting for batch ``k`` still waits for the
batches enqueued before it (the stream's order); batches enqueued after it -- other
requests' copies, spills that the step does not touch -- never delay it.

Pure bookkeeping, with events as opaque objects and a `query` callable that says whether
one completed (``torch.cuda.Event.query`` on CUDA), so that it is tested without a GPU.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import attrs

from statekv.errors import InvariantViolation, UsageError

E = TypeVar("E")


@attrs.frozen(kw_only=True)
class LedgerStatistics:
    """Counters of one ledger."""

    batches: int
    """Copy batches recorded."""
    pending: int
    """Batches neither known complete nor waited for by the compute stream."""
    waits: int
    """Waits handed to the compute stream (at most one per `wait_for` call)."""
    waits_skipped: int
    """`wait_for` calls that needed no wait: none of the pages had a batch in flight."""


class PageCopyLedger(Generic[E]):
    """Per GPU page, the last copy batch that touched it; which batch a step must wait for.

    Not thread safe: the copy engine calls it under its own lock.
    """

    def __init__(self, gpu_pages: int, query: Callable[[E], bool]) -> None:
        self._query = query
        self._last_batch = [0] * gpu_pages
        """Per GPU page, the sequence number of the last batch touching it (0: none)."""
        self._pending: collections.deque[tuple[int, E]] = collections.deque()
        """Every batch newer than `_settled`, oldest first, with its event."""
        self._recorded = 0
        self._settled = 0
        """Every batch up to this one has completed or is waited for by the compute stream."""
        self._waits = 0
        self._waits_skipped = 0

    def record(self, gpu_pages: Sequence[int], event: E) -> int:
        """A batch touching `gpu_pages` was enqueued, `event` recorded after it; its number."""
        self._recorded += 1
        seq = self._recorded
        last = self._last_batch
        for page in gpu_pages:
            last[page] = seq
        self._pending.append((seq, event))
        self._retire()
        return seq

    def _retire(self) -> None:
        """Drop the batches known complete, oldest first (the stream completes them in order:
        the first one still running ends the walk)."""
        pending = self._pending
        while pending and self._query(pending[0][1]):
            self._settled = pending.popleft()[0]

    def wait_for(self, gpu_pages: Sequence[int]) -> E | None:
        """The event the compute stream must wait for before a step touches `gpu_pages`: that
        of the newest batch among them still in flight, or None when there is none.  The
        caller makes the compute stream wait for it before anything else is enqueued there;
        the ledger then counts that batch and every earlier one as settled.

        raises: UsageError("pages") for a page outside the pool.
        """
        if not self._pending:
            self._waits_skipped += 1
            return None
        self._retire()
        if not gpu_pages:
            self._waits_skipped += 1
            return None
        last = self._last_batch
        try:
            if min(gpu_pages) < 0:
                raise IndexError
            newest = max(map(last.__getitem__, gpu_pages))
        except (IndexError, TypeError):
            raise UsageError("pages", f"must be GPU page numbers in [0, {len(last)})") from None
        if newest <= self._settled:
            self._waits_skipped += 1
            return None
        pending = self._pending
        while pending[0][0] < newest:
            pending.popleft()
        seq, event = pending.popleft()
        if seq != newest:
            raise InvariantViolation(f"copy batch {newest} is missing from the pending list")
        self._settled = newest
        self._waits += 1
        return event

    def settle_all(self) -> None:
        """The compute stream was made to wait for every batch recorded so far."""
        self._pending.clear()
        self._settled = self._recorded

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(batches=self._recorded, pending=len(self._pending),
                                waits=self._waits, waits_skipped=self._waits_skipped)

    def check_invariants(self) -> None:
        seqs = [seq for seq, _event in self._pending]
        expected = list(range(self._settled + 1, self._recorded + 1))
        if seqs != expected:
            raise InvariantViolation(
                f"pending batches {seqs[:5]}... are not every batch after {self._settled} "
                f"up to {self._recorded}"
            )
        if max(self._last_batch, default=0) > self._recorded:
            raise InvariantViolation("a page names a batch that was never recorded")
