"""Which copy-stream point each page's copies end at: for each GPU page, until a forward pass
that uses the page has waited for it (the copy engine's ``compute_waits="pages"``); for each
host page, the last copy that filled it, which a spill write of the page waits for.

The copy stream runs its copies in enqueue order, so one event recorded after a batch of
copies stands for every copy enqueued before it; a page needs only the latest event after
a copy that read or wrote it.  A forward pass waits on one event: the latest among its
pages' events, which covers the others.  A wait on the compute stream holds for every later
piece of work on it, so an event waited for once is never waited for again: a watermark of
the newest event waited for makes every page's older entry void.

A host thread's wait is different: it blocks only that thread, so nothing is covered for
anyone else afterwards; a host page's last fill is forgotten only once it is known complete.

No CUDA here: the event is opaque (a ``torch.cuda.Event`` in the engine, anything in
tests), which is what lets the bookkeeping be tested against a model of the two streams
on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, Generic, TypeVar

EventT = TypeVar("EventT")

COMPUTE_WAITS: Final = ("all", "pages")
"""What a forward pass waits for on the copy stream (TorchCopyEngine, StateKVConfig): every
copy enqueued before it, or only the copies of the pages it uses."""


class PendingPageCopies(Generic[EventT]):
    """The latest copy-stream event after each GPU page's copies, not yet waited for.

    At most one entry per GPU page: a page's entry is replaced by its next copy's and
    removed by the first pass that uses it (an entry older than the watermark is void).
    """

    def __init__(self) -> None:
        self._latest: dict[int, tuple[int, EventT]] = {}
        self._recorded = 0
        """Events recorded so far: each one's number is its place in copy-stream order."""
        self._waited = 0
        """The number of the newest event a forward pass waited for (0: none)."""

    def copied(self, pages: Iterable[int], event: EventT) -> None:
        """`event` was recorded on the copy stream after copies that read or wrote `pages`
        (and after every copy enqueued before them)."""
        self._recorded += 1
        entry = (self._recorded, event)
        latest = self._latest
        for page in pages:
            latest[page] = entry

    def take(self, pages: Iterable[int]) -> EventT | None:
        """The one event a forward pass that reads or writes `pages` must wait for, or None
        when none of them has a copy it has not been ordered after.  The caller makes the
        compute stream wait for it before that pass; from then on every copy it stands for
        counts as waited for."""
        latest = self._latest
        if not latest:
            return None
        newest = self._waited
        chosen: EventT | None = None
        for page in pages:
            entry = latest.pop(page, None)
            if entry is not None and entry[0] > newest:
                newest, chosen = entry
        if chosen is not None:
            self._waited = newest
            if newest == self._recorded:
                latest.clear()  # every entry is void: the next passes find none at once
        return chosen

    def pending(self) -> int:
        """Pages with a copy no forward pass has been ordered after yet."""
        return sum(1 for number, _event in self._latest.values() if number > self._waited)


class HostPageFills(Generic[EventT]):
    """The copy-stream event after the last copy into each host page, while it may still be
    pending.

    A worker thread that reads host pages (a spill write) waits on the newest of its pages'
    events and on nothing else: a copy into another page, queued before it, is not its
    concern.  A page no copy ever filled (a disk read fills one from a host thread, done
    before the read reports), or whose last fill is known complete, needs no wait.

    Only events not yet known complete are kept (`done` says whether one is; the copy
    stream completes them in order, so the oldest is asked first): a page remembers the
    number of its last fill, not an event, and a host pool of any size holds only the
    events of the copies still in flight.
    """

    def __init__(self, done: Callable[[EventT], bool]) -> None:
        self._done = done
        self._filled_at: dict[int, int] = {}
        """Each host page's last fill, by its number in copy-stream order."""
        self._in_flight: dict[int, EventT] = {}
        """Fill number -> its event, oldest first, for the fills not known complete."""
        self._recorded = 0
        self._complete = 0
        """Every fill up to this number has completed."""

    def filled(self, pages: Iterable[int], event: EventT) -> None:
        """`event` was recorded on the copy stream after copies into `pages` (and after every
        copy enqueued before them)."""
        self._forget_completed()
        self._recorded += 1
        number = self._recorded
        filled_at = self._filled_at
        for page in pages:
            filled_at[page] = number
        self._in_flight[number] = event

    def newest(self, pages: Iterable[int]) -> EventT | None:
        """The one event after which every copy into any of `pages` has completed, or None
        when there is nothing to wait for."""
        self._forget_completed()
        filled_at = self._filled_at
        number = max((filled_at.get(page, 0) for page in pages), default=0)
        return None if number <= self._complete else self._in_flight[number]

    def in_flight(self) -> int:
        """Fills whose completion is not known yet (the events held)."""
        return len(self._in_flight)

    def _forget_completed(self) -> None:
        in_flight = self._in_flight
        done = self._done
        while in_flight:
            number = next(iter(in_flight))
            if not done(in_flight[number]):
                return
            del in_flight[number]
            self._complete = number
