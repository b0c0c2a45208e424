"""The payload checksum of each host page, as the GPU -> host copy that filled it computed it.

A spill writes the payload checksum into the slot header.  With CUDA the copy that fills a host
page from a GPU page also runs a checksum kernel over the GPU page (one launch per batch of
copies, behind the copies on the copy stream), so a writer needs no CPU pass over the bytes.

An entry describes its page only while the page still holds the bytes that copy brought.  A
host page is also filled by a prefetch read (disk -> host), and what a prefetch brought can be
written to disk again: a block recalled from PREFETCHED keeps its page as a host copy, moves
back onto it when evicted from GPU, and once a spill has displaced its disk copy it is spilled
from that page.  Trusting the entry there writes a slot whose header disagrees with its payload:
every later read of it fails its checksum (found, never served, but the content is lost).  So
every filler of a host page other than the copy engine says so (:meth:`overwritten`), and a
writer checksums such a page on the CPU (:meth:`of` answers None).

Threads: the copy engine marks entries under its lock when it enqueues the kernel; a reader
thread clears them before its read lands in the page; a writer looks an entry up after its
fence.  The core gives a host page to one owner at a time (a copy, a read or a write), so the
three never touch one entry at once; the hand-offs between them (the scheduler's lock, the
worker queues) order the flag's updates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from statekv.errors import UsageError
from statekv.ids import PageId


class HostChecksums:
    """Per host page: its payload checksum, and whether that checksum is its bytes' current one."""

    def __init__(self, table: torch.Tensor) -> None:
        if (not isinstance(table, torch.Tensor) or table.dtype != torch.int32
                or table.dim() != 1 or table.device.type != "cpu"
                or not table.is_contiguous()):
            raise UsageError("table", "must be a contiguous 1-D int32 host tensor")
        self.table = table
        """One int32 entry per host page, written by the checksum kernel (pinned memory, which
        the kernel writes directly)."""
        self._values = table.numpy()
        self._current = np.zeros(table.numel(), dtype=np.bool_)

    def computed(self, pages: Sequence[PageId]) -> None:
        """The copy engine enqueued the copies into `pages` and the kernel that checksums
        them: their entries describe their bytes once the copy stream passes that point (a
        writer waits for it on its fence)."""
        self._current[list(pages)] = True

    def overwritten(self, pages: Sequence[PageId]) -> None:
        """`pages` are filled by something other than a GPU -> host copy (a disk read): their
        entries describe earlier bytes."""
        self._current[list(pages)] = False

    def of(self, page: PageId) -> int | None:
        """The page's payload checksum (unsigned 32-bit), or None when its entry does not
        describe its bytes (the writer computes it on the CPU then)."""
        if not self._current[page]:
            return None
        return int(self._values[page]) & 0xFFFFFFFF
