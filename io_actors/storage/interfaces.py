"""The seams between the actors and the things that move bytes.

The actors (scheduler, writer pool, reader pool) are written against these protocols only;
the concrete slot stores live next to this module in ``io_actors.storage`` (opened by name
through ``io_actors.storage.open_store``) and the torch memory pools in
``io_actors.memory.pools``.  Tests and the fuzz suite wrap them (fault injection, completion
gates) at exactly these seams.

All methods of a :class:`SlotStore` block and are called from worker threads, never from the
trio thread.  They raise :class:`statekv.errors.TransferFailed` on any failure (I/O error,
short read or write, failed open, header or checksum mismatch) and never return bad bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch

from io_actors.storage.retention_journal import RetentionRecord
from io_actors.storage.slot_format import SlotMeta
from statekv.errors import TransferFailed
from statekv.ids import BlockHash, PageId, SlotId


@attrs.frozen
class SlotIO:
    """One slot's part of a batched transfer: the source (write) or destination (read)."""

    slot: SlotId
    key: BlockHash
    buffer: torch.Tensor
    """uint8, one block: a host page to write from, or a page or staging view to read into."""
    crc: int | None = None
    """A write's payload checksum when it was computed elsewhere (on the GPU, by the copy
    that filled the host page), of the slot format this build writes (CRC-32C, version 3);
    None: the store computes it.  A wrong value can only make
    the slot fail its check when read back, never serve wrong bytes."""
    meta: SlotMeta | None = None
    """A write's restore metadata for the slot header (what an index rebuild needs)."""


BatchOutcome = list[TransferFailed | None]
"""One entry per item of a batch, in order: None when it landed (verified, for a read)."""


class Fence(Protocol):
    """A point in the copy stream: every copy enqueued before it, and every piece of work
    the compute stream had queued before those copies (a page just freed by the core may
    still be read or written by a forward pass in flight)."""

    def wait(self) -> None:
        """Block the calling (worker) thread until all of that completed on the device."""


CopyRun = tuple[bool, Sequence[tuple[PageId, PageId]]]
"""(to_gpu, pairs): copies of one direction, host -> GPU when to_gpu, else GPU -> host, as
(source page, destination page) pairs."""


class CopyEngine(Protocol):
    """Executes the core's GPU <-> host copies in command order on one copy stream."""

    def copy_gpu_to_host(self, gpu_page: PageId, host_page: PageId) -> None: ...

    def copy_host_to_gpu(self, host_page: PageId, gpu_page: PageId) -> None: ...

    def copy_pages(self, pairs: Sequence[tuple[PageId, PageId]], *, to_gpu: bool) -> None:
        """Many copies of one direction, in order: (source, destination) page pairs."""

    def copy_runs(self, runs: Sequence[CopyRun]) -> None:
        """Runs of copies, each of one direction, all in order, as one call."""

    def fence(self) -> Fence:
        """A fence after every copy enqueued so far (readers wait on it)."""
        ...

    def fence_for_host_pages(self, host_pages: Iterable[int]) -> Fence:
        """A fence after the last copy enqueued so far into each of `host_pages` (a spill
        write, which reads only those pages, waits on it)."""
        ...

    def order_before_compute(self) -> None:
        """Copies were just enqueued: order later compute-stream work after them as the
        engine's mode says (all of them, or none here and each pass's own pages at
        :meth:`wait_for_pages`)."""

    @property
    def orders_by_page(self) -> bool:
        """Whether :meth:`wait_for_pages` does anything (else every copy is waited for)."""
        ...

    def wait_for_pages(self, gpu_pages: Iterable[int]) -> None:
        """Before a forward pass over `gpu_pages`: order it after their copies (a no-op
        where :meth:`order_before_compute` already ordered every copy)."""


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

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        """Write a batch of slots, as few system calls as the layout allows.

        Never raises TransferFailed: each item's failure is its entry of the result, and the
        items that landed are landed (a batch is never all-or-nothing).  UsageError for a
        caller's bug (a bad slot, key or buffer), before any byte moves.
        """
        ...

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        """Read and verify a batch of slots; outcomes as for :meth:`write_many`.

        A failed item's buffer holds unspecified bytes and must not be published.
        """
        ...

    def discard(self, slot: SlotId) -> None:
        """The slot's content left the cache (a hint: it may be invalidated or trimmed)."""

    def close(self) -> None: ...


@runtime_checkable
class RetentionStore(Protocol):
    """A store that keeps lengthened retention deadlines across restarts (optional: a store
    without it keeps each block's spill-time deadline, and the scheduler drops the records).
    """

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        """Append the records durably under the store's sync policy; raises TransferFailed
        when they could not be (the deadlines then live in memory only)."""


def write_each(store: SlotStore, writes: Sequence[SlotIO]) -> BatchOutcome:
    """write_many as one `write` per item (wrappers whose faults are per call)."""
    out: BatchOutcome = []
    for item in writes:
        try:
            store.write(item.slot, item.key, item.buffer, item.meta)
        except TransferFailed as exc:
            out.append(exc)
        else:
            out.append(None)
    return out


def read_each(store: SlotStore, reads: Sequence[SlotIO]) -> BatchOutcome:
    """read_many as one `read` per item."""
    out: BatchOutcome = []
    for item in reads:
        try:
            store.read(item.slot, item.key, item.buffer)
        except TransferFailed as exc:
            out.append(exc)
        else:
            out.append(None)
    return out
