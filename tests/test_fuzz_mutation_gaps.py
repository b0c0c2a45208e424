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
from tests.harness import Executor, block_keys, fresh_tokens, make


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
        next(b for b in ex.cache._records.all if b.key == key).id for key in keys
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


def _three_tier_prefix() -> tuple[Executor, list[int]]:
    """A 6-block prompt served with a TTL and pushed down: its first two blocks stay on GPU,
    the next two on host, the last two on disk (GPU of 8, host of 2 and a reserve of 2)."""
    ex = make(gpu_blocks=8, host_blocks=2, reserved_host_blocks=2, disk_blocks=4)
    doc = fresh_tokens(13)
    ex.serve("first", doc, ttl=30.0)
    ex.churn("churn", 6)  # the two free pages, then the four tail blocks: two spill
    ex.drain()
    assert ex.tiers(doc) == ["RELEASED"] * 2 + ["ON_HOST"] * 2 + ["ON_DISK"] * 2
    return ex, doc


def test_a_match_across_all_three_tiers_counts_every_hit_by_tier() -> None:
    ex, doc = _three_tier_prefix()
    before = ex.stats()
    match = ex.add("a", doc)
    assert (match.gpu_tokens, match.host_tokens, match.disk_tokens) == (4, 4, 4)
    assert ex.cache.request_status("a").pending_reads == 2
    # A second request for the same prompt while the reads are in flight waits on both.
    second = ex.add("b", doc)
    assert (second.gpu_tokens, second.host_tokens, second.disk_tokens) == (8, 0, 4)
    assert ex.cache.request_status("b").pending_reads == 2
    after = ex.stats()
    assert after.hit_blocks_gpu - before.hit_blocks_gpu == 2 + 4
    assert after.hit_blocks_host - before.hit_blocks_host == 2
    assert after.hit_blocks_disk - before.hit_blocks_disk == 2 + 2
    # Both found the disk blocks inside their TTL: both count as retained hits.
    assert after.hit_blocks_disk_retained - before.hit_blocks_disk_retained == 4
    ex.drain()
    assert ex.cache.is_ready("a") and ex.cache.is_ready("b")


def test_admission_does_not_count_matched_gpu_blocks_as_obtainable_pages() -> None:
    ex = make(gpu_blocks=6, host_blocks=2, disk_blocks=0)
    doc = fresh_tokens(9)
    ex.serve("first", doc)
    ex.churn("churn", 4)  # two free pages, then the two tail blocks go to host
    assert ex.tiers(doc) == ["RELEASED", "RELEASED", "ON_HOST", "ON_HOST"]
    ex.add("holder", fresh_tokens(8))
    ex.cache.allocate_nowait("holder", 8, now=ex.now)  # every free page
    ex.pump()
    before = (ex.stats(), ex.tiers(doc))
    # Two host blocks need pages; the only evictable pages hold the match's own GPU blocks.
    with pytest.raises(OutOfBlocks, match=r"'again' needs 2 more GPU blocks, 0 obtainable"):
        ex.cache.add_request("again", doc, now=ex.now)
    assert (ex.stats(), ex.tiers(doc)) == before
    ex.cache.check_invariants()
    ex.release("holder")
    match = ex.add("again", doc)
    assert (match.gpu_tokens, match.host_tokens) == (4, 4)


def test_a_spill_whose_block_was_recalled_frees_its_slot_when_it_lands() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    doc = fresh_tokens(5)
    first, second = ex.spill([doc], land=False)
    ex.add("again", doc)  # recalls both SPILLING blocks from their host pages
    assert ex.tiers(doc) == ["ON_GPU", "ON_GPU"]
    assert ex.stats().disk_empty_slots == 0
    ex.land_write(first.transfer)
    assert ex.freed == [first.slot]
    ex.land_write(second.transfer)
    assert ex.freed == [first.slot, second.slot]
    assert ex.stats().disk_empty_slots == 2


def test_a_failed_read_frees_the_slot_it_read() -> None:
    ex = make(gpu_blocks=4, host_blocks=1, disk_blocks=2)
    doc = fresh_tokens(3)
    ex.spill([doc])
    ex.add("a", doc)
    read = ex.land_read(ok=False)
    assert ex.freed[-1] == read.slot
    assert ex.stats().disk_empty_slots == 2


def test_the_largest_lora_id_is_accepted_and_keys_apart_from_its_neighbour() -> None:
    ex = make()
    top = 2**63 - 1
    ex.serve("a", [1, 2, 3], lora=top)
    assert ex.tiers([1, 2, 3], lora=top) == ["RELEASED"]
    assert ex.add("b", [1, 2, 3], lora=top - 1).matched_tokens == 0


def test_failure_counters_add_up_over_several_failures() -> None:
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    doc = fresh_tokens(5)
    for write in ex.spill([doc], land=False):
        ex.land_write(write.transfer, ok=False)
    assert ex.stats().spill_failures == 2
    assert ex.tiers(doc) == ["ON_HOST", "ON_HOST"]  # the bytes never left the host pages

    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=2)
    first, second = fresh_tokens(3), fresh_tokens(3)
    ex.spill([first, second])
    for rid, prompt in (("a", first), ("b", second)):
        ex.add(rid, prompt)
        ex.land_read(ok=False)
    assert ex.stats().onboard_failures == 2
    assert ex.cache.is_ready("a") and ex.cache.is_ready("b")  # both fall back to recompute
