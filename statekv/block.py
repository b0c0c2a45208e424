"""The block record: one piece of KV content and where its bytes are now.

Records are made once, when the manager is built, and recycled through a free list: the hot
path allocates nothing (vLLM's block pool does the same).  They are mutable and slotted on
purpose -- attrs' docs measure frozen slotted instances at about twice the cost to create, and
these are touched on every operation.  Configuration and messages stay frozen.

A record never holds its own lifecycle logic: `state` changes only through
:data:`statekv.lifecycle.TRANSITIONS`, applied by :mod:`statekv.records`.
"""

from __future__ import annotations

import attrs

from statekv.ids import BlockHash, BlockId, PageId, RequestId, SlotId, TransferId
from statekv.lifecycle import BlockState


@attrs.define(eq=False, slots=True, repr=False)
class Block:
    """A content record; see the table in statekv.lifecycle for what each state owns."""

    id: BlockId
    state: BlockState = BlockState.FREE

    # Content identity (meaningful while the block is in the prefix index).
    key: BlockHash | None = None
    """Chained key; not None exactly when the prefix index maps this key to this block."""
    parent_key: BlockHash | None = None
    """Key of the previous block of the chain (the root key for the first block)."""
    depth: int = 0
    """Position in the chain: a suffix is always deeper than its prefix."""
    reuse_count: int = 0
    """Prefix hits on this content; survives tier moves (it is content, not storage)."""
    expiry: float | None = None
    """Retention stamp: the time until which a TTL request asked to keep this content."""
    priority: int = 0
    published: bool = False
    """Offered to the shared tier since it was cached (offered once: CacheConfig.publish_on)."""

    # Holders.
    ref_count: int = 0
    waiters: list[RequestId] = attrs.field(factory=list)
    """Requests parked until this block's read lands (empty unless ONBOARDING)."""
    prefetchers: list[RequestId] = attrs.field(factory=list)
    """Queued requests that asked for this block ahead of admission (empty unless
    PREFETCHING or PREFETCHED; a PREFETCHING block whose requests all left has none)."""

    # Storage: where the bytes are now (which fields are set is fixed by `state`).
    gpu_page: PageId | None = None
    host_page: PageId | None = None
    disk_slot: SlotId | None = None
    """The slot holding the bytes: in SPILLING, ON_DISK, ONBOARDING, PREFETCHING and
    PREFETCHED; in ON_GPU, RELEASED or ON_HOST it is a valid disk copy (lifecycle)."""
    transfer: TransferId | None = None
    """The read or write in flight for this block (SPILLING / ONBOARDING)."""

    # Intrusive links of the one ordered list that holds the block, if any.
    prev: Block | None = None
    next: Block | None = None
    # Links of the disk tier's best-effort order: a block with a disk copy is in it while it
    # is also in a GPU or host order.
    disk_prev: Block | None = None
    disk_next: Block | None = None
    heap_pos: int = -1
    """Index in the retention heap, -1 when not in it."""
    heap_key: tuple[float, int, int] = (0.0, 0, 0)

    def __repr__(self) -> str:
        return f"<Block {self.id} {self.state.name} depth={self.depth} refs={self.ref_count}>"
