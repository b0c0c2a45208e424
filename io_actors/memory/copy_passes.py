"""A call's page copies, in both directions, as two passes that can each run as one kernel.

An admission that recalls host blocks into a full GPU alternates directions at every block:
it copies a victim out of a GPU page, then a recalled block into that page, and the next
victim into the host page the recall just read (the spill reserve hands it straight back).
Run in order, every such copy is its own DMA, and on a GPU the serving thread pays a launch
for each.  Nor can the copies go as one kernel, whose thread blocks run in no defined order:
a copy into a page would race the copy out of it.

What the copies leave behind does not depend on their order, though, once it is written in
terms of the pages' contents at the call's start: following each copy's source back through
the earlier copies of the call gives the page whose starting bytes each destination ends
with (its *origin*).  So the call becomes:

1. *stash*: every origin that the call also overwrites is copied to a scratch page (and so
   is a host origin whose bytes end in a host page: the checksum kernel reads device pages);
2. *moves*: every destination whose bytes change is copied from its origin, or from the
   origin's scratch page.

No pass reads a page the same pass writes, and no page is written twice in a pass, so each
can be one kernel.  A host page the call fills gets the checksum of its final bytes, read
from a device page holding them after the stash.  A call whose stash would not fit the
scratch is split into consecutive segments, planned and run one after the other.

Pure: no torch, no device.  The copy engine (:mod:`io_actors.memory.pools`) runs the passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

# Pool numbers (a copy engine indexes its pools by them).
GPU: Final = 0
HOST: Final = 1
SCRATCH: Final = 2

Page = tuple[int, int]
"""(pool, page number): pool GPU, HOST or SCRATCH."""


@attrs.frozen(kw_only=True)
class CopyPasses:
    """One segment of a call's copies, as passes."""

    stash: tuple[tuple[Page, int], ...]
    """(page, scratch page) copies, run first."""
    moves: tuple[tuple[Page, Page], ...]
    """(source, destination) copies, run after the stash; a source may be a scratch page.
    No destination repeats, and no source is a destination."""
    checksums: tuple[tuple[Page, int], ...]
    """(device page holding its final bytes after the stash, host page) for every host page
    the segment fills; the device page is a GPU or a scratch page, never written by the
    moves."""
    copies: int
    """Copies of the call this segment stands for."""


def plan_passes(copies: Sequence[tuple[Page, Page]], scratch_pages: int
                ) -> list[CopyPasses]:
    """The passes that leave every page as `copies` applied one at a time, in order, would:
    (source, destination) pairs of (pool, page), each stash needing at most
    `scratch_pages` scratch pages (the call is split into segments where it would need
    more; a single copy never needs any)."""
    if scratch_pages < 0:
        raise ValueError(f"scratch_pages must be >= 0, got {scratch_pages}")
    segments: list[CopyPasses] = []
    pending = [copies]
    while pending:
        part = pending.pop()
        passes = _plan_segment(part)
        if len(passes.stash) <= scratch_pages or len(part) == 1:
            segments.append(passes)
        else:
            half = len(part) // 2
            pending += [part[half:], part[:half]]  # the first half is planned (and run) first
    return segments


def _plan_segment(copies: Sequence[tuple[Page, Page]]) -> CopyPasses:
    origin: dict[Page, Page] = {}
    for src, dst in copies:
        origin[dst] = origin.get(src, src)
    moved = {dst for dst, src in origin.items() if src != dst}
    slots: dict[Page, int] = {}
    for dst, src in origin.items():
        # Stashed: what a move overwrites, and a host page's bytes bound for a host page
        # (the checksum kernel reads them from the device).
        if src not in slots and (src in moved or (dst[0] == HOST and src[0] == HOST)):
            slots[src] = len(slots)

    def holder(page: Page) -> Page:
        slot = slots.get(page)
        return page if slot is None else (SCRATCH, slot)

    return CopyPasses(
        stash=tuple(slots.items()),
        moves=tuple((holder(src), dst) for dst, src in origin.items() if dst in moved),
        checksums=tuple((holder(src), dst[1]) for dst, src in origin.items()
                        if dst[0] == HOST),
        copies=len(copies),
    )
