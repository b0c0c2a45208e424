"""Allocation-free ordered collections of blocks, every operation O(1) or O(log n).

* :class:`BlockList` -- an intrusive doubly linked list (FIFO / LRU), links live in the
  blocks, so removing a block from the middle is O(1) and allocates nothing.
* :class:`DiskList` -- the same on a second pair of links, for the disk tier's best-effort
  order (a block with a disk copy is in it and in a GPU or host order at once).
* :class:`PriorityLRU` -- one BlockList per priority level plus a bitmask of the non-empty
  levels: the victim is the oldest block of the lowest non-empty level, found in O(1).
* :class:`RetentionHeap` -- an indexed binary min-heap: every block knows its position, so a
  block that leaves the disk is removed at once and no stale entry is ever left behind (the
  seed's deadline list leaked them).

A block is in at most one of the BlockList-based orders and at most one of the disk orders
(DiskList, RetentionHeap) at a time; `check` methods verify the links and are for
tests and fuzzing only.
"""

from __future__ import annotations

from collections.abc import Iterator

from statekv.block import Block
from statekv.errors import InvariantViolation


class BlockList:
    """Intrusive doubly linked list of blocks, oldest at the head."""

    __slots__ = ("head", "size", "tail")

    def __init__(self) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        """Add as the newest (evicted last)."""
        tail = self.tail
        block.prev = tail
        block.next = None
        if tail is None:
            self.head = block
        else:
            tail.next = block
        self.tail = block
        self.size += 1

    def appendleft(self, block: Block) -> None:
        """Add as the oldest (evicted first)."""
        head = self.head
        block.next = head
        block.prev = None
        if head is None:
            self.tail = block
        else:
            head.prev = block
        self.head = block
        self.size += 1

    def remove(self, block: Block) -> None:
        _unlink(self, block)

    def popleft(self) -> Block:
        block = self.head
        if block is None:
            raise IndexError("pop from an empty BlockList")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[Block]:
        node = self.head
        while node is not None:
            yield node
            node = node.next

    def check(self) -> None:
        """Verify the links; raises InvariantViolation."""
        count = 0
        prev: Block | None = None
        node = self.head
        while node is not None:
            if node.prev is not prev:
                raise InvariantViolation(f"broken back link at {node!r}")
            prev = node
            node = node.next
            count += 1
            if count > self.size:
                raise InvariantViolation("list longer than its size (cycle?)")
        if prev is not self.tail or count != self.size:
            raise InvariantViolation(f"list size {self.size} but {count} linked blocks")


class DiskList:
    """BlockList on the blocks' disk links: the disk tier's best-effort order.

    Apart from every other order because a block with a disk copy is in it and, at the same
    time, in the GPU or host order of the tier it is on.
    """

    __slots__ = ("head", "size", "tail")

    def __init__(self) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        """Add as the newest (displaced last)."""
        tail = self.tail
        block.disk_prev = tail
        block.disk_next = None
        if tail is None:
            self.head = block
        else:
            tail.disk_next = block
        self.tail = block
        self.size += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.disk_prev, block.disk_next
        if prev is None:
            self.head = nxt
        else:
            prev.disk_next = nxt
        if nxt is None:
            self.tail = prev
        else:
            nxt.disk_prev = prev
        block.disk_prev = block.disk_next = None
        self.size -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self.head
        while node is not None:
            yield node
            node = node.disk_next

    def check(self) -> None:
        """Verify the links; raises InvariantViolation."""
        count = 0
        prev: Block | None = None
        node = self.head
        while node is not None:
            if node.disk_prev is not prev:
                raise InvariantViolation(f"broken back link at {node!r}")
            prev = node
            node = node.disk_next
            count += 1
            if count > self.size:
                raise InvariantViolation("list longer than its size (cycle?)")
        if prev is not self.tail or count != self.size:
            raise InvariantViolation(f"list size {self.size} but {count} linked blocks")


def _unlink(lst: BlockList, block: Block) -> bool:
    """Unlink `block` from the level list `lst`; True when that leaves the level empty.

    BlockList.remove, and the emptiness test PriorityLRU.remove and remove_all need.  A
    module function, which PriorityLRU calls directly: a method lookup more per call would
    cost remove once per GPU prefix hit and remove_all's loop once per block of a hit.
    """
    prev, nxt = block.prev, block.next
    if prev is None:
        lst.head = nxt
    else:
        prev.next = nxt
    if nxt is None:
        lst.tail = prev
    else:
        nxt.prev = prev
    block.prev = block.next = None
    lst.size -= 1
    return lst.size == 0


class PriorityLRU:
    """Evictable blocks by (priority, age): lowest priority first, oldest first within one."""

    __slots__ = ("_levels", "_mask", "size")

    def __init__(self, levels: int) -> None:
        self._levels = [BlockList() for _ in range(levels)]
        self._mask = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, block: Block) -> None:
        """Add `block` as the newest of its priority level (`block.priority`)."""
        level = block.priority
        self._levels[level].append(block)
        self._mask |= 1 << level
        self.size += 1

    def push_all(self, blocks: list[Block], level: int) -> None:
        """Add `blocks`, oldest first, as the newest of priority `level` (their priority)."""
        lst = self._levels[level]
        tail = lst.tail
        for block in blocks:
            block.prev = tail
            block.next = None
            if tail is None:
                lst.head = block
            else:
                tail.next = block
            tail = block
        lst.tail = tail
        lst.size += len(blocks)
        self.size += len(blocks)
        if blocks:
            self._mask |= 1 << level

    def remove(self, block: Block) -> None:
        level = block.priority
        if _unlink(self._levels[level], block):
            self._mask &= ~(1 << level)
        self.size -= 1

    def remove_all(self, blocks: list[Block]) -> None:
        """remove for each of `blocks` (the evictable ones of a prefix hit), in one call."""
        levels = self._levels
        mask = self._mask
        for block in blocks:
            level = block.priority
            if _unlink(levels[level], block):
                mask &= ~(1 << level)
        self._mask = mask
        self.size -= len(blocks)

    def peek(self) -> Block | None:
        """The next victim, or None when empty."""
        mask = self._mask
        if mask == 0:
            return None
        level = (mask & -mask).bit_length() - 1
        return self._levels[level].head

    def pop(self) -> Block:
        """Remove and return the next victim (peek + remove, inlined: one per eviction)."""
        mask = self._mask
        if not mask:
            raise IndexError("pop from an empty PriorityLRU")
        level = (mask & -mask).bit_length() - 1
        lst = self._levels[level]
        block = lst.head
        assert block is not None
        nxt = block.next
        lst.head = nxt
        if nxt is None:
            lst.tail = None
            self._mask = mask & ~(1 << level)
        else:
            nxt.prev = None
        block.next = None
        lst.size -= 1
        self.size -= 1
        return block

    def pop_run(self, count: int) -> list[Block]:
        """Remove and return the next `count` victims, in eviction order (what `count` pops
        return), unlinking each level's run at once: one allocation evicts a run of blocks."""
        if count > self.size:
            raise IndexError(f"pop_run({count}) from a PriorityLRU of {self.size}")
        out: list[Block] = []
        levels = self._levels
        mask = self._mask
        left = count
        while left:
            level = (mask & -mask).bit_length() - 1
            lst = levels[level]
            block = lst.head
            take = min(left, lst.size)
            for _ in range(take):
                assert block is not None
                out.append(block)
                nxt = block.next
                block.prev = block.next = None
                block = nxt
            lst.head = block
            lst.size -= take
            if block is None:
                lst.tail = None
                mask &= ~(1 << level)
            else:
                block.prev = None
            left -= take
        self._mask = mask
        self.size -= count
        return out

    def __iter__(self) -> Iterator[Block]:
        """Blocks in eviction order."""
        for lst in self._levels:
            yield from lst

    def check(self) -> None:
        total = 0
        for level, lst in enumerate(self._levels):
            lst.check()
            if bool(lst.size) != bool(self._mask & (1 << level)):
                raise InvariantViolation(f"priority mask disagrees with level {level}")
            for block in lst:
                if block.priority != level:
                    raise InvariantViolation(f"{block!r} filed under priority {level}")
            total += lst.size
        if total != self.size:
            raise InvariantViolation(f"PriorityLRU size {self.size} but {total} blocks")


class RetentionHeap:
    """Min-heap of blocks on `block.heap_key`, with O(log n) removal of any member."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[Block] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block: Block) -> bool:
        pos = block.heap_pos
        return 0 <= pos < len(self._heap) and self._heap[pos] is block

    def peek(self) -> Block | None:
        return self._heap[0] if self._heap else None

    def push(self, block: Block) -> None:
        heap = self._heap
        block.heap_pos = len(heap)
        heap.append(block)
        self._sift_up(block.heap_pos)

    def pop(self) -> Block:
        if not self._heap:
            raise IndexError("pop from an empty RetentionHeap")
        block = self._heap[0]
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        heap = self._heap
        pos = block.heap_pos
        last = heap.pop()
        block.heap_pos = -1
        if last is block:
            return
        heap[pos] = last
        last.heap_pos = pos
        self._sift_down(pos)
        self._sift_up(last.heap_pos)

    def __iter__(self) -> Iterator[Block]:
        """Members in no particular order."""
        return iter(list(self._heap))

    def _sift_up(self, pos: int) -> None:
        heap = self._heap
        block = heap[pos]
        key = block.heap_key
        while pos > 0:
            parent_pos = (pos - 1) >> 1
            parent = heap[parent_pos]
            if key < parent.heap_key:
                heap[pos] = parent
                parent.heap_pos = pos
                pos = parent_pos
            else:
                break
        heap[pos] = block
        block.heap_pos = pos

    def _sift_down(self, pos: int) -> None:
        heap = self._heap
        n = len(heap)
        block = heap[pos]
        key = block.heap_key
        while True:
            child = 2 * pos + 1
            if child >= n:
                break
            right = child + 1
            if right < n and heap[right].heap_key < heap[child].heap_key:
                child = right
            if heap[child].heap_key < key:
                heap[pos] = heap[child]
                heap[pos].heap_pos = pos
                pos = child
            else:
                break
        heap[pos] = block
        block.heap_pos = pos

    def check(self) -> None:
        heap = self._heap
        for pos, block in enumerate(heap):
            if block.heap_pos != pos:
                raise InvariantViolation(f"{block!r} thinks it is at {block.heap_pos}, not {pos}")
            if pos and heap[(pos - 1) >> 1].heap_key > block.heap_key:
                raise InvariantViolation(f"heap order broken at {pos}")
