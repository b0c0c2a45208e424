"""The seams between the actors and the things that move bytes.

The actors (scheduler, writer pool, reader pool) are written against these protocols only;
the concrete backends live in ``io_actors.backends`` and the torch memory pools in
``io_actors.memory``.  Tests and the fuzz suite wrap them (fault injection, completion gates)
at exactly these seams.

All methods of a :class:`SlotStore` block and are called from worker threads, never from the
trio thread.  They raise :class:`statekv.errors.TransferFailed` on any failure (I/O error,
short read or write, failed open, header or checksum mismatch) and never return bad bytes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from io_actors.slot_format import SlotMeta
from statekv.ids import BlockHash, PageId, SlotId


class Fence(Protocol):
    """A point in the copy stream: every copy enqueued before it, and every piece of work
    the compute stream had queued before those copies (a page just freed by the core may
    still be read or written by a forward pass in flight)."""

    def wait(self) -> None:
        """Block the calling (worker) thread until all of that completed on the device."""


class CopyEngine(Protocol):
    """Executes the core's GPU <-> host copies in command order on one copy stream."""

    def copy_gpu_to_host(self, gpu_page: PageId, host_page: PageId) -> None: ...

    def copy_host_to_gpu(self, host_page: PageId, gpu_page: PageId) -> None: ...

    def fence(self) -> Fence:
        """A fence after every copy enqueued so far (writers and readers wait on it)."""
        ...

    def order_before_compute(self) -> None:
        """Make later work on the compute stream wait for every copy enqueued so far."""


class SlotStore(Protocol):
    """Disk slots: one block's KV per slot, behind a self-describing header."""

    @property
    def device_reads(self) -> bool:
        """Whether `read` can fill device (GPU) memory directly (GPUDirect Storage)."""
        ...

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        """Write `src` (a uint8 host tensor of one block) with its header and checksum;
        `meta` is what an index rebuild needs to serve the slot after a restart."""

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        """Fill `dst` (uint8, one block) from the slot; verify header, length and checksum.

        After TransferFailed the contents of `dst` are unspecified: the caller must not
        publish them (the reader pool reports SlotReadFailed and the core never serves them).
        """

    def discard(self, slot: SlotId) -> None:
        """The slot's content left the cache (a hint: it may be invalidated or trimmed)."""

    def close(self) -> None: ...
