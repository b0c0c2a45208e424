"""Messages between the core and the actors: plain frozen data carrying ids, never objects.

Commands are imperative (the core tells an actor to do something); completions are past
tense (an actor reports what happened).  The core emits commands into an outbox that the
scheduler actor drains with ``take_commands()``; actors feed completions back with
``handle(event, now)``.

Ordering contract for whoever executes commands (the actors, or a test harness):

1. Commands are executed in the order they are taken.
2. ``CopyGpuToHost`` and ``CopyHostToGpu`` are stream ordered: they run in command order on
   one copy stream, before any later forward pass that touches either page.  They cannot
   fail and report no completion.
3. A ``WriteSlot`` reads its host page only after every earlier copy has completed on the
   device (the page may have just been filled by a ``CopyGpuToHost``).
4. A ``ReadSlot`` writes its GPU page only after every earlier command has completed on the
   device (the page may have just been emptied by a ``CopyGpuToHost``), and reports
   ``SlotRead`` only once its bytes are complete on the device.
5. At most one read or write is in flight per slot: the core never issues a second one
   before the first has reported back.
"""

from __future__ import annotations

import attrs

from statekv.ids import BlockHash, BlockId, PageId, SlotId, TransferId

# --- commands -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CopyGpuToHost:
    """Copy one block's KV from a GPU page into a pinned host page (GPU eviction)."""

    block: BlockId
    gpu_page: PageId
    host_page: PageId


@attrs.frozen(kw_only=True)
class CopyHostToGpu:
    """Copy one block's KV from a pinned host page into a GPU page (host prefix hit)."""

    block: BlockId
    host_page: PageId
    gpu_page: PageId


@attrs.frozen(kw_only=True)
class WriteSlot:
    """Write one block's KV from a host page to a disk slot (spill); report SlotWritten."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    host_page: PageId
    slot: SlotId
    retained: bool
    """The block carries an unexpired TTL: a write that must never be shed."""
    # What the slot header stores so that a later process can restore the block (None /
    # zero where a caller has no chain to give: such a slot is reclaimed, never restored).
    parent: BlockHash | None = None
    """Key of the previous block of the chain (the root key for a first block)."""
    depth: int = 0
    reuse_count: int = 0
    expiry: float | None = None
    """The block's retention deadline, on the core's clock (wall-clock seconds)."""
    issued_at: float = 0.0
    """The core's `now` when it issued the write."""


@attrs.frozen(kw_only=True)
class ReadSlot:
    """Read one block's KV from a disk slot into a GPU page (onboard); report SlotRead."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    slot: SlotId
    gpu_page: PageId


@attrs.frozen(kw_only=True)
class FreeSlot:
    """The slot's content left the cache; its bytes must never be served again."""

    slot: SlotId


Command = CopyGpuToHost | CopyHostToGpu | WriteSlot | ReadSlot | FreeSlot

# --- completions ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SlotWritten:
    """A WriteSlot completed: every byte is in the slot."""

    transfer: TransferId


@attrs.frozen(kw_only=True)
class SlotWriteFailed:
    """A WriteSlot failed (I/O error, short write, no space)."""

    transfer: TransferId
    cause: str


@attrs.frozen(kw_only=True)
class SlotRead:
    """A ReadSlot completed: the bytes are verified and complete on the device."""

    transfer: TransferId


@attrs.frozen(kw_only=True)
class SlotReadFailed:
    """A ReadSlot failed (I/O error, short read, header or checksum mismatch)."""

    transfer: TransferId
    cause: str


Completion = SlotWritten | SlotWriteFailed | SlotRead | SlotReadFailed
