"""Inclusive host tier: a block recalled to the GPU keeps its host page as a host copy.

A full block is immutable, so the bytes in the host page it was recalled from stay right while
it is on GPU.  The promise (README, "Tiers"): evicting it to host again copies nothing; the
copy never costs the host tier room (a copy's page is handed out before anything cached on
host is evicted, and a short spill reserve is refilled before a copy is kept), so what the
host tier keeps is what it kept without copies; a write-through or a publish of content with
a host copy uses that page.  Then with real bytes: a block evicted onto its host copy and
recalled again is served the bytes it was computed with.
"""

from __future__ import annotations

from pathlib import Path

from io_actors.embed import BlockingCache
from statekv.ids import BlockHash
from statekv.lifecycle import BlockState
from statekv.messages import CopyGpuToHost, CopyHostToGpu, PublishBlock, WriteSlot
from tests.harness import Executor, block_keys, fresh_tokens, make
from tests.io_helpers import check_pages, compute, serve, small_config, wait_quiet, wait_ready
from tests.test_prefetch_actors import wait_prefetched


def _cache(**overrides: object) -> Executor:
    return make(**{"gpu_blocks": 4, "host_blocks": 1, "disk_blocks": 2, **overrides})


def _doc() -> list[int]:
    return fresh_tokens(3)  # one full block (block size 2) and one token


def _host_copy(ex: Executor, doc: list[int]) -> bool:
    (key,) = block_keys(doc, ex.bs)
    return ex.cached()[key].has_host_copy


def _recalled(ex: Executor, doc: list[int], **serve: object) -> None:
    """`doc` served, evicted to host, then served again from host (a recall)."""
    ex.serve("a", doc)
    ex.churn("c1")
    assert ex.tiers(doc) == ["ON_HOST"]
    assert ex.serve("b", doc, **serve).host_tokens == ex.bs  # type: ignore[arg-type]


def test_a_recalled_block_keeps_its_host_page_as_a_copy() -> None:
    ex = _cache()
    doc = _doc()
    _recalled(ex, doc)
    assert ex.tiers(doc) == ["RELEASED"] and _host_copy(ex, doc)
    stats = ex.stats()
    assert stats.host_copies_kept == 1 and stats.host_copy_pages == 1
    # The copy's page counts as free: nothing cached is on host.
    assert stats.host_free_pages == 1 and stats.host_cached_blocks == 0
    ex.cache.check_invariants()


def test_evicting_a_block_with_a_host_copy_copies_nothing() -> None:
    ex = _cache()
    doc = _doc()
    _recalled(ex, doc)
    start = len(ex.log)
    ex.churn("c2")
    assert ex.tiers(doc) == ["ON_HOST"] and not _host_copy(ex, doc)
    assert not [c for c in ex.log[start:] if isinstance(c, CopyGpuToHost)]
    stats = ex.stats()
    assert stats.offloads_saved_by_host_copy == 1 and stats.host_copy_pages == 0
    # And it is a host hit again, copied up from that page.
    start = len(ex.log)
    assert ex.serve("again", doc).host_tokens == ex.bs
    assert [type(c) for c in ex.log[start:]].count(CopyHostToGpu) == 1
    ex.cache.check_invariants()


def test_a_host_copy_gives_its_page_to_a_gpu_victim_before_anything_on_host_is_evicted() -> None:
    ex = _cache(host_blocks=2, disk_blocks=0)
    doc, kept, x = _doc(), _doc(), _doc()
    _recalled(ex, doc)                   # doc on GPU with a copy in one of two host pages
    ex.add("holder", doc)                # held: no eviction takes doc itself
    ex.serve("k", kept)
    ex.churn("c2")                       # kept -> the empty host page, not the copy's
    assert ex.tiers(kept) == ["ON_HOST"] and _host_copy(ex, doc)
    ex.serve("x", x)
    ex.churn("c3")                       # x's eviction takes the copy's page, not kept's
    assert ex.tiers(x) == ["ON_HOST"] and ex.tiers(kept) == ["ON_HOST"]
    assert ex.tiers(doc) == ["ON_GPU"] and not _host_copy(ex, doc)
    stats = ex.stats()
    assert stats.host_drops == 0 and stats.host_copy_pages == 0
    ex.cache.check_invariants()


def test_a_short_spill_reserve_is_refilled_before_a_copy_is_kept() -> None:
    ex = _cache(host_blocks=1, reserved_host_blocks=1, disk_blocks=4)
    first, doc = _doc(), _doc()
    ex.serve("f", first)
    ex.churn("c0")                       # first -> the host page
    ex.serve("d", doc)
    ex.churn("c1")                       # doc -> host: first spills, doc takes the reserve
    assert ex.tiers(first) == ["SPILLING"] and ex.tiers(doc) == ["ON_HOST"]
    assert ex.stats().host_reserved_pages == 0
    ex.serve("back", doc)                # recalled while first's write is in flight
    assert not _host_copy(ex, doc)       # its page refilled the reserve
    stats = ex.stats()
    assert stats.host_reserved_pages == 1 and stats.host_copies_kept == 0
    ex.drain()
    ex.cache.check_invariants()


def test_a_write_through_of_content_with_a_host_copy_writes_from_that_page() -> None:
    ex = _cache(host_blocks=3, disk_blocks=4, retention_write_through=True)
    doc = _doc()
    _recalled(ex, doc)                   # best-effort: no write-through yet
    assert _host_copy(ex, doc)
    start = len(ex.log)
    ex.serve("ttl", doc, ttl=100.0)      # released with a TTL: written through
    new = ex.log[start:]
    (key,) = block_keys(doc, ex.bs)
    assert [c.key for c in new if isinstance(c, WriteSlot)] == [key]
    assert not [c for c in new if isinstance(c, CopyGpuToHost)]  # no staging copy
    assert not _host_copy(ex, doc)       # the page is the write's until it lands
    ex.drain()
    (block,) = [c for c in ex.cache.cached_blocks() if c.key == key]
    assert block.state is BlockState.RELEASED and block.has_disk_copy
    assert ex.stats().host_free_pages == 3  # the staging page came back
    ex.cache.check_invariants()


def test_a_publish_at_release_offers_a_host_copy_from_its_page() -> None:
    ex = _cache(host_blocks=1, shared_tier=True, publish_on="release")
    doc = _doc()
    ex.serve("a", doc)
    ex.churn("c1")                       # published at release already; now on host
    ex.cache._index.blocks[block_keys(doc, ex.bs)[0]].published = False  # a fresh offer
    start = len(ex.log)
    ex.serve("b", doc)                   # recalled (copy kept), then released
    new = ex.log[start:]
    assert [type(c) for c in new].count(PublishBlock) == 1
    assert not [c for c in new if isinstance(c, CopyGpuToHost)]
    assert _host_copy(ex, doc)
    ex.cache.check_invariants()


def test_a_clean_close_writes_a_retained_block_from_its_host_copy() -> None:
    ex = _cache(host_blocks=1, disk_blocks=2)
    doc = _doc()
    _recalled(ex, doc, ttl=100.0)
    assert _host_copy(ex, doc)
    start = len(ex.log)
    left, moved = ex.cache._eviction.flush_retained(ex.now)
    ex.pump()
    assert (left, moved) == (1, 1)
    assert ex.tiers(doc) == ["ON_HOST"]
    assert not [c for c in ex.log[start:] if isinstance(c, CopyGpuToHost)]
    ex.cache.check_invariants()


# ------------------------------------------------------------------ the real bytes


def test_a_block_evicted_onto_its_host_copy_is_served_its_own_bytes(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=4, host=8, reserved_host=0, disk=0)
    bs = cfg.block_size
    prompt = list(range(500, 500 + 2 * bs + 1))     # two full blocks and one token
    with BlockingCache(cfg) as cache:
        cache.add_request("a", prompt)
        wait_ready(cache, "a")
        compute(cache, "a", prompt)
        cache.release("a")

        def churn(name: str) -> None:
            other = [hash((name, t)) % 50_000 + 60_000 for t in range(4 * bs)]
            cache.add_request(name, other)
            wait_ready(cache, name)
            compute(cache, name, other)
            cache.release(name)
            wait_quiet(cache)

        churn("c1")                                  # prompt's blocks -> host
        match = cache.add_request("b", prompt)       # recalled: host copies kept
        assert match.host_tokens == 2 * bs
        wait_ready(cache, "b")
        check_pages(cache, "b", prompt, 2)           # the recalled bytes
        compute(cache, "b", prompt)
        cache.release("b")
        assert cache.statistics().cache.host_copy_pages == 2
        churn("c2")                                  # evicted onto the copies: no copy
        stats = cache.statistics().cache
        assert stats.offloads_saved_by_host_copy == 2
        match = cache.add_request("c", prompt)
        assert match.host_tokens == 2 * bs
        wait_ready(cache, "c")
        check_pages(cache, "c", prompt, 2)           # the same bytes again
        compute(cache, "c", prompt)
        cache.release("c")
        cache.check_invariants()


def test_content_prefetched_then_spilled_from_its_host_copy_reads_back(tmp_path: Path) -> None:
    """A block recalled from PREFETCHED keeps, as its host copy, a page a disk read filled.
    Evicted back onto it, its disk copy displaced while it sits on host, it is spilled from
    that page: the slot must read back as the block's bytes (on CUDA the copy engine's
    checksum of that page is of its earlier content, and trusting it wrote a slot whose
    every read failed its checksum)."""
    cfg = small_config(tmp_path, gpu=8, host=16, reserved_host=0, disk=10)
    bs = cfg.block_size
    prompt = list(range(3 * bs + 1))                 # three full blocks and one token
    with BlockingCache(cfg) as cache:
        serve(cache, "first", prompt)
        keys = {b.key for b in cache.cached_blocks()}   # the prompt's three blocks
        assert len(keys) == 3
        for i in range(6):                           # prompt -> disk
            serve(cache, f"churn{i}", [10_000 + 100 * i + t for t in range(17)])
            wait_quiet(cache)
        assert _states(cache, keys) == {("ON_DISK", False, False)}
        for _ in range(20):                          # host room comes back as spills land
            if cache.prefetch("q", prompt).started_tokens == 3 * bs:
                break
            wait_quiet(cache)
        wait_prefetched(cache, 3)
        match = cache.add_request("q", prompt)
        assert match.host_tokens == 3 * bs and match.ready
        compute(cache, "q", prompt)
        cache.release("q")
        # Recalled from PREFETCHED: a host copy (the read's page) and a disk copy each.
        assert _states(cache, keys) == {("RELEASED", True, True)}
        seen: set[tuple[str, bool, bool]] = set()
        for i in range(30):
            serve(cache, f"x{i}", [90_000 + 100 * i + t for t in range(9)])
            wait_quiet(cache)
            seen |= _states(cache, keys)
            if _states(cache, keys) == {("ON_DISK", False, False)}:
                break
        # On host with no disk copy (displaced), then spilled from the page again.
        assert ("ON_HOST", False, False) in seen, seen
        assert _states(cache, keys) == {("ON_DISK", False, False)}
        stats = cache.statistics().cache
        assert stats.offloads_saved_by_host_copy >= 3
        match = cache.add_request("z", prompt)
        assert match.disk_tokens == 3 * bs
        wait_ready(cache, "z")
        assert cache.statistics().cache.io_errors == 0
        check_pages(cache, "z", prompt, 3)           # the bytes it was computed with
        cache.release("z")
        cache.check_invariants()


def _states(cache: BlockingCache, keys: set[BlockHash]) -> set[tuple[str, bool, bool]]:
    """(tier, has a disk copy, has a host copy) of each of `keys` still cached."""
    return {(b.state.name, b.has_disk_copy, b.has_host_copy)
            for b in cache.cached_blocks() if b.key in keys}
