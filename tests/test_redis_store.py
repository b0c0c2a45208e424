"""The shared tier's store against a real three-master Redis Cluster on loopback.

Every test runs Debian's redis-server (tests/redis_cluster.py); with CI set, a machine
without it fails these tests rather than skipping them.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.redis_cluster import die_with_parent
from io_actors.storage.cluster_url import parse_cluster_url
from io_actors.storage.redis_store import (
    FetchStatus,
    RedisClusterStore,
    RemoteFetchFailed,
    RemoteIO,
)
from io_actors.storage.remote_faults import (
    FaultyRemoteStore,
    RemoteFault,
    RemoteFaultPlan,
    RemoteFaultRule,
    RemoteOp,
)
from io_actors.storage.slot_format import HEADER_SIZE, SlotMeta, pack_slot
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.ids import BlockHash
from tests.redis_cluster import LocalRedisCluster, free_ports, redis_tools

CONFIG = CacheConfig(block_size=16, gpu_blocks=8, model_fingerprint="model-a")
MAC = b"m" * 32
SENTINEL = 0x5A


@pytest.fixture
def namespace() -> str:
    """Keys of one test never meet another's on the shared cluster."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(redis_cluster: LocalRedisCluster, namespace: str) -> Iterator[RedisClusterStore]:
    with RedisClusterStore(redis_cluster.url, CONFIG, namespace=namespace,
                           timeout_s=0.25) as s:
        yield s


def chain(n: int, *, salt: str | None = None, model: str = "model-a",
          first: int = 0) -> list[BlockHash]:
    keys: list[BlockHash] = []
    parent = root_key(model, salt, None)
    for i in range(n):
        parent = chain_key(parent, token_bytes(range(first + 16 * i, first + 16 * (i + 1))))
        keys.append(parent)
    return keys


def block(seed: int, config: CacheConfig = CONFIG) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (config.block_bytes,), dtype=torch.uint8, generator=g)


def blank(config: CacheConfig = CONFIG) -> torch.Tensor:
    return torch.full((config.block_bytes,), SENTINEL, dtype=torch.uint8)


def status_of(outcome: TransferFailed | None) -> FetchStatus:
    if outcome is None:
        return FetchStatus.HIT
    assert isinstance(outcome, RemoteFetchFailed)
    return outcome.status


# --- bad input at open ---------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "", "   ", 42, None, "http://127.0.0.1:7000", "redis://", "redis://127.0.0.1",
    "redis://127.0.0.1:0", "redis://127.0.0.1:70000", "redis://127.0.0.1:x",
    "redis://127.0.0.1:7000/3", "redis://user:secret@127.0.0.1:7000",
    "redis://127.0.0.1:7000?db=1", "redis://127.0.0.1:7000,ftp://h:1",
])
def test_a_bad_cluster_url_is_a_config_error_naming_url(url: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster_url(url)
    assert info.value.field == "url"
    with pytest.raises(ConfigError) as info:
        RedisClusterStore(url, CONFIG)  # type: ignore[arg-type]
    assert info.value.field == "url"


def test_a_url_lists_every_master() -> None:
    nodes = parse_cluster_url("redis://127.0.0.1:7000, redis://localhost:7001/")
    assert [(n.host, n.port) for n in nodes] == [("127.0.0.1", 7000), ("localhost", 7001)]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"namespace": ""}, "namespace"),
    ({"namespace": "a:b"}, "namespace"),
    ({"namespace": 7}, "namespace"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"timeout_s": 1e9}, "timeout_s"),
    ({"mac_key": b"short"}, "mac_key"),
    ({"mac_key": "x" * 32}, "mac_key"),
    ({"config": "not a config"}, "config"),
])
def test_bad_arguments_fail_before_any_connection(
    redis_cluster: LocalRedisCluster, kwargs: dict[str, object], field: str,
) -> None:
    clients_before = _clients(redis_cluster)
    args: dict[str, object] = {"url": redis_cluster.url, "config": CONFIG, **kwargs}
    with pytest.raises(ConfigError) as info:
        RedisClusterStore(**args)  # type: ignore[arg-type]
    assert info.value.field == field
    assert _clients(redis_cluster) == clients_before


def _clients(cluster: LocalRedisCluster) -> int:
    """Client connections across the masters (redis-cli's own included, the same each time)."""
    total = 0
    for node in cluster.nodes:
        for line in cluster.command(node, "info", "clients").splitlines():
            if line.startswith("connected_clients:"):
                total += int(line.split(":")[1])
    return total


def test_an_unreachable_cluster_is_a_config_error_at_open() -> None:
    (port,) = free_ports(1)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        RedisClusterStore(f"redis://127.0.0.1:{port}", CONFIG, timeout_s=0.2)
    assert info.value.field == "url"
    assert str(port) in str(info.value)
    assert time.monotonic() - started < 30  # bounded by timeout_s, never a hang


def test_a_standalone_redis_is_not_a_cluster(tmp_path: Path) -> None:
    server, cli = redis_tools()
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir",
         str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while subprocess.run([cli, "-p", str(port), "ping"], capture_output=True,
                             text=True, check=False).stdout.strip() != "PONG":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        with pytest.raises(ConfigError) as info:
            RedisClusterStore(f"redis://127.0.0.1:{port}", CONFIG, timeout_s=0.5)
        assert info.value.field == "url"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_one_reachable_master_is_enough_to_open(redis_cluster: LocalRedisCluster,
                                                namespace: str) -> None:
    (dead,) = free_ports(1)
    url = f"redis://127.0.0.1:{dead},redis://{redis_cluster.nodes[1].address}"
    with RedisClusterStore(url, CONFIG, namespace=namespace, timeout_s=0.25) as s:
        key = chain(1)[0]
        s.publish(key, block(1))
        dst = blank()
        s.fetch(key, dst)
        assert torch.equal(dst, block(1))


# --- the data path -------------------------------------------------------------------------


def test_blocks_round_trip_byte_for_byte_across_every_master(
    redis_cluster: LocalRedisCluster, store: RedisClusterStore,
) -> None:
    keys = chain(48)
    assert all(o is None for o in store.publish_many(
        [RemoteIO(k, block(i)) for i, k in enumerate(keys)]))
    dsts = [blank() for _ in keys]
    outcomes = store.fetch_many([RemoteIO(k, d) for k, d in zip(keys, dsts, strict=True)])
    assert outcomes == [None] * len(keys)
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, block(i))
    # No hash tag: the blocks of one chain spread over the masters.
    owners = {redis_cluster.node_for(store.redis_key(k)).port for k in keys}
    assert len(owners) == 3
    assert store.match_prefix(keys) == len(keys)
    stats = store.statistics()
    assert stats.published == len(keys)
    assert stats.fetch_outcomes["hit"] == len(keys)


def test_the_value_is_the_slot_format(store: RedisClusterStore) -> None:
    """Header, payload and checksums are slot_format's: pack_slot's image, unpadded."""
    key = chain(1)[0]
    meta = SlotMeta(parent=bytes(32), depth=0, reuse_count=2, expiry=None, written_at=1.0,
                    sequence=7)
    store.publish(key, block(3), meta)
    value = store.client.get(store.redis_key(key))
    image = pack_slot(slot=0, key=key, payload=block(3).numpy().tobytes(),  # type: ignore[arg-type]
                      config=store.config_fingerprint, meta=meta)
    assert value == image[: HEADER_SIZE + CONFIG.block_bytes]


def test_a_version_2_value_is_fetched_and_a_corrupted_one_refused(
        store: RedisClusterStore) -> None:
    """A value a replica of the previous build published (slot format version 2, zlib CRC-32)
    is fetched and verified with its own checksums; one bit off and it is CORRUPT."""
    good, bad = chain(2)
    for key, seed in ((good, 4), (bad, 5)):
        image = pack_slot(slot=0, key=key,  # type: ignore[arg-type]
                          payload=block(seed).numpy().tobytes(),
                          config=store.config_fingerprint, version=2)
        value = bytearray(image[: HEADER_SIZE + CONFIG.block_bytes])
        if key == bad:
            value[HEADER_SIZE + 17] ^= 0x01
        store.client.set(store.redis_key(key), bytes(value))
    got, other = blank(), blank()
    outcome = store.fetch_many([RemoteIO(good, got), RemoteIO(bad, other)])
    assert status_of(outcome[0]) is FetchStatus.HIT
    assert torch.equal(got, block(4))
    assert status_of(outcome[1]) is FetchStatus.CORRUPT
    assert "payload checksum mismatch" in str(outcome[1])
    assert torch.equal(other, blank())


def test_match_stops_at_the_first_block_the_cluster_lacks(store: RedisClusterStore) -> None:
    keys = chain(6)
    store.publish_many([RemoteIO(k, block(i)) for i, k in enumerate(keys) if i != 3])
    assert store.present(keys) == [True, True, True, False, True, True]
    assert store.match_prefix(keys) == 3


def test_tenants_and_models_never_meet(redis_cluster: LocalRedisCluster,
                                       store: RedisClusterStore, namespace: str) -> None:
    mine = chain(2, salt="tenant-a")
    store.publish_many([RemoteIO(k, block(i)) for i, k in enumerate(mine)])
    assert store.match_prefix(chain(2, salt="tenant-b")) == 0
    assert store.match_prefix(chain(2, salt=None)) == 0
    assert store.match_prefix(chain(2, salt="tenant-a", model="model-b")) == 0
    # Same key, other layout: another config fingerprint, another key space.
    other = CacheConfig(block_size=16, gpu_blocks=8, model_fingerprint="model-a",
                        layout=KVLayout(num_layers=1, num_kv_heads=2, head_dim=4,
                                        dtype="float32"))
    assert other.block_bytes == CONFIG.block_bytes
    with RedisClusterStore(redis_cluster.url, other, namespace=namespace) as s2:
        assert s2.match_prefix(mine) == 0
        # Even planted under this store's key, the other layout's bytes are refused.
        store.client.set(store.redis_key(mine[0]), s2.encode(mine[0], block(9)))
    dst = blank()
    with pytest.raises(RemoteFetchFailed) as info:
        store.fetch(mine[0], dst)
    assert info.value.status is FetchStatus.FOREIGN
    assert int(dst.eq(SENTINEL).sum()) == dst.numel()


def test_ttl_is_redis_key_expiry(store: RedisClusterStore) -> None:
    short, kept = chain(2)
    store.publish(short, block(1), ttl_s=0.3)
    store.publish(kept, block(2))
    assert 0 < store.client.pttl(store.redis_key(short)) <= 300
    assert store.client.pttl(store.redis_key(kept)) == -1
    deadline = time.monotonic() + 10
    while store.present([short]) != [False]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RemoteFetchFailed) as info:
        store.fetch(short, blank())
    assert info.value.status is FetchStatus.MISSING
    with pytest.raises(UsageError) as bad:
        store.publish(short, block(1), ttl_s=0)
    assert bad.value.field == "ttl_s"


def test_mac_refuses_blocks_written_without_the_key(redis_cluster: LocalRedisCluster,
                                                   namespace: str) -> None:
    keys = chain(3)
    url = redis_cluster.url
    with (RedisClusterStore(url, CONFIG, namespace=namespace, mac_key=MAC) as signed,
          RedisClusterStore(url, CONFIG, namespace=namespace) as plain,
          RedisClusterStore(url, CONFIG, namespace=namespace, mac_key=b"o" * 32) as other):
        signed.publish(keys[0], block(0))
        plain.publish(keys[1], block(1))
        dst = blank()
        signed.fetch(keys[0], dst)
        assert torch.equal(dst, block(0))
        for reader, key in ((signed, keys[1]), (other, keys[0])):
            dst = blank()
            with pytest.raises(RemoteFetchFailed) as info:
                reader.fetch(key, dst)
            assert info.value.status is FetchStatus.MAC_MISMATCH
            assert int(dst.eq(SENTINEL).sum()) == dst.numel()
        assert other.statistics().fetch_outcomes["mac_mismatch"] == 1


def test_bad_buffers_are_usage_errors_before_anything_is_sent(store: RedisClusterStore) -> None:
    key = chain(1)[0]
    for bad in (torch.zeros(3, dtype=torch.uint8), torch.zeros(CONFIG.block_bytes),
                "bytes"):
        with pytest.raises(UsageError):
            store.publish(key, bad)  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            store.fetch(key, bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        store.publish(BlockHash(b"short"), block(1))
    assert store.present([key]) == [False]
    assert store.statistics().fetches == 0


# --- faults on the real cluster ------------------------------------------------------------


EXPECTED = {
    RemoteFault.TIMEOUT: {FetchStatus.UNAVAILABLE},
    RemoteFault.CONNECTION_RESET: {FetchStatus.HIT, FetchStatus.UNAVAILABLE},
    RemoteFault.MOVED: {FetchStatus.HIT},
    RemoteFault.ASK: {FetchStatus.HIT},
    RemoteFault.EVICTED: {FetchStatus.MISSING},
    RemoteFault.CORRUPT: {FetchStatus.CORRUPT},
    RemoteFault.TRUNCATED: {FetchStatus.CORRUPT},
    RemoteFault.WRONG_KEY: {FetchStatus.WRONG_KEY},
}


@pytest.mark.parametrize("fault", list(RemoteFault))
def test_each_fault_ends_in_right_bytes_or_a_typed_failure(
    store: RedisClusterStore, fault: RemoteFault,
) -> None:
    keys = chain(5, first=1000)
    assert store.publish_many([RemoteIO(k, block(i)) for i, k in enumerate(keys)]) == [None] * 5
    faulty = FaultyRemoteStore(
        store, RemoteFaultPlan(rules=(RemoteFaultRule(op=RemoteOp.FETCH, fault=fault, nth=3),),
                               seed=11))
    dsts = [blank() for _ in keys]
    outcomes = faulty.fetch_many([RemoteIO(k, d) for k, d in zip(keys, dsts, strict=True)])
    assert faulty.injected == (f"fetch#3:{fault.value}",)
    for i, (outcome, dst) in enumerate(zip(outcomes, dsts, strict=True)):
        status = status_of(outcome)
        if i == 2:
            assert status in EXPECTED[fault], outcome
        else:
            assert status is FetchStatus.HIT, outcome
        if status is FetchStatus.HIT:
            assert torch.equal(dst, block(i))
        else:
            assert int(dst.eq(SENTINEL).sum()) == dst.numel(), "a failed fetch wrote bytes"
    counted = store.statistics().fetch_outcomes
    assert sum(counted.values()) == 5
    assert counted["hit"] == sum(1 for o in outcomes if o is None)
    # The cluster serves on after the fault (a timeout's pause is over, a slot moved).
    dst = blank()
    store.fetch(keys[0], dst)
    assert torch.equal(dst, block(0))


@pytest.mark.parametrize("fault", [RemoteFault.TIMEOUT, RemoteFault.CONNECTION_RESET,
                                   RemoteFault.MOVED, RemoteFault.ASK])
def test_publish_faults_never_leave_a_servable_wrong_block(
    store: RedisClusterStore, fault: RemoteFault,
) -> None:
    keys = chain(3, first=2000)
    faulty = FaultyRemoteStore(
        store, RemoteFaultPlan(rules=(RemoteFaultRule(op="publish", fault=fault, nth=2),)))
    outcomes = faulty.publish_many([RemoteIO(k, block(i)) for i, k in enumerate(keys)])
    assert outcomes[0] is None and outcomes[2] is None
    for i, key in enumerate(keys):
        dst = blank()
        try:
            store.fetch(key, dst)
        except RemoteFetchFailed as exc:
            # A publish that timed out may or may not have landed; never as wrong bytes.
            assert i == 1 and exc.status is FetchStatus.MISSING
        else:
            assert torch.equal(dst, block(i))
    if fault in (RemoteFault.MOVED, RemoteFault.ASK, RemoteFault.CONNECTION_RESET):
        assert outcomes[1] is None or fault is RemoteFault.CONNECTION_RESET


@pytest.mark.parametrize("fault", [RemoteFault.CORRUPT, RemoteFault.TRUNCATED,
                                   RemoteFault.EVICTED, RemoteFault.WRONG_KEY])
def test_enumerated_faults_never_serve_wrong_bytes(store: RedisClusterStore,
                                                   fault: RemoteFault) -> None:
    """As SQLite does it: count a scenario's calls, then strike each one in turn."""
    keys = chain(4, first=3000)

    def scenario(faulty: FaultyRemoteStore) -> list[FetchStatus]:
        faulty.publish_many([RemoteIO(k, block(i)) for i, k in enumerate(keys)])
        dsts = [blank() for _ in keys]
        outcomes = faulty.fetch_many([RemoteIO(k, d) for k, d in zip(keys, dsts, strict=True)])
        statuses = [status_of(o) for o in outcomes]
        for i, (status, dst) in enumerate(zip(statuses, dsts, strict=True)):
            if status is FetchStatus.HIT:
                assert torch.equal(dst, block(i))
            else:
                assert int(dst.eq(SENTINEL).sum()) == dst.numel()
        return statuses

    counting = FaultyRemoteStore(store, RemoteFaultPlan())
    assert scenario(counting) == [FetchStatus.HIT] * len(keys)
    calls = counting.calls("fetch")
    assert calls == len(keys)
    for k in range(1, calls + 1):
        for seed in range(3):
            plan = RemoteFaultPlan(rules=(RemoteFaultRule(op="fetch", fault=fault, nth=k),),
                                   seed=seed)
            statuses = scenario(FaultyRemoteStore(store, plan))
            assert statuses[k - 1] in EXPECTED[fault]
            assert statuses.count(FetchStatus.HIT) == len(keys) - 1


def test_fault_plans_reject_bad_rules() -> None:
    with pytest.raises(UsageError) as info:
        RemoteFaultRule(op="publish", fault="corrupt", nth=1)
    assert info.value.field == "op"
    with pytest.raises(UsageError) as info:
        RemoteFaultRule(op="fetch", fault="melt", nth=1)
    assert info.value.field == "fault"
    with pytest.raises(UsageError) as info:
        RemoteFaultRule(op="fetch", fault="moved", nth=0)
    assert info.value.field == "nth"


# --- a master dies -------------------------------------------------------------------------


def test_a_cluster_with_dead_masters_opens_while_one_answers(
    own_redis_cluster: LocalRedisCluster,
) -> None:
    """A replica restarted while a master is down still opens its shared tier: the open
    pings the masters until one answers (it pinged a random node, and failed one open in
    three with one master down)."""
    cluster = own_redis_cluster
    for victim in cluster.nodes[:2]:
        cluster.kill(victim)
    for _ in range(5):  # a random pick would fail at least one in 5 with 2 of 3 dead
        with RedisClusterStore(cluster.url, CONFIG, timeout_s=0.25):
            pass
    cluster.kill(cluster.nodes[2])
    with pytest.raises(ConfigError, match="url"):
        RedisClusterStore(cluster.url, CONFIG, timeout_s=0.25)


def test_killing_a_master_loses_only_its_blocks(own_redis_cluster: LocalRedisCluster) -> None:
    cluster = own_redis_cluster
    keys = chain(60, first=5000)
    with RedisClusterStore(cluster.url, CONFIG, timeout_s=0.25) as s:
        assert s.publish_many([RemoteIO(k, block(i)) for i, k in enumerate(keys)]) == [None] * 60
        later = chain(40, first=9000)
        owner = {k: cluster.node_for(s.redis_key(k)).port for k in [*keys, *later]}
        victim = cluster.nodes[1]
        cluster.kill(victim)
        started = time.monotonic()
        dsts = [blank() for _ in keys]
        outcomes = s.fetch_many([RemoteIO(k, d) for k, d in zip(keys, dsts, strict=True)])
        assert time.monotonic() - started < 60, "a dead master must cost a timeout, not a hang"
        for i, (key, outcome, dst) in enumerate(zip(keys, outcomes, dsts, strict=True)):
            status = status_of(outcome)
            if owner[key] == victim.port:
                assert status in (FetchStatus.UNAVAILABLE, FetchStatus.MISSING)
                assert int(dst.eq(SENTINEL).sum()) == dst.numel()
            else:
                assert status is FetchStatus.HIT, outcome
                assert torch.equal(dst, block(i))
        # Serving goes on: blocks whose slots live on the survivors publish and fetch.
        fresh = [k for k in later if owner[k] != victim.port][:5]
        assert s.publish_many([RemoteIO(k, block(100 + i)) for i, k in enumerate(fresh)]) \
            == [None] * len(fresh)
        for i, key in enumerate(fresh):
            dst = blank()
            s.fetch(key, dst)
            assert torch.equal(dst, block(100 + i))


def test_a_cluster_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A test session killed without its clean-up (mutmut's CPU limit sends SIGXCPU; kill -9)
    must not leave its redis-servers running: they get SIGTERM when their parent dies."""
    redis_tools()
    if not die_with_parent():
        pytest.skip("no setpriv (util-linux) on this machine")
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from bench.redis_cluster import LocalRedisCluster\n"
        "c = LocalRedisCluster(Path(sys.argv[1]), masters=3).start()\n"
        "print(' '.join(str(n.process.pid) for n in c.nodes), flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    assert child.stdout is not None
    pids = [int(p) for p in child.stdout.readline().split()]
    assert len(pids) == 3
    child.kill()
    child.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists()
                 and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
        time.sleep(0.05)
    assert not alive, f"redis-servers {alive} outlived the process that started them"
