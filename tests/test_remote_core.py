"""The core's side of the shared tier: matching past the local tiers against the keys the
remote fetcher found, fetches in flight (FETCHING), their failures, and publishing."""

from __future__ import annotations

from pathlib import Path

import pytest

from statekv import SpillMode, UsageError
from statekv.lifecycle import BlockState
from statekv.messages import CopyGpuToHost, FetchBlock, PublishBlock
from tests.harness import Executor, block_keys, fresh_tokens, make


def _shared(**overrides: object) -> Executor:
    return make(**{"gpu_blocks": 6, "host_blocks": 2, "disk_blocks": 2, "shared_tier": True,
                   **overrides})


def _states(ex: Executor) -> dict[bytes, BlockState]:
    return {b.key: b.state for b in ex.cache.cached_blocks()}


def test_remote_candidates_are_the_keys_past_the_local_match() -> None:
    ex = _shared()
    doc = fresh_tokens(3 * ex.bs + 1)
    keys = block_keys(doc, ex.bs)
    assert ex.cache.remote_candidates(doc) == tuple(keys)
    ex.serve("a", doc[: ex.bs + 1])
    assert ex.cache.remote_candidates(doc) == tuple(keys[1:])
    assert ex.cache.remote_candidates(doc, cache_salt="t") != tuple(keys[1:])


def test_a_remote_run_is_fetched_and_the_request_parks_until_it_lands() -> None:
    ex = _shared()
    doc = fresh_tokens(3 * ex.bs + 1)
    keys = ex.cache.remote_candidates(doc)
    match = ex.add("a", doc, remote=keys)
    assert (match.matched_tokens, match.remote_tokens, match.ready) == (3 * ex.bs,
                                                                         3 * ex.bs, False)
    assert [f.key for f in ex.fetches.values()] == list(keys)
    assert set(_states(ex).values()) == {BlockState.FETCHING}
    ex.land_fetch()
    ex.land_fetch()
    assert not ex.cache.is_ready("a")
    ex.land_fetch()
    assert ex.cache.is_ready("a")
    assert ex.cache.request_status("a").num_computed_tokens == 3 * ex.bs
    ex.compute("a")
    ex.release("a")
    assert ex.stats().hit_blocks_remote == 3


def test_only_the_leading_run_of_remote_keys_is_taken() -> None:
    ex = _shared()
    doc = fresh_tokens(3 * ex.bs + 1)
    keys = ex.cache.remote_candidates(doc)
    match = ex.add("a", doc, remote={keys[0], keys[2]})  # the cluster lost block 1
    assert match.remote_tokens == ex.bs
    assert [f.key for f in ex.fetches.values()] == [keys[0]]


def test_a_failed_fetch_is_never_served_and_the_request_recomputes_from_it() -> None:
    ex = _shared()
    doc = fresh_tokens(3 * ex.bs + 1)
    keys = ex.cache.remote_candidates(doc)
    ex.add("a", doc, remote=keys)
    first, second, third = list(ex.fetches)
    ex.land_fetch(first)
    ex.land_fetch(second, ok=False)  # evicted by the cluster between lookup and fetch
    assert ex.cache.is_ready("a")  # the third block was dropped with it: nothing to wait on
    status = ex.cache.request_status("a")
    assert (status.num_computed_tokens, status.num_blocks) == (ex.bs, 1)
    assert keys[1] not in _states(ex)  # never indexed as content
    assert _states(ex)[keys[2]] is BlockState.FETCHING  # still owns its page
    ex.land_fetch(third)
    assert _states(ex)[keys[2]] is BlockState.RELEASED
    ex.compute("a")
    ex.release("a")
    assert ex.stats().fetch_failures == 1
    assert ex.stats().requests_fallen_back == 1


def test_release_during_a_fetch_keeps_the_page_until_it_reports() -> None:
    ex = _shared()
    doc = fresh_tokens(ex.bs + 1)
    keys = ex.cache.remote_candidates(doc)
    ex.add("a", doc, remote=keys)
    ex.release("a")
    (fetch,) = ex.fetches.values()
    # The page is not free: a churn that takes every obtainable page cannot get it.
    assert ex.stats().gpu_free_pages == ex.cache.config.gpu_blocks - 1
    ex.churn("c")
    assert _states(ex)[keys[0]] is BlockState.FETCHING
    ex.land_fetch(fetch.transfer, ok=False)
    assert keys[0] not in _states(ex)
    assert ex.stats().gpu_free_pages == ex.cache.config.gpu_blocks


def test_a_second_request_waits_on_the_fetch_in_flight() -> None:
    ex = _shared()
    doc = fresh_tokens(ex.bs + 1)
    keys = ex.cache.remote_candidates(doc)
    ex.add("a", doc, remote=keys)
    assert ex.cache.remote_candidates(doc) == ()  # indexed while in flight
    ex.add("b", doc)
    assert len(ex.fetches) == 1
    ex.land_fetch(ok=False)
    for rid in ("a", "b"):
        assert ex.cache.is_ready(rid)
        assert ex.cache.request_status(rid).num_computed_tokens == 0


def test_a_locally_cached_key_ends_the_remote_run() -> None:
    ex = _shared(gpu_blocks=4, disk_blocks=2)
    doc = fresh_tokens(2 * ex.bs + 1)
    keys = block_keys(doc, ex.bs)
    ex.spill([doc])
    ex.add("a", doc)
    first, _second = list(ex.reads)
    ex.land_read(first, ok=False)  # block 0 leaves the cache, block 1 stays
    ex.land_read()
    ex.release("a")
    assert ex.cache.remote_candidates(doc) == tuple(keys)
    match = ex.add("b", doc, remote=keys)
    assert match.remote_tokens == ex.bs  # one key, one record: block 1 is cached here
    assert [f.key for f in ex.fetches.values()] == [keys[0]]


@pytest.mark.parametrize("bad", ["abc", b"abc", [b"short"], [1], 7])
def test_bad_remote_keys_are_refused_naming_the_field_and_change_nothing(bad: object) -> None:
    ex = _shared()
    before = ex.stats()
    with pytest.raises(UsageError) as info:
        ex.cache.add_request("a", fresh_tokens(3), now=0.0, remote_keys=bad)  # type: ignore[arg-type]
    assert info.value.field == "remote_keys"
    assert ex.stats() == before
    assert not ex.cache.has_request("a")


def test_a_cache_without_a_shared_tier_refuses_remote_keys() -> None:
    ex = make(gpu_blocks=4)
    doc = fresh_tokens(3)
    with pytest.raises(UsageError) as info:
        ex.cache.add_request("a", doc, now=0.0, remote_keys=block_keys(doc, ex.bs))
    assert info.value.field == "remote_keys"
    with pytest.raises(UsageError) as info:
        ex.cache.remote_candidates(doc)
    assert info.value.field == "shared_tier"
    with pytest.raises(UsageError) as info:
        ex.cache.report_fetch(0, 1.0)
    assert info.value.field == "num_bytes"


def test_a_publish_follows_its_offload_copy_in_the_command_order() -> None:
    ex = _shared(gpu_blocks=2)
    doc = fresh_tokens(ex.bs + 1)
    ex.serve("a", doc)
    start = len(ex.log)
    ex.churn("c")
    cmds = ex.log[start:]
    i = next(i for i, c in enumerate(cmds) if isinstance(c, PublishBlock))
    copy, publish = cmds[i - 1], cmds[i]
    assert isinstance(copy, CopyGpuToHost) and isinstance(publish, PublishBlock)
    assert (copy.block, copy.host_page) == (publish.block, publish.host_page)
    assert publish.key == block_keys(doc, ex.bs)[0]
    assert publish.expiry is None


def test_the_spill_mode_decides_what_is_published() -> None:
    ex = _shared(gpu_blocks=2, spill_mode=SpillMode.RETAINED_ONLY)
    ex.serve("a", fresh_tokens(ex.bs + 1))
    ex.serve("b", fresh_tokens(ex.bs + 1), ttl=100.0)
    ex.churn("c")
    assert [p.expiry for p in ex.published] == [100.0]
    assert ex.stats().publishes_not_admitted == 1


def test_fetching_is_skipped_when_recomputing_is_faster() -> None:
    ex = _shared()
    doc = fresh_tokens(2 * ex.bs + 1)
    keys = ex.cache.remote_candidates(doc)
    bb = ex.cache.config.block_bytes
    ex.cache.report_prefill(10, 1.0, context_tokens=len(doc))  # 0.1 s per token
    ex.cache.report_fetch(bb, 1.0)  # 1 s per block of 2 tokens: slower
    match = ex.add("a", doc, remote=keys)
    assert (match.remote_tokens, match.skipped_remote_tokens) == (0, 2 * ex.bs)
    assert not ex.fetches
    ex.release("a")
    ex.cache.report_fetch(bb * 1000, 1.0)  # now much faster
    ex.cache.report_fetch(bb * 1000, 1.0)
    ex.cache.report_fetch(bb * 1000, 1.0)
    match = ex.add("b", doc, remote=keys)
    assert match.remote_tokens == 2 * ex.bs
    assert all(isinstance(f, FetchBlock) for f in ex.fetches.values())


# ---------------------------------------------------------------------- the user's config


def _layout() -> object:
    from statekv import KVLayout
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")


@pytest.mark.parametrize(("field", "value"), [
    ("remote_url", ""),
    ("remote_url", "http://h:1"),
    ("remote_url", "redis://h"),
    ("remote_url", "redis://h:7000/3"),
    ("remote_url", 7000),
    ("remote_namespace", ""),
    ("remote_namespace", "a b"),
    ("remote_timeout_s", 0),
    ("remote_timeout_s", float("nan")),
    ("remote_timeout_s", True),
    ("remote_queue_depth", 0),
    ("remote_queue_depth", 1.5),
])
def test_bad_remote_options_are_refused_naming_the_field(field: str, value: object) -> None:
    from io_actors.config import StateKVConfig
    from statekv import ConfigError

    with pytest.raises(ConfigError) as info:
        StateKVConfig(layout=_layout(), gpu=4, model_fingerprint="m", **{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_the_shared_tier_is_off_by_default_and_on_with_a_url() -> None:
    from io_actors.config import StateKVConfig

    assert not StateKVConfig(layout=_layout(), gpu=4).core_config().shared_tier  # type: ignore[arg-type]
    on = StateKVConfig(layout=_layout(), gpu=4,  # type: ignore[arg-type]
                       remote_url="redis://127.0.0.1:1", model_fingerprint="m",
                       remote_secret=b"s" * 16)
    assert on.core_config().shared_tier


def test_an_unreachable_cluster_is_a_config_error_naming_remote_url() -> None:
    from io_actors.config import StateKVConfig
    from io_actors.embed import BlockingCache
    from statekv import ConfigError

    cfg = StateKVConfig(layout=_layout(), gpu=4, device="cpu",  # type: ignore[arg-type]
                        remote_url="redis://127.0.0.1:1", remote_timeout_s=0.2,
                        remote_secret=b"s" * 16,
                        model_fingerprint="m")
    with pytest.raises(ConfigError) as info:
        BlockingCache(cfg)
    assert info.value.field == "remote_url"


@pytest.mark.parametrize("persist", [True, False])
def test_an_unreachable_cluster_leaves_the_disk_as_it_was(tmp_path: Path, persist: bool) -> None:
    """Every open is all or nothing: a fresh directory stays empty, and a directory with
    content keeps it byte for byte (persist=False wipes only once the rest of the open has
    succeeded)."""
    import attrs

    from io_actors.embed import BlockingCache
    from statekv import ConfigError
    from tests.io_helpers import serve, small_config, wait_quiet
    from tests.test_io_actors import churn

    fresh = tmp_path / "fresh"
    bad = dict(remote_url="redis://127.0.0.1:1", remote_timeout_s=0.2, persist=persist)
    with pytest.raises(ConfigError) as info:
        BlockingCache(small_config(fresh, **bad))
    assert info.value.field == "remote_url"
    assert not fresh.exists() or list(fresh.rglob("*")) == []
    used = tmp_path / "used"
    cfg = small_config(used)
    with BlockingCache(cfg) as cache:
        serve(cache, "p", list(range(13)), ttl_seconds=600)
        churn(cache, 6)
        wait_quiet(cache)
    before = {p: p.read_bytes() for p in used.rglob("*") if p.is_file()}
    assert before
    with pytest.raises(ConfigError):
        BlockingCache(attrs.evolve(cfg, **bad))  # type: ignore[arg-type]
    assert {p: p.read_bytes() for p in used.rglob("*") if p.is_file()} == before
