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
anyone else afterwards, and a host page keeps the event of the last copy into it for as long
as the engine lives (one entry per host page at most).

No CUDA here: the event is opaque (a ``torch.cuda.Event`` in the engine, anything in
tests), which is what lets the bookkeeping be tested against a model of the two streams
on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    """The copy-stream event after the last copy into each host page.

    A worker thread that reads host pages (a spill write) waits on the newest of its pages'
    events and on nothing else: a copy into another page, queued before it, is not its
    concern.  A page with no entry was never filled by the copy stream (a disk read fills
    it from a host thread, done before the read reports), so it needs no wait.
    """

    def __init__(self) -> None:
        self._latest: dict[int, tuple[int, EventT]] = {}
        self._recorded = 0

    def filled(self, pages: Iterable[int], event: EventT) -> None:
        """`event` was recorded on the copy stream after copies into `pages` (and after every
        copy enqueued before them)."""
        self._recorded += 1
        entry = (self._recorded, event)
        latest = self._latest
        for page in pages:
            latest[page] = entry

    def newest(self, pages: Iterable[int]) -> EventT | None:
        """The one event after which every copy into any of `pages` has completed, or None
        when no copy ever filled one of them."""
        latest = self._latest
        newest = 0
        chosen: EventT | None = None
        for page in pages:
            entry = latest.get(page)
            if entry is not None and entry[0] > newest:
                newest, chosen = entry
        return chosen
