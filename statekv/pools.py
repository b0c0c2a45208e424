"""Per-tier storage: GPU pages, pinned host pages, disk slots.

Each pool owns the *storage* of its tier and the order in which cached content leaves it;
the blocks (content) are records of :mod:`statekv.records`, and :mod:`statekv.eviction`
and :mod:`statekv.disk_tier` decide which of them leave.  An empty page or slot is always
used before any cached content is evicted or displaced -- the seed once filed empty disk
slots above fresh content, so spills displaced each other while empty slots sat unused.
"""

from __future__ import annotations

from statekv.arith import is_live, retention_order
from statekv.block import Block
from statekv.errors import InvariantViolation
from statekv.ids import PageId, SlotId
from statekv.orderings import DiskList, PriorityLRU, RetentionHeap


class PagePool:
    """Pages of one memory tier: empty pages, and evictable cached blocks in LRU order."""

    __slots__ = ("capacity", "empty", "evictable")

    def __init__(self, capacity: int, priority_levels: int) -> None:
        self.capacity = capacity
        # A stack: popping from the end is O(1); lowest page ids are handed out first.
        self.empty: list[PageId] = [PageId(p) for p in reversed(range(capacity))]
        self.evictable = PriorityLRU(priority_levels)

    def obtainable(self) -> int:
        """Pages that can be had now: empty ones plus one per evictable block."""
        return len(self.empty) + self.evictable.size


class HostPagePool(PagePool):
    """Pinned host pages, plus a reserve handed to spills while their victim drains.

    A spill keeps its victim's page until the write lands and hands out a reserved page at
    once instead; when a page comes back it refills the reserve first (one out, one in).

    Host copies (the inclusive host tier, statekv.lifecycle): a block recalled to the GPU
    keeps the host page it came from, holding the same immutable bytes, when the page would
    otherwise have gone to the empty list -- never when it would have refilled the reserve.
    Such a page is as free as an empty one: it is handed out after the empty pages and
    before any cached content is evicted (oldest copy first), and taking it only forgets
    the copy (the block stays on GPU).  So the host tier holds exactly what it held before
    copies existed, and a GPU victim with a copy moves to host with no copy at all.
    """

    __slots__ = ("copies", "reserve_target", "reserved")

    def __init__(self, capacity: int, reserved: int, priority_levels: int) -> None:
        super().__init__(capacity, priority_levels)
        self.reserve_target = reserved
        self.reserved: list[PageId] = [PageId(p) for p in reversed(range(capacity,
                                                                        capacity + reserved))]
        self.copies: dict[Block, None] = {}
        """Blocks on GPU (ON_GPU or RELEASED) whose host_page is a host copy, oldest first
        (an insertion-ordered dict used as an ordered set: O(1) add, remove and oldest)."""

    def give_back(self, page: PageId) -> None:
        """A page is free again: refill the reserve first."""
        if len(self.reserved) < self.reserve_target:
            self.reserved.append(page)
        else:
            self.empty.append(page)

    def free_count(self) -> int:
        """Pages that can be had without evicting anything: empty ones and host copies."""
        return len(self.empty) + len(self.copies)

    def take_free(self) -> PageId | None:
        """An empty page, else the oldest host copy's page (the copy is forgotten); None
        when neither is left."""
        if self.empty:
            return self.empty.pop()
        copies = self.copies
        if copies:
            block = next(iter(copies))
            return self.forget_copy(block)
        return None

    def keep_copy(self, block: Block, page: PageId) -> bool:
        """`block` is now on GPU and `page` still holds its bytes: keep the page as its host
        copy, unless the page is owed to the reserve (then it refills it).  True if kept."""
        if len(self.reserved) < self.reserve_target:
            self.reserved.append(page)
            return False
        block.host_page = page
        self.copies[block] = None
        return True

    def forget_copy(self, block: Block) -> PageId:
        """`block` (on GPU) no longer has a host copy: returns the page, for the caller to
        use or give back."""
        del self.copies[block]
        page = block.host_page
        assert page is not None
        block.host_page = None
        return page


class DiskSlots:
    """Disk slots and the displacement order of REQUIREMENTS section 5.

    Order in which a new spill takes a slot:

    1. an empty slot;
    2. best-effort content, first in first out by the time it became best-effort: when it
       landed on disk, or -- for retained content -- when its TTL ran out (in deadline order
       among those that expire together);
    3. retained content, by :func:`statekv.arith.retention_order` -- exact expiry, then a
       suffix before its prefix, then first in first out -- and only when the admission
       policy allows displacing unexpired content.

    `retained` holds exactly the disk blocks whose TTL is running: an entry leaves the heap
    the moment its block is onboarded, displaced or expires (no stale deadlines).

    A block with a disk copy (on GPU or host with its slot kept: statekv.lifecycle) is filed
    here exactly as an ON_DISK block of its retention class would be; displacing it takes
    only the copy.
    """

    __slots__ = ("capacity", "empty", "retained", "unmarked")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.empty: list[SlotId] = [SlotId(s) for s in reversed(range(capacity))]
        self.unmarked = DiskList()
        self.retained = RetentionHeap()

    def file(self, block: Block, now: float, seq: int) -> None:
        """`block` just landed on disk: order it for displacement."""
        if is_live(block.expiry, now):
            assert block.expiry is not None
            block.heap_key = retention_order(block.expiry, block.depth, seq)
            self.retained.push(block)
        else:
            self.unmarked.append(block)  # FIFO: the list's order is the arrival order

    def unfile(self, block: Block) -> None:
        """`block` leaves the disk (onboarded, or its copy displaced): forget its place."""
        if block.heap_pos >= 0:
            self.retained.remove(block)
        else:
            self.unmarked.remove(block)

    def expire(self, now: float) -> list[Block]:
        """Move content whose TTL ran out to the best-effort class; returns those blocks."""
        expired: list[Block] = []
        heap = self.retained
        while True:
            head = heap.peek()
            if head is None or is_live(head.expiry, now):
                break
            expired.append(heap.pop())
        for block in expired:
            self.unmarked.append(block)
        return expired

    def next_victim(self, may_displace_live: bool) -> Block | None:
        """The block a new spill would displace (call only when no slot is empty)."""
        head = self.unmarked.head
        if head is not None:
            return head
        if may_displace_live:
            return self.retained.peek()
        return None

    def check(self) -> None:
        self.unmarked.check()
        self.retained.check()
        if len(set(self.empty)) != len(self.empty):
            raise InvariantViolation("a disk slot is on the empty list twice")
