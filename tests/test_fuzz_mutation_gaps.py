"""Behaviour that mutation testing of statekv/ found no test pinning down (fuzz/README.md).

Each test names what a surviving mutant changed; the machines reach most of these paths too,
but only sometimes, so the mutants lived or died by luck.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from statekv import OutOfBlocks, RingTrace, UsageError
from statekv.block import Block
from statekv.lifecycle import BlockEvent
from statekv.messages import CopyHostToGpu, SlotReadFailed
from statekv.orderings import BlockList, PriorityLRU, RetentionHeap
from tests.harness import block_keys, fresh_tokens, make


def _block(i: int) -> Block:
    return Block(i)  # type: ignore[arg-type]


def test_appendleft_on_an_empty_list_makes_the_block_head_and_tail() -> None:
    lst = BlockList()
    a, b = _block(0), _block(1)
    lst.appendleft(a)
    assert lst.head is a and lst.tail is a
    lst.append(b)
    assert list(lst) == [a, b]
    lst.check()


@pytest.mark.parametrize(
    ("structure", "pop"),
    [("BlockList", lambda: BlockList().popleft()),
     ("PriorityLRU", lambda: PriorityLRU(1).pop()),
     ("RetentionHeap", lambda: RetentionHeap().pop())],
)
def test_popping_an_empty_structure_says_which(
    structure: str, pop: Callable[[], object]
) -> None:
    with pytest.raises(IndexError, match=f"^pop from an empty {structure}$"):
        pop()


def test_a_block_whose_stale_position_is_past_the_heap_is_not_in_it() -> None:
    heap = RetentionHeap()
    a, stray = _block(0), _block(1)
    a.heap_key = (1.0, 0, 1)
    heap.push(a)
    stray.heap_pos = len(heap)
    assert stray not in heap
    assert a in heap


def test_removing_from_the_middle_of_the_heap_keeps_every_position() -> None:
    heap = RetentionHeap()
    blocks = [_block(i) for i in range(5)]
    for i, block in enumerate(blocks):
        block.heap_key = (float(i), 0, i)
        heap.push(block)
    heap.remove(blocks[1])
    heap.check()
    assert [heap.pop() for _ in range(4)] == [blocks[0], blocks[2], blocks[3], blocks[4]]


def test_a_ring_of_one_keeps_the_last_transition() -> None:
    from statekv.ids import BlockId
    from statekv.lifecycle import BlockState

    trace = RingTrace(1)
    for t in (1.0, 2.0):
        trace.record(t, BlockId(0), None, BlockState.FREE, BlockState.ON_GPU,
                     BlockEvent.ALLOCATED)
    (only,) = trace.records()
    assert only.time == 2.0


def test_append_tokens_refuses_text_and_bytes() -> None:
    ex = make()
    ex.add("r", [1, 2, 3])
    for bad in ("abc", b"abc"):
        with pytest.raises(UsageError, match="token_ids: must be a sequence of integer token"):
            ex.cache.append_tokens("r", bad)  # type: ignore[arg-type]


def test_append_tokens_past_the_gpu_says_how_big_the_request_would_grow() -> None:
    ex = make()
    ex.add("r", [1, 2, 3])
    with pytest.raises(UsageError, match=r"would grow to 9 tokens, more than 4 GPU blocks of 2"):
        ex.cache.append_tokens("r", [0] * 6)


def test_out_of_blocks_says_how_many_were_needed_and_obtainable() -> None:
    ex = make()
    ex.add("r", fresh_tokens(8))
    ex.cache.allocate_nowait("r", 8, now=ex.now)
    ex.add("s", [1])
    with pytest.raises(OutOfBlocks, match=r"'s' needs 1 more GPU blocks, 0 obtainable"):
        ex.cache.allocate_nowait("s", 1, now=ex.now)


def test_completing_an_unknown_transfer_names_it() -> None:
    ex = make()
    with pytest.raises(UsageError, match="no read 99 is in flight"):
        ex.cache.handle(SlotReadFailed(transfer=99, cause="x"), now=0.0)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="not a completion"):
        ex.cache.handle("done", now=0.0)  # type: ignore[arg-type]


def test_cached_blocks_report_the_priority_of_their_last_holder() -> None:
    ex = make(priority_levels=3)
    doc = fresh_tokens(3)
    ex.serve("r", doc, priority=2)
    (cached,) = ex.cached().values()
    assert cached.priority == 2


def test_a_recall_copies_the_recalled_block_back() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=0)
    doc = fresh_tokens(5)
    ex.serve("r", doc)
    ex.churn("c")
    assert ex.tiers(doc) == ["ON_HOST", "ON_HOST"]
    start = len(ex.log)
    ex.add("again", doc)
    recalls = [c for c in ex.log[start:] if isinstance(c, CopyHostToGpu)]
    keys = block_keys(doc, ex.bs)
    assert sorted(c.block for c in recalls) == sorted(
        next(b for b in ex.cache._records if b.key == key).id for key in keys
    )


def test_a_failed_read_rewinds_in_the_name_of_the_request() -> None:
    from statekv import KVCacheManager
    from tests.harness import Executor, config

    trace = RingTrace(10_000)
    ex = Executor(KVCacheManager(config(gpu_blocks=4, host_blocks=1, disk_blocks=2),
                                 trace=trace))
    doc = fresh_tokens(3)
    ex.spill([doc])
    ex.add("a", [*doc, 1])
    ex.cache.allocate_nowait("a", 4, now=ex.now)  # a page for the block after the read
    ex.pump()
    before = trace.recorded
    ex.land_read(ok=False)
    after = list(trace.records())[-(trace.recorded - before):]
    dropped = [r for r in after if r.event is BlockEvent.DISCARDED and r.request is not None]
    assert [r.request for r in dropped] == ["a"]
