"""The remote writer and reader actors on a real Redis Cluster, and two replicas sharing it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

from io_actors.actors.remote_fetcher import RemoteFetcher
from io_actors.actors.remote_publisher import Offer, RemotePublisher
from io_actors.storage.redis_store import FetchStatus, RedisClusterStore
from io_actors.storage.remote_faults import (
    FaultyRemoteStore,
    RemoteFault,
    RemoteFaultPlan,
    RemoteFaultRule,
)
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.hashing import extend_chain, root_key, token_bytes
from statekv.ids import BlockHash, BlockId, PageId, TransferId
from statekv.messages import FetchBlock, PublishBlock, SlotRead, SlotReadFailed
from tests.io_helpers import TEST_REMOTE_SECRET
from tests.redis_cluster import LocalRedisCluster
from tests.test_redis_store import SENTINEL, blank, block, chain

REPO = Path(__file__).resolve().parent.parent


def config(**kwargs: object) -> CacheConfig:
    return CacheConfig(block_size=16, gpu_blocks=8, model_fingerprint="model-a",
                       **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def store(redis_cluster: LocalRedisCluster) -> Iterator[RedisClusterStore]:
    with RedisClusterStore(redis_cluster.url, config(), namespace=f"a{uuid.uuid4().hex[:12]}",
                           timeout_s=0.25) as s:
        yield s


def record(i: int, key: BlockHash, *, reuse: int = 0,
           expiry: float | None = None) -> PublishBlock:
    return PublishBlock(block=BlockId(i), key=key, host_page=PageId(0), parent=BlockHash(bytes(32)),
                        depth=i, reuse_count=reuse, expiry=expiry)


def publish_all(publisher: RemotePublisher, blocks: list[PublishBlock], *, now: float = 0.0,
                ) -> list[Offer]:
    async def main() -> list[Offer]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            offers = [publisher.offer(b, block(b.block), now=now, wall_now=time.time())
                      for b in blocks]
            publisher.close()
        return offers

    return trio.run(main)


# --- publishing ----------------------------------------------------------------------------


def test_a_retained_block_expires_with_its_deadline(store: RedisClusterStore) -> None:
    keys = chain(2)
    publisher = RemotePublisher(store, config())
    offers = publish_all(publisher, [record(0, keys[0], expiry=100.0),
                                     record(1, keys[1], expiry=5.0)], now=10.0)
    assert offers == [Offer.QUEUED, Offer.QUEUED]
    ttl_ms = store.client.pttl(store.redis_key(keys[0]))
    assert 80_000 < ttl_ms <= 90_000
    # A deadline that passed leaves best-effort content: shared without an expiry.
    assert store.client.pttl(store.redis_key(keys[1])) == -1


def test_a_full_queue_sheds_or_refuses_and_never_blocks(store: RedisClusterStore) -> None:
    keys = chain(8)
    publisher = RemotePublisher(store, config(drop_on_pressure=True, write_queue_depth=2))
    # run() is not draining: offers only queue; none may wait.
    offers = [publisher.offer(record(i, k, expiry=None if i < 4 else 99.0), block(i), now=0.0,
                              wall_now=0.0) for i, k in enumerate(keys)]
    assert offers == [Offer.QUEUED, Offer.QUEUED, Offer.SHED, Offer.SHED,
                      Offer.QUEUED, Offer.QUEUED, Offer.FULL, Offer.FULL]
    stats = publisher.statistics()
    assert stats.queued == 4 and stats.offers["shed"] == 2 and stats.offers["full"] == 2
    queue_only = RemotePublisher(store, config(write_queue_depth=2))
    offers = [queue_only.offer(record(i, k), block(i), now=0.0, wall_now=0.0)
              for i, k in enumerate(keys[:5])]
    assert offers == [Offer.QUEUED] * 4 + [Offer.FULL]


def test_the_page_is_copied_at_offer(store: RedisClusterStore) -> None:
    key = chain(1)[0]
    publisher = RemotePublisher(store, config())
    page = block(5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            publisher.offer(record(0, key), page, now=0.0, wall_now=0.0)
            page.fill_(0)  # the local tier reuses its page at once
            nursery.start_soon(publisher.run)
            publisher.close()

    trio.run(main)
    dst = blank()
    store.fetch(key, dst)
    assert torch.equal(dst, block(5))


def test_failed_publishes_are_counted_not_raised(store: RedisClusterStore) -> None:
    keys = chain(3)
    faulty = FaultyRemoteStore(store, RemoteFaultPlan(rules=(
        RemoteFaultRule(op="publish", fault=RemoteFault.TIMEOUT, nth=2),)))
    publisher = RemotePublisher(faulty, config())
    publish_all(publisher, [record(i, k) for i, k in enumerate(keys)])
    stats = publisher.statistics()
    assert stats.published + stats.failed == 3 and stats.queued == 0
    assert store.present([keys[0], keys[2]]) == [True, True]


def test_bad_publisher_arguments(store: RedisClusterStore) -> None:
    with pytest.raises(ConfigError) as info:
        RemotePublisher(store, config(), queue_depth=0)
    assert info.value.field == "queue_depth"
    with pytest.raises(UsageError) as bad:
        RemotePublisher(store, config()).offer("block", block(0), now=0.0,  # type: ignore[arg-type]
                                               wall_now=0.0)
    assert bad.value.field == "block"


# --- fetching ------------------------------------------------------------------------------


def onboard(fetcher: RemoteFetcher, keys: list[BlockHash],
            pages: list[torch.Tensor]) -> tuple[int, int, bool, FetchStatus | None]:
    result = trio.run(fetcher.onboard, keys, pages)
    return result.matched, result.served, result.fetched, result.failure


def test_onboard_serves_the_published_prefix_byte_for_byte(store: RedisClusterStore) -> None:
    keys = chain(6)
    publish_all(RemotePublisher(store, config()), [record(i, k) for i, k in enumerate(keys[:4])])
    pages = [blank() for _ in keys]
    assert onboard(RemoteFetcher(store, config()), keys, pages) == (4, 4, True, None)
    for i in range(4):
        assert torch.equal(pages[i], block(i))
    for page in pages[4:]:
        assert int(page.eq(SENTINEL).sum()) == page.numel()


def test_a_fetch_batch_reports_each_block_and_never_writes_a_failed_page(
    store: RedisClusterStore,
) -> None:
    keys = chain(4)
    publish_all(RemotePublisher(store, config()), [record(i, k) for i, k in enumerate(keys[:3])])
    faulty = FaultyRemoteStore(store, RemoteFaultPlan(rules=(
        RemoteFaultRule(op="fetch", fault=RemoteFault.CORRUPT, nth=2),)))
    pages = {PageId(10 + i): blank() for i in range(4)}
    reads = [FetchBlock(transfer=TransferId(i + 1), block=BlockId(i), key=k,
                        gpu_page=PageId(10 + i)) for i, k in enumerate(keys)]
    fetched = RemoteFetcher(faulty, config()).fetch(reads, pages.__getitem__, None)
    got = [type(o) for o in fetched.completion.outcomes]
    assert got == [SlotRead, SlotReadFailed, SlotRead, SlotReadFailed]  # corrupt, missing
    assert fetched.landed_bytes == 2 * config().block_bytes and fetched.seconds > 0
    for i in (0, 2):
        assert torch.equal(pages[PageId(10 + i)], block(i))
    for i in (1, 3):
        assert int(pages[PageId(10 + i)].eq(SENTINEL).sum()) == pages[PageId(10 + i)].numel()
    assert RemoteFetcher(store, config()).lookup(keys) == tuple(keys[:3])


@pytest.mark.parametrize(("fault", "status"), [
    (RemoteFault.EVICTED, FetchStatus.MISSING),
    (RemoteFault.CORRUPT, FetchStatus.CORRUPT),
    (RemoteFault.TIMEOUT, FetchStatus.UNAVAILABLE),
])
def test_a_block_lost_between_match_and_fetch_cuts_the_prefix_cleanly(
    store: RedisClusterStore, fault: RemoteFault, status: FetchStatus,
) -> None:
    keys = chain(5)
    publish_all(RemotePublisher(store, config()), [record(i, k) for i, k in enumerate(keys)])
    faulty = FaultyRemoteStore(store, RemoteFaultPlan(rules=(
        RemoteFaultRule(op="fetch", fault=fault, nth=3),)))
    pages = [blank() for _ in keys]
    assert onboard(RemoteFetcher(faulty, config()), keys, pages) == (5, 2, True, status)
    for i in range(2):
        assert torch.equal(pages[i], block(i))
    # The struck block's page was never written; later blocks may have landed but are not
    # served (the request recomputes from block 2 on).
    assert int(pages[2].eq(SENTINEL).sum()) == pages[2].numel()


# --- two replicas, one cluster ---------------------------------------------------------------


def replica(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.remote_replica", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_prefix_computed_in_one_process_is_served_to_another(
    redis_cluster: LocalRedisCluster, tmp_path: Path,
) -> None:
    namespace = f"r{uuid.uuid4().hex[:12]}"
    published, onboarded = tmp_path / "a.json", tmp_path / "b.json"
    replica("publish", redis_cluster.url, namespace, str(published))
    a = json.loads(published.read_text())
    assert a["offers"] == ["queued"] * 6
    replica("onboard", redis_cluster.url, namespace, str(published), str(onboarded))
    b = json.loads(onboarded.read_text())
    assert b["matched"] == 6 and b["served"] == 6
    assert b["same_bytes"] == [True] * 6
    # The fetched prefix is the KV B would have computed: decoding the tail on it gives
    # exactly the logits of decoding it on B's own prefill, and a single full prefill's up to
    # float rounding (another batch shape sums in another order).
    assert b["tail_equal"]
    assert b["tail_vs_full_prefill"] < 1e-4
    # Another tenant's chain of the same tokens matches nothing A published.
    from tests.remote_replica import PROMPT, setup

    _model, cfg, keys = setup()
    other: list[BlockHash] = []
    extend_chain(other, root_key(cfg.model_fingerprint, "tenant-2", None), token_bytes(PROMPT),
                 cfg.block_size, len(PROMPT) // cfg.block_size)
    with RedisClusterStore(redis_cluster.url, cfg, namespace=namespace) as s:
        assert s.match_prefix(keys) == 6
        assert s.match_prefix(other) == 0


def test_two_caches_share_a_prefix_through_add_request_byte_for_byte(
    redis_cluster: LocalRedisCluster, tmp_path: Path,
) -> None:
    namespace = f"c{uuid.uuid4().hex[:12]}"
    published, served = tmp_path / "a.json", tmp_path / "b.json"
    replica("cache-publish", redis_cluster.url, namespace, str(published))
    a = json.loads(published.read_text())
    assert a["offered"] == 6  # six full blocks evicted to host, each offered once
    replica("cache-serve", redis_cluster.url, namespace, str(published), str(served))
    b = json.loads(served.read_text())
    assert b["remote_tokens"] == 6 * 16 and b["ready"]
    assert b["served"] == 6 and b["same_bytes"] == [True] * 6
    assert b["fetches_completed"] == 6 and b["fetch_failures"] == 0
    assert b["tail_equal"]
    assert b["other_tenant_remote_tokens"] == 0


def test_the_readme_shared_tier_example_runs(redis_cluster: LocalRedisCluster,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    readme = (REPO / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                  if "RedisClusterStore" in b]
    url = "redis://10.0.0.5:7000,redis://10.0.0.6:7000,redis://10.0.0.7:7000"
    assert url in example
    exec(compile(example.replace(url, redis_cluster.url), "README.md", "exec"),
         {"__name__": "readme_shared_tier"})
    assert capsys.readouterr().out.strip() == "served to B: 4 blocks"


def test_killing_a_master_mid_run_cuts_prefixes_there_and_serving_goes_on(
    own_redis_cluster: LocalRedisCluster,
) -> None:
    cluster = own_redis_cluster
    cfg = config()
    keys = chain(30, first=7000)
    with RedisClusterStore(cluster.url, cfg, timeout_s=0.25) as store:
        owner = [cluster.node_for(store.redis_key(k)).port for k in keys]
        victim = cluster.nodes[2]
        first_lost = owner.index(victim.port)
        survivors = [i for i, port in enumerate(owner) if port != victim.port]

        async def main() -> None:
            publisher = RemotePublisher(store, cfg)
            fetcher = RemoteFetcher(store, cfg)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publisher.run)
                for i, key in enumerate(keys):
                    assert publisher.offer(record(i, key), block(i), now=0.0,
                                           wall_now=0.0) is Offer.QUEUED
                publisher.close()
            pages = [blank() for _ in keys]
            assert (await fetcher.onboard(keys, pages)).served == len(keys)

            cluster.kill(victim)
            for _round in range(3):  # serving goes on, round after round
                pages = [blank() for _ in keys]
                with trio.fail_after(60):  # a dead master costs a timeout, never a hang
                    result = await fetcher.onboard(keys, pages)
                # The match may stop at the dead master (EXISTS fails there) or the fetch
                # may: either way nothing from it or after it is served.
                assert result.served == first_lost
                for i in range(result.served):
                    assert torch.equal(pages[i], block(i))
                for page in pages[first_lost:first_lost + 1]:
                    assert int(page.eq(SENTINEL).sum()) == page.numel()
            # Blocks on the surviving masters are still served one by one.
            for i in survivors[:5]:
                page = blank()
                result = await fetcher.onboard([keys[i]], [page])
                assert result.served == 1 and torch.equal(page, block(i))

        trio.run(main)


def test_a_master_killed_under_two_caches_serves_no_wrong_bytes_and_never_hangs(
    own_redis_cluster: LocalRedisCluster,
) -> None:
    """Two whole caches on one cluster; a master dies after A published: B's add_request
    serves the prefix up to the first block that lived there, byte for byte, recomputes the
    rest, and serving goes on round after round."""
    from io_actors.config import StateKVConfig
    from io_actors.embed import BlockingCache
    from models.model import Chunk
    from tests.remote_replica import BLOCK_SIZE, digest, setup

    cluster = own_redis_cluster
    model, cfg, _keys = setup()
    prompt = [(5 * i + 1) % 89 for i in range(24 * BLOCK_SIZE + 3)]
    keys: list[BlockHash] = []
    extend_chain(keys, root_key(cfg.model_fingerprint, None, None), token_bytes(prompt),
                 BLOCK_SIZE, 24)

    def cache() -> BlockingCache:
        return BlockingCache(StateKVConfig(
            layout=cfg.layout, block_size=BLOCK_SIZE, gpu=30, host=40, device="cpu",
            model_fingerprint=cfg.model_fingerprint, remote_url=cluster.url,
            remote_secret=TEST_REMOTE_SECRET,
            # The default bound.  The killed master refuses connections at once, so this
            # bounds only the live masters' answers.  At 0.25 s round 0 once served less than
            # the prefix before the dead master (0 blocks of 1) in a full run on a loaded
            # 2-core machine, never alone: most likely a live master's answer timed out,
            # which the cache takes as a miss.
            remote_timeout_s=1.0,
        ))

    with cache() as a:
        a.add_request("a", prompt)
        a.allocate_nowait("a", len(prompt))
        table = list(a.block_table("a"))
        model.forward(a.kv_pool, [Chunk(token_ids=prompt, start=0, block_table=table)])
        a.commit("a", len(prompt))
        digests = [digest(a.kv_pool, table[i]) for i in range(24)]
        a.release("a")
        a.add_request("churn", [7] * (30 * BLOCK_SIZE))
        a.allocate_nowait("churn", 30 * BLOCK_SIZE)  # A's blocks go to host: published
        a.release("churn")
    with RedisClusterStore(cluster.url, cfg, timeout_s=0.25) as store:
        assert store.match_prefix(keys) == 24
        owner = [cluster.node_for(store.redis_key(k)).port for k in keys]
    victim = cluster.nodes[2]
    first_lost = owner.index(victim.port)
    cluster.kill(victim)
    with cache() as b:
        for rnd in range(3):
            rid = f"b{rnd}"
            started = time.monotonic()
            b.add_request(rid, prompt)
            assert b.wait_ready(rid, timeout=60)
            assert time.monotonic() - started < 30  # a dead master costs timeouts, no hang
            served = b.request_status(rid).num_computed_tokens // BLOCK_SIZE
            # The first round's prefix stops at the dead master's first block; B computed
            # the rest, so later rounds are B's own GPU hits.
            assert served == (first_lost if rnd == 0 else 24)
            table = list(b.block_table(rid))
            assert [digest(b.kv_pool, table[i]) for i in range(served)] == digests[:served]
            b.allocate_nowait(rid, len(prompt))  # serving goes on: it computes the rest
            table = list(b.block_table(rid))
            model.forward(b.kv_pool, [Chunk(token_ids=prompt[served * BLOCK_SIZE:],
                                            start=served * BLOCK_SIZE, block_table=table)])
            b.commit(rid, len(prompt))
            # What B computed itself (another chunking than A's: equal up to rounding only)
            # is what its later rounds must serve.
            digests = [digest(b.kv_pool, table[i]) for i in range(24)]
            b.release(rid)
            b.check_invariants()
        stats = b.statistics().cache
        assert stats.fetches_completed == first_lost


def test_a_fetch_batch_that_raises_is_failed_not_hung(
    redis_cluster: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever goes wrong inside a fetch batch (here: the fetcher raises), its blocks are
    reported failed: the request recomputes, and nothing waits forever."""
    from io_actors.config import StateKVConfig
    from io_actors.embed import BlockingCache
    from tests.remote_replica import BLOCK_SIZE, setup

    _model, cfg, _keys = setup()
    namespace = f"x{uuid.uuid4().hex[:12]}"
    prompt = [(3 * i + 2) % 71 for i in range(3 * BLOCK_SIZE + 1)]

    def cache() -> BlockingCache:
        return BlockingCache(StateKVConfig(
            layout=cfg.layout, block_size=BLOCK_SIZE, gpu=8, host=8, device="cpu",
            model_fingerprint=cfg.model_fingerprint, remote_url=redis_cluster.url,
            remote_secret=TEST_REMOTE_SECRET,
            remote_namespace=namespace, remote_timeout_s=0.25,
        ))

    with cache() as a:
        a.add_request("a", prompt)
        a.allocate_nowait("a", len(prompt))
        a.commit("a", len(prompt))
        a.release("a")
        a.add_request("churn", [9] * (8 * BLOCK_SIZE))
        a.allocate_nowait("churn", 8 * BLOCK_SIZE)
        a.release("churn")

    def broken(*_args: object) -> object:
        raise ConnectionError("the cluster went away mid-batch")

    monkeypatch.setattr(RemoteFetcher, "fetch", broken)
    with cache() as b:
        match = b.add_request("b", prompt)
        assert match.remote_tokens == 3 * BLOCK_SIZE
        assert b.wait_ready("b", timeout=30)
        assert b.request_status("b").num_computed_tokens == 0
        stats = b.statistics()
        assert stats.cache.fetch_failures == 3 and stats.cache.cached_blocks == 0
        b.release("b")
        b.check_invariants()


def test_a_stopped_master_never_holds_add_request_beyond_the_timeout(
    own_redis_cluster: LocalRedisCluster,
) -> None:
    """A master that is stopped (SIGSTOP: its sockets accept, nothing answers) costs the
    serving thread at most remote_timeout_s per add_request, in total: the lookup is a hint,
    and a late one is given up (counted), the request computing instead."""
    import os
    import signal

    from io_actors.config import StateKVConfig
    from io_actors.embed import BlockingCache
    from tests.remote_replica import BLOCK_SIZE, setup

    cluster = own_redis_cluster
    _model, cfg, _keys = setup()
    timeout = 0.5

    def cache() -> BlockingCache:
        return BlockingCache(StateKVConfig(
            layout=cfg.layout, block_size=BLOCK_SIZE, gpu=40, host=8, device="cpu",
            model_fingerprint=cfg.model_fingerprint, remote_url=cluster.url,
            remote_secret=TEST_REMOTE_SECRET,
            remote_timeout_s=timeout,
        ))

    with cache() as b:
        victim = cluster.nodes[1]
        assert victim.process is not None
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            worst = 0.0
            for i in range(6):  # keys on every master: some lookups need the stopped one
                prompt = [(11 * i + 7 * t) % 97 for t in range(6 * BLOCK_SIZE + 1)]
                started = time.monotonic()
                b.add_request(f"r{i}", prompt)
                worst = max(worst, time.monotonic() - started)
                b.release(f"r{i}")
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        assert worst <= timeout + 0.25, f"add_request took {worst:.2f} s"
        fetcher = b.statistics().fetcher
        assert fetcher is not None and fetcher.get("lookup_timeouts", 0) >= 1, fetcher


def _publish_then_fetch(url: str, directory: Path, *, namespace: str,
                        writer: dict[str, object], reader: dict[str, object]) -> tuple[int, int]:
    """Cache A (writer's settings) serves a prompt and pushes it off its GPU (published);
    cache B (reader's) asks for it: (remote tokens B matched, blocks B fetched)."""
    from io_actors.embed import BlockingCache
    from tests.io_helpers import BLOCK_SIZE, serve, small_config, wait_quiet
    from tests.test_io_actors import churn

    prompt = [(13 * i + 5) % 83 for i in range(3 * BLOCK_SIZE + 1)]
    common = dict(model_fingerprint="model-a", remote_url=url, remote_namespace=namespace,
                  remote_timeout_s=0.5)
    with BlockingCache(small_config(directory / "a", **common, **writer)) as a:
        serve(a, "a", prompt)
        churn(a, 6)
        wait_quiet(a)
    with BlockingCache(small_config(directory / "b", **common, **reader)) as b:
        match = b.add_request("b", prompt)
        assert b.wait_ready("b", timeout=10)
        fetched = b.statistics().cache.fetches_completed
        b.release("b")
    return match.remote_tokens, fetched


def test_a_cluster_that_requires_auth_is_used_with_the_password_only(tmp_path: Path) -> None:
    from io_actors.embed import BlockingCache
    from statekv.errors import ConfigError
    from tests.io_helpers import BLOCK_SIZE, small_config
    from tests.redis_cluster import running_cluster

    password = "correct-horse-battery"
    with running_cluster(tmp_path / "rc", password=password) as cluster:
        matched, fetched = _publish_then_fetch(
            cluster.url, tmp_path, namespace="auth",
            writer={"remote_password": password}, reader={"remote_password": password})
        assert (matched, fetched) == (3 * BLOCK_SIZE, 3)
        for wrong in (None, "wrong-password"):
            with pytest.raises(ConfigError) as info:
                BlockingCache(small_config(tmp_path / "x", model_fingerprint="m",
                                           remote_url=cluster.url, remote_password=wrong))
            assert info.value.field == "remote_password", info.value
            assert password not in str(info.value)
        config = small_config(tmp_path / "y", model_fingerprint="m", remote_url=cluster.url,
                              remote_password=password)
        assert password not in repr(config)


def test_values_signed_under_another_secret_are_never_served(
    redis_cluster: LocalRedisCluster, tmp_path: Path,
) -> None:
    """Someone who can reach the cluster but does not hold the deployment's secret (or
    another deployment sharing the namespace by mistake) publishes values: found by the
    lookup, refused by the fetch (MAC), recomputed."""
    namespace = f"f{uuid.uuid4().hex[:12]}"
    matched, fetched = _publish_then_fetch(
        redis_cluster.url, tmp_path, namespace=namespace,
        writer={"remote_secret": b"the-forgers-own-secret"},
        reader={"remote_secret": b"the-deployments-secret"})
    assert matched > 0 and fetched == 0


class HeldCluster:
    """A shared store whose publish batches wait at a gate (a slow or stopped cluster): the
    test counts, independently of the publisher, the publishes each batch holds."""

    def __init__(self, inner: RedisClusterStore) -> None:
        self.inner = inner
        self.go = threading.Event()
        self.in_flight = 0
        self.landed = 0

    def publish_many(self, items: Any) -> Any:
        self.in_flight = len(items)
        assert self.go.wait(30), "the test never let the cluster answer"
        try:
            return self.inner.publish_many(items)
        finally:
            self.landed += len(items)
            self.in_flight = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def held_publishes_scenario(store: RedisClusterStore) -> None:
    """Offers keep coming while the cluster holds a batch: what the publisher holds (queued
    plus the batch being published) never exceeds twice remote_queue_depth, best-effort
    content is shed past the depth, and every refusal is counted."""
    depth = 4
    cluster = HeldCluster(store)
    publisher = RemotePublisher(cluster, config(drop_on_pressure=True, max_batch_blocks=3),
                                queue_depth=depth)
    keys = chain(40)
    accepted = 0
    worst = 0
    outcomes: list[Offer] = []

    async def main() -> None:
        nonlocal accepted, worst
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            for i, k in enumerate(keys):
                outcome = publisher.offer(record(i, k, expiry=None if i % 2 else 99.0),
                                          block(i), now=0.0, wall_now=0.0)
                outcomes.append(outcome)
                accepted += outcome is Offer.QUEUED
                await trio.testing.wait_all_tasks_blocked()  # the run task took its batch
                worst = max(worst, accepted - cluster.landed)
            cluster.go.set()
            publisher.close()

    trio.run(main)
    assert cluster.in_flight == 0
    assert worst <= 2 * depth, f"the publisher held {worst} publishes"
    stats = publisher.statistics()
    assert stats.offers["shed"] > 0 and stats.offers["full"] > 0, stats
    assert stats.offers["queued"] == accepted == cluster.landed
    assert sum(stats.offers.values()) == len(keys)
    # Only best-effort content is shed; retained content is refused at the hard bound only.
    assert all(o is not Offer.SHED for i, o in enumerate(outcomes) if i % 2 == 0)


def test_a_held_cluster_never_makes_the_publisher_hold_more_than_its_bound(
    store: RedisClusterStore,
) -> None:
    held_publishes_scenario(store)


def test_the_publish_bound_test_fails_when_the_batch_in_flight_is_not_counted(
    store: RedisClusterStore,
) -> None:
    from fuzz import planted

    with planted.publishes_in_flight_uncounted(), pytest.raises(AssertionError,
                                                                match="the publisher held"):
        held_publishes_scenario(store)
