"""Which copy batches a forward pass -- or another copy -- must wait for: per page, the last
batch that touched it.

The copy engine runs host <-> GPU page copies in batches on a few CUDA copy streams
("lanes"), records an event after each batch, and keeps here, per GPU page and per host
page, the batch that last touched it.  Two kinds of consumer order themselves after those
batches, each waiting only for the batches that touched *its* pages:

* **The compute stream**, before a step touches a GPU page, waits for the last batch that
  copied into it or out of it:

  - *into* the page (host -> GPU): the step reads the bytes the copy brings (a read before
    the copy completed would see the page's previous content);
  - *out of* the page (GPU -> host, a spill or a write-through): the page may have been
    freed by that eviction and handed to a request whose step now writes new K/V into it
    (a write before the copy completed would send the new bytes to the host page instead of
    the old ones).  A step that only reads such a page (a shared, immutable full block)
    would not need the wait, but telling the two apart needs the step's write set, which
    the cache does not see; waiting costs that rare case some overlap, never correctness.

* **A copy lane**, before a batch, waits for the last batch on another lane that touched
  any of the batch's pages, GPU or host: a GPU page copied out (spilled) and then into
  (reused), a host page filled by a spill and then read by a recall, a host page read by a
  recall and then overwritten by a spill, a page recalled and spilled again.  Batches on one
  lane run in order.

Waiting for the last batch of a page is enough: that batch itself waited for the one before
it on the same page (through its lane's order or a wait of this kind), so the order is
transitive.  The other direction of each hazard -- a copy must not read a GPU page before
the forward pass that writes it has finished, nor overwrite one that an earlier forward
pass still reads -- is the copy engine's: every lane waits for the compute stream before
each batch.

Batches that share no page with a consumer's pages never delay it: a spill on one lane and
a step's recall on another run side by side, and the step waits for the recall alone.  On a
lane, batches complete in order, so a consumer keeps, per lane, the newest batch it already
waits for, and a batch known complete (its event queried) is covered for everyone.

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

COMPUTE: int = -1
"""The consumer id of the compute stream (lanes are 0 .. lanes - 1)."""


@attrs.frozen(kw_only=True)
class LedgerStatistics:
    """Counters of one ledger."""

    batches: int
    """Copy batches recorded."""
    pending: int
    """Batches not known complete."""
    waits: int
    """Events handed to the compute stream to wait for."""
    waits_skipped: int
    """`wait_for` calls that needed no wait: none of the pages had a batch in flight."""
    lane_waits: int
    """Events handed to a copy lane to wait for (a batch on another lane shared a page)."""


class PageCopyLedger(Generic[E]):
    """Per page, the last copy batch that touched it; which batches a consumer must wait for.

    Batches carry one sequence number across all lanes, so that "every batch up to `g` is
    complete" is one comparison, the fast path of every lookup.  Not thread safe: the copy
    engine calls it under its own lock.
    """

    def __init__(self, gpu_pages: int, query: Callable[[E], bool], *, host_pages: int = 0,
                 lanes: int = 1) -> None:
        if lanes < 1:
            raise UsageError("lanes", f"must be at least 1, got {lanes}")
        self._query = query
        self._lanes = lanes
        self._gpu_last = [0] * gpu_pages
        """Per GPU page, the number of the last batch touching it (0: none)."""
        self._host_last = [0] * host_pages
        self._pending: list[collections.deque[int]] = [collections.deque() for _ in range(lanes)]
        """Per lane, its batches not known complete, oldest first."""
        self._lane_of: dict[int, int] = {}
        self._event_of: dict[int, E] = {}
        """Lane and event of every batch not known complete."""
        self._done = [0] * lanes
        """Per lane, the newest batch known complete (its older batches are complete too)."""
        self._waited: dict[int, list[int]] = {c: [0] * lanes for c in range(COMPUTE, lanes)}
        """Per consumer, per lane, the newest batch of that lane it already waits for."""
        self._recorded = 0
        self._waits = 0
        self._waits_skipped = 0
        self._lane_waits = 0

    @property
    def lanes(self) -> int:
        return self._lanes

    def record(self, lane: int, gpu_pages: Sequence[int], host_pages: Sequence[int],
               event: E) -> int:
        """A batch on `lane` touching these pages was enqueued, `event` recorded after it;
        returns its number.  Call :meth:`lane_waits_for` first, for the same pages."""
        self._recorded += 1
        seq = self._recorded
        for page in gpu_pages:
            self._gpu_last[page] = seq
        for page in host_pages:
            self._host_last[page] = seq
        self._pending[lane].append(seq)
        self._lane_of[seq] = lane
        self._event_of[seq] = event
        self._retire()
        return seq

    def _retire(self) -> None:
        """Drop the batches known complete, oldest first on each lane (a lane completes its
        batches in order: the first one still running ends that lane's walk)."""
        for lane, pending in enumerate(self._pending):
            while pending and self._query(self._event_of[pending[0]]):
                seq = pending.popleft()
                del self._lane_of[seq], self._event_of[seq]
                self._done[lane] = seq

    def idlest_lane(self) -> int:
        """The lane with the fewest batches in flight (the lowest such): where a new batch
        waits behind the least unrelated work."""
        self._retire()
        return min(range(self._lanes), key=lambda lane: len(self._pending[lane]))

    def _needed(self, consumer: int, lasts: list[int], pages: Sequence[int],
                field: str) -> dict[int, int]:
        """Per lane (other than the consumer's own), the newest batch among `pages` that the
        consumer does not wait for yet and that is not known complete."""
        waited = self._waited[consumer]
        # Every batch older than each lane's oldest uncovered one is covered: one bound for
        # the fast path (most pages were last touched long ago).
        floor = self._recorded
        for lane, pending in enumerate(self._pending):
            if lane == consumer:
                continue
            for seq in pending:
                if seq > waited[lane]:
                    floor = min(floor, seq - 1)
                    break
        _check_pages(lasts, pages, field)
        try:
            recent = [seq for seq in map(lasts.__getitem__, pages) if seq > floor]
        except TypeError:  # a page that compares like a number but does not index
            raise UsageError(field, f"must be page numbers in [0, {len(lasts)})") from None
        need: dict[int, int] = {}
        lane_of = self._lane_of
        for seq in recent:
            if seq not in lane_of:
                continue  # complete
            lane = lane_of[seq]
            if lane == consumer or seq <= waited[lane]:
                continue  # ordered by the consumer's own lane, or waited for already
            if seq > need.get(lane, 0):
                need[lane] = seq
        return need

    def _take(self, consumer: int, need: dict[int, int]) -> list[E]:
        waited = self._waited[consumer]
        events = []
        for lane, seq in sorted(need.items()):
            waited[lane] = seq
            events.append(self._event_of[seq])
        return events

    def wait_for(self, gpu_pages: Sequence[int]) -> list[E]:
        """The events the compute stream must wait for before a step touches `gpu_pages`: at
        most one per lane, none when no batch touching them is in flight.  The caller makes
        the compute stream wait for them before anything else is enqueued there.

        raises: UsageError("pages") for a page outside the GPU pool.
        """
        self._retire()
        if not self._lane_of:
            _check_pages(self._gpu_last, gpu_pages, "pages")
            self._waits_skipped += 1
            return []
        events = self._take(COMPUTE, self._needed(COMPUTE, self._gpu_last, gpu_pages, "pages"))
        if events:
            self._waits += len(events)
        else:
            self._waits_skipped += 1
        return events

    def lane_waits_for(self, lane: int, gpu_pages: Sequence[int],
                       host_pages: Sequence[int]) -> list[E]:
        """The events `lane` must wait for before a batch touching these pages: those of the
        newest batch per other lane that touched any of them and is still in flight."""
        self._retire()
        if not self._lane_of:
            return []
        if not 0 <= lane < self._lanes:
            raise UsageError("lane", f"must be in [0, {self._lanes}), got {lane}")
        need = self._needed(lane, self._gpu_last, gpu_pages, "gpu_pages")
        for other, seq in self._needed(lane, self._host_last, host_pages, "host_pages").items():
            need[other] = max(need.get(other, 0), seq)
        events = self._take(lane, need)
        self._lane_waits += len(events)
        return events

    def settle_all(self) -> None:
        """The compute stream was made to wait for every batch recorded so far."""
        waited = self._waited[COMPUTE]
        for lane, pending in enumerate(self._pending):
            if pending:
                waited[lane] = max(waited[lane], pending[-1])

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(batches=self._recorded, pending=len(self._lane_of),
                                waits=self._waits, waits_skipped=self._waits_skipped,
                                lane_waits=self._lane_waits)

    def check_invariants(self) -> None:
        seen: list[int] = []
        for lane, pending in enumerate(self._pending):
            seqs = list(pending)
            if seqs != sorted(seqs) or any(self._lane_of.get(s) != lane for s in seqs):
                raise InvariantViolation(f"lane {lane}: pending batches {seqs[:5]} out of "
                                         "order or filed under another lane")
            if seqs and seqs[0] <= self._done[lane]:
                raise InvariantViolation(f"lane {lane}: batch {seqs[0]} pending but complete")
            seen += seqs
        if sorted(seen) != sorted(self._lane_of) or set(self._lane_of) != set(self._event_of):
            raise InvariantViolation("the pending lanes and the batch tables disagree")
        if max(self._gpu_last + self._host_last, default=0) > self._recorded:
            raise InvariantViolation("a page names a batch that was never recorded")


def _check_pages(lasts: list[int], pages: Sequence[int], field: str) -> None:
    """raises: UsageError(field) unless every page is an integer in [0, len(lasts))."""
    try:
        if pages and (min(pages) < 0 or max(pages) >= len(lasts)):
            raise IndexError
    except (IndexError, TypeError):
        raise UsageError(field, f"must be page numbers in [0, {len(lasts)})") from None
