"""The allocation-free orderings: BlockList, PriorityLRU, RetentionHeap."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from statekv.arith import retention_order
from statekv.block import Block
from statekv.errors import InvariantViolation
from statekv.ids import BlockId
from statekv.orderings import BlockList, PriorityLRU, RetentionHeap


def blocks(n: int, priority: int = 0) -> list[Block]:
    return [Block(BlockId(i), priority=priority) for i in range(n)]


def ids(items: object) -> list[int]:
    return [b.id for b in items]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- BlockList


def test_block_list_is_first_in_first_out() -> None:
    lst = BlockList()
    a, b, c = blocks(3)
    for block in (a, b, c):
        lst.append(block)
    assert len(lst) == 3
    assert ids(lst) == [0, 1, 2]
    assert lst.popleft() is a
    assert lst.popleft() is b
    assert ids(lst) == [2]
    lst.check()


def test_block_list_appendleft_puts_a_block_first_in_line() -> None:
    lst = BlockList()
    a, b, c = blocks(3)
    lst.append(a)
    lst.append(b)
    lst.appendleft(c)
    assert ids(lst) == [2, 0, 1]
    assert lst.head is c and lst.tail is b
    lst.check()


@pytest.mark.parametrize("position", [0, 1, 2])
def test_block_list_removes_any_member_in_constant_time_keeping_links(position: int) -> None:
    lst = BlockList()
    members = blocks(3)
    for block in members:
        lst.append(block)
    gone = members[position]
    lst.remove(gone)
    assert gone.prev is None and gone.next is None
    assert ids(lst) == [b.id for b in members if b is not gone]
    assert len(lst) == 2
    lst.check()


def test_block_list_emptied_has_no_head_or_tail() -> None:
    lst = BlockList()
    (a,) = blocks(1)
    lst.append(a)
    lst.remove(a)
    assert lst.head is None and lst.tail is None and len(lst) == 0
    lst.check()
    with pytest.raises(IndexError):
        lst.popleft()


def test_block_list_check_detects_a_broken_back_link() -> None:
    lst = BlockList()
    a, b, c = blocks(3)
    for block in (a, b, c):
        lst.append(block)
    c.prev = a
    with pytest.raises(InvariantViolation):
        lst.check()


def test_block_list_check_detects_a_wrong_size() -> None:
    lst = BlockList()
    for block in blocks(2):
        lst.append(block)
    lst.size = 3
    with pytest.raises(InvariantViolation):
        lst.check()


# ---------------------------------------------------------------------- PriorityLRU


def test_priority_lru_evicts_the_lowest_priority_first_whatever_its_age() -> None:
    lru = PriorityLRU(4)
    high = Block(BlockId(0), priority=3)
    low = Block(BlockId(1), priority=1)
    lru.push(high)
    lru.push(low)
    assert lru.peek() is low
    assert lru.pop() is low
    assert lru.pop() is high
    assert lru.peek() is None and len(lru) == 0


def test_priority_lru_evicts_the_oldest_first_within_a_priority() -> None:
    lru = PriorityLRU(2)
    members = blocks(3, priority=1)
    for block in members:
        lru.push(block)
    assert [lru.pop() for _ in range(3)] == members


def test_priority_lru_iterates_in_eviction_order() -> None:
    lru = PriorityLRU(3)
    order = [Block(BlockId(i), priority=p) for i, p in enumerate([2, 0, 1, 0, 2])]
    for block in order:
        lru.push(block)
    assert ids(lru) == [1, 3, 2, 0, 4]
    lru.check()


def test_priority_lru_removing_the_last_of_a_level_moves_to_the_next_level() -> None:
    lru = PriorityLRU(3)
    low = Block(BlockId(0), priority=0)
    mid = Block(BlockId(1), priority=2)
    lru.push(low)
    lru.push(mid)
    lru.remove(low)
    assert lru.peek() is mid
    lru.check()


def test_priority_lru_pop_from_empty_raises_index_error() -> None:
    with pytest.raises(IndexError):
        PriorityLRU(2).pop()


def test_priority_lru_check_detects_a_block_filed_under_another_priority() -> None:
    lru = PriorityLRU(2)
    (block,) = blocks(1)
    lru.push(block)
    block.priority = 1
    with pytest.raises(InvariantViolation):
        lru.check()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 50)), max_size=60))
def test_priority_lru_matches_a_sorted_model(ops: list[tuple[bool, int, int]]) -> None:
    """Push (priority) or remove (a member); the victim is always min by (priority, age)."""
    lru = PriorityLRU(4)
    model: list[tuple[int, int, Block]] = []  # (priority, age, block)
    for age, (push, priority, pick) in enumerate(ops):
        if push or not model:
            block = Block(BlockId(age), priority=priority)
            lru.push(block)
            model.append((priority, age, block))
        else:
            entry = model.pop(pick % len(model))
            lru.remove(entry[2])
        lru.check()
        assert len(lru) == len(model)
        expected = min(model, key=lambda e: (e[0], e[1]))[2] if model else None
        assert lru.peek() is expected
        assert list(lru) == [e[2] for e in sorted(model, key=lambda e: (e[0], e[1]))]


# ---------------------------------------------------------------------- RetentionHeap


def keyed(i: int, key: tuple[float, int, int]) -> Block:
    block = Block(BlockId(i))
    block.heap_key = key
    return block


def test_retention_heap_pops_in_key_order() -> None:
    heap = RetentionHeap()
    keys = [(5.0, 0, 1), (1.0, 0, 2), (3.0, -1, 3), (3.0, 0, 4), (1.0, 0, 0)]
    members = [keyed(i, k) for i, k in enumerate(keys)]
    for block in members:
        heap.push(block)
    heap.check()
    popped = [heap.pop().heap_key for _ in range(len(keys))]
    assert popped == sorted(keys)
    assert all(b.heap_pos == -1 for b in members)


def test_retention_heap_removal_leaves_no_stale_entry() -> None:
    heap = RetentionHeap()
    members = [keyed(i, (float(i), 0, i)) for i in range(6)]
    for block in members:
        heap.push(block)
    gone = members[2]
    heap.remove(gone)
    assert gone not in heap
    assert gone.heap_pos == -1
    assert len(heap) == 5
    assert gone not in list(heap)
    heap.check()
    assert all(b in heap for b in members if b is not gone)


def test_retention_heap_pop_from_empty_raises_index_error() -> None:
    heap = RetentionHeap()
    assert heap.peek() is None
    with pytest.raises(IndexError):
        heap.pop()


def test_retention_heap_check_detects_a_broken_order() -> None:
    heap = RetentionHeap()
    a, b = keyed(0, (1.0, 0, 0)), keyed(1, (2.0, 0, 1))
    heap.push(a)
    heap.push(b)
    a.heap_key = (3.0, 0, 0)
    with pytest.raises(InvariantViolation):
        heap.check()


def test_retention_order_is_expiry_then_deeper_first_then_fifo() -> None:
    assert retention_order(10.0, 0, 9) < retention_order(10.5, 5, 0)
    assert retention_order(10.0, 3, 9) < retention_order(10.0, 2, 0)
    assert retention_order(10.0, 2, 1) < retention_order(10.0, 2, 2)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 20), st.integers(0, 4)),
        st.tuples(st.just("remove"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("pop"), st.just(0), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_retention_heap_behaves_like_a_sorted_list(ops: list[tuple[str, int, int]]) -> None:
    heap = RetentionHeap()
    model: list[Block] = []  # kept sorted by heap_key
    removed: list[Block] = []
    for seq, (op, expiry, depth) in enumerate(ops):
        if op == "push":
            block = keyed(seq, retention_order(float(expiry), depth, seq))
            heap.push(block)
            model.append(block)
            model.sort(key=lambda b: b.heap_key)
        elif op == "remove" and model:
            block = model.pop(expiry % len(model))
            heap.remove(block)
            removed.append(block)
        elif op == "pop" and model:
            assert heap.pop() is model.pop(0)
        heap.check()
        assert len(heap) == len(model)
        assert heap.peek() is (model[0] if model else None)
        assert all(b in heap for b in model)
        assert not any(b in heap for b in removed)
    drained = []
    while len(heap):
        drained.append(heap.pop())
    assert drained == model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.data())
def test_priority_lru_pop_run_returns_what_as_many_pops_would(
        priorities: list[int], data: st.DataObject) -> None:
    """pop_run(n) unlinks the next n victims across levels, in order, as n pops do."""
    runs, pops = PriorityLRU(4), PriorityLRU(4)
    for age, priority in enumerate(priorities):
        runs.push(Block(BlockId(age), priority=priority))
        pops.push(Block(BlockId(age), priority=priority))
    while len(pops):
        count = data.draw(st.integers(1, len(pops)))
        run = runs.pop_run(count)
        assert ids(run) == ids(pops.pop() for _ in range(count))
        assert all(b.prev is None and b.next is None for b in run)
        runs.check()
        assert ids(runs) == ids(pops)
    with pytest.raises(IndexError):
        runs.pop_run(1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=40))
def test_priority_lru_remove_all_leaves_what_removing_each_would(
        members: list[tuple[int, bool]]) -> None:
    """remove_all(some) unlinks them from their levels as one remove call each would."""
    together, one_by_one = PriorityLRU(4), PriorityLRU(4)
    leaving: tuple[list[Block], list[Block]] = ([], [])
    for age, (priority, leaves) in enumerate(members):
        for lru, out in ((together, leaving[0]), (one_by_one, leaving[1])):
            block = Block(BlockId(age), priority=priority)
            lru.push(block)
            if leaves:
                out.append(block)
    together.remove_all(leaving[0])
    for block in leaving[1]:
        one_by_one.remove(block)
    together.check()
    assert ids(together) == ids(one_by_one)
    assert all(b.prev is None and b.next is None for b in leaving[0])
    assert (together.peek() is None) == (one_by_one.peek() is None)
