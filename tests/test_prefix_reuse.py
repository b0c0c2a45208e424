"""Prefix reuse: the longest cached prefix on any tier, full blocks only, node identity kept."""

from __future__ import annotations

from statekv import KVCacheManager, RingTrace
from statekv.lifecycle import BlockEvent, BlockState
from statekv.messages import CopyGpuToHost, CopyHostToGpu, ReadSlot, WriteSlot
from tests.harness import Executor, block_keys, config, fresh_tokens, make


def test_new_request_matches_the_longest_cached_prefix_on_gpu() -> None:
    ex = make()
    doc = fresh_tokens(7)
    ex.serve("a", doc)
    match = ex.add("b", [*doc[:6], 1, 2])
    assert match.matched_tokens == match.gpu_tokens == 6
    assert match.ready
    assert ex.cache.request_status("b").num_computed_tokens == 6
    shorter = ex.add("c", [*doc[:3], 9, 9, 9])
    assert shorter.matched_tokens == 2  # the second block differs in its last token


def test_match_spans_gpu_host_and_disk_tiers_in_one_prefix() -> None:
    ex = make(gpu_blocks=4, host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    doc = fresh_tokens(7)  # three full blocks and a partial one
    ex.serve("a", doc)
    # Tails are released first, so they are evicted first: block 2 goes down first.
    ex.churn("c1", 2)
    ex.churn("c2", 3)
    ex.drain()
    assert ex.tiers(doc) == ["RELEASED", "ON_HOST", "ON_DISK"]

    start = len(ex.log)
    match = ex.add("b", [*doc[:6], 42, 43])
    assert (match.gpu_tokens, match.host_tokens, match.disk_tokens) == (2, 2, 2)
    assert match.matched_tokens == 6
    assert not match.ready
    kinds = [type(c) for c in ex.log[start:]]
    assert CopyHostToGpu in kinds and ReadSlot in kinds
    ex.land_read()
    assert ex.cache.is_ready("b")
    assert ex.tiers(doc) == ["ON_GPU", "ON_GPU", "ON_GPU"]
    assert ex.cache.request_status("b").num_computed_tokens == 6


def test_only_full_blocks_are_shared() -> None:
    ex = make()
    doc = fresh_tokens(5)  # two full blocks, one token in a partial block
    ex.serve("a", doc)
    assert ex.stats().cached_blocks == 2
    match = ex.add("b", [*doc, 77, 78])
    assert match.matched_tokens == 4


def test_last_prompt_token_is_always_computed_even_when_every_block_is_cached() -> None:
    ex = make()
    doc = fresh_tokens(6)  # exactly three full blocks
    ex.serve("a", doc)
    assert ex.stats().cached_blocks == 3
    match = ex.add("b", doc)
    assert match.matched_tokens == 4
    assert ex.cache.request_status("b").num_computed_tokens == 4


def test_a_one_token_prompt_matches_nothing() -> None:
    ex = make(block_size=1)
    ex.serve("a", [5, 6])
    assert ex.add("b", [5]).matched_tokens == 0
    assert ex.add("c", [5, 6]).matched_tokens == 1


def test_partial_last_block_is_private_to_its_request() -> None:
    ex = make()
    doc = fresh_tokens(5)
    ex.add("a", doc)
    ex.compute("a")
    ex.add("b", doc)
    ex.compute("b")
    table_a = ex.cache.block_table("a")
    table_b = ex.cache.block_table("b")
    assert table_a[:2] == table_b[:2]
    assert table_a[2] != table_b[2]
    assert ex.stats().cached_blocks == 2
    shared = ex.cached()
    assert [shared[k].ref_count for k in block_keys(doc, ex.bs)] == [2, 2]


def test_match_stops_at_the_first_missing_block_even_if_a_later_one_is_cached() -> None:
    ex = make(host_blocks=1, disk_blocks=0, priority_levels=2)
    doc = fresh_tokens(5)
    ex.serve("a", doc, priority=1)
    # A low-priority holder of the first block only: it is now evicted before the second.
    ex.serve("b", doc[:3], priority=0)
    ex.churn("c1", 3)  # empty page, then block 0 to host
    ex.churn("c2", 4)  # block 1 to host: block 0 is dropped from the full host tier
    assert ex.tiers(doc) == [None, "ON_HOST"]
    assert ex.add("d", doc).matched_tokens == 0


def test_reuse_count_grows_with_every_hit() -> None:
    ex = make()
    doc = fresh_tokens(5)
    for i in range(3):
        ex.serve(f"r{i}", doc)
    assert [ex.cached()[k].reuse_count for k in block_keys(doc, ex.bs)] == [2, 2]


def test_node_identity_is_kept_through_gpu_host_disk_gpu() -> None:
    trace = RingTrace(10_000)
    ex = Executor(KVCacheManager(
        config(gpu_blocks=4, host_blocks=1, disk_blocks=2), trace=trace,
    ))
    doc = fresh_tokens(3)
    (key,) = block_keys(doc, ex.bs)
    ex.serve("a", doc, ttl=500.0)
    ex.serve("a2", doc)  # one hit: reuse count 1
    ex.churn("c0")
    ex.tick(1.0)
    node = next(c.block for c in ex.log if isinstance(c, CopyGpuToHost))
    ex.serve("f", fresh_tokens(3))
    ex.churn("c1")
    write = next(c for c in ex.log if isinstance(c, WriteSlot))
    assert write.block == node and write.key == key
    ex.drain()
    assert ex.tiers(doc) == ["ON_DISK"]
    on_disk = ex.cached()[key]
    assert on_disk.reuse_count == 1 and on_disk.expiry == 500.0 and on_disk.depth == 0

    match = ex.add("b", [*doc, 9])
    assert match.disk_tokens == 2
    read = next(c for c in ex.log if isinstance(c, ReadSlot))
    assert read.block == node and read.key == key
    ex.land_read()
    back = ex.cached()[key]
    assert back.state is BlockState.ON_GPU
    assert back.reuse_count == 2 and back.expiry == 500.0 and back.depth == 0

    # One record all along: it never passed through FREE between its tiers.
    path = [(r.from_state, r.event) for r in trace.records() if r.block == node]
    events = [event for _state, event in path]
    assert events == [
        BlockEvent.ALLOCATED, BlockEvent.RELEASED, BlockEvent.ACQUIRED, BlockEvent.RELEASED,
        BlockEvent.OFFLOADED, BlockEvent.SPILL_STARTED, BlockEvent.SPILL_LANDED,
        BlockEvent.READ_STARTED, BlockEvent.READ_LANDED,
    ]


def test_host_hit_copies_the_block_back_and_frees_its_host_page() -> None:
    ex = make(host_blocks=2, disk_blocks=0)
    doc = fresh_tokens(3)
    ex.serve("a", doc)
    ex.churn("c")
    assert ex.tiers(doc) == ["ON_HOST"]
    free_before = ex.stats().host_free_pages
    start = len(ex.log)
    match = ex.add("b", [*doc, 1])
    assert match.host_tokens == 2 and match.ready
    (copy,) = [c for c in ex.log[start:] if isinstance(c, CopyHostToGpu)]
    assert ex.cache.block_table("b")[0] == copy.gpu_page
    assert ex.stats().host_free_pages == free_before + 1
    assert ex.tiers(doc) == ["ON_GPU"]


def test_a_disk_block_is_served_only_after_onboarding_even_for_a_partial_reuse() -> None:
    """A request that reuses only the first block of a disk-resident chain still waits for
    that block's read: its bytes are never taken from pool memory."""
    ex = make(gpu_blocks=4, host_blocks=2, disk_blocks=4)
    doc = fresh_tokens(5)
    ex.spill([doc])
    assert ex.tiers(doc) == ["ON_DISK", "ON_DISK"]
    start = len(ex.log)
    match = ex.add("b", [*doc[:2], 99])
    assert match.disk_tokens == 2 and not match.ready
    (read,) = [c for c in ex.log[start:] if isinstance(c, ReadSlot)]
    assert read.key == block_keys(doc, ex.bs)[0]
    assert ex.cache.block_table("b") == (read.gpu_page,)
    assert not ex.cache.is_ready("b")
    assert ex.tiers(doc) == ["ONBOARDING", "ON_DISK"]
    ex.land_read()
    assert ex.cache.is_ready("b")


def test_duplicate_commits_stay_private() -> None:
    ex = make()
    doc = fresh_tokens(3)
    ex.add("a", doc)
    ex.add("b", doc)  # both miss: neither has committed yet
    ex.compute("a")
    ex.compute("b")
    (key,) = block_keys(doc, ex.bs)
    assert ex.stats().cached_blocks == 1
    assert ex.cached()[key].ref_count == 1
    page_a = ex.cache.block_table("a")[0]
    assert ex.cache.block_table("b")[0] != page_a
    ex.release("b")
    assert ex.stats().cached_blocks == 1
    assert ex.cached()[key].ref_count == 1
    match = ex.add("c", [*doc, 5])
    assert match.gpu_tokens == 2
    assert ex.cache.block_table("c")[0] == page_a


def test_released_duplicate_returns_its_page_to_the_free_list() -> None:
    ex = make()
    doc = fresh_tokens(3)
    ex.add("a", doc)
    ex.add("b", doc)
    ex.compute("a")
    ex.compute("b")
    free = ex.stats().gpu_free_pages
    ex.release("b")  # its duplicate full block and its partial block go back
    assert ex.stats().gpu_free_pages == free + 2
    assert ex.stats().gpu_evictable_blocks == 0


def test_salted_requests_never_share_even_with_identical_tokens() -> None:
    ex = make()
    doc = fresh_tokens(5)
    ex.serve("a", doc, salt="tenant-a")
    assert ex.add("b", doc, salt="tenant-b").matched_tokens == 0
    assert ex.add("c", doc).matched_tokens == 0
    assert ex.add("d", doc, salt="").matched_tokens == 0
    assert ex.add("e", doc, salt="tenant-a").matched_tokens == 4
