"""A retention deadline extended after the block's slot was written survives a restart.

The slot header holds the deadline the block was spilled with; a later request with a longer
TTL that matched the same content lengthens it while the block is on disk.  That extension is
appended to the retention journal next to the data file and replayed at open.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.metrics import StateKVCollector
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.retention_journal import (
    COMPACT_FACTOR,
    JOURNAL_FILE,
    RECORD_SIZE,
    JournalReplay,
    RetentionRecord,
    pack_record,
)
from io_actors.storage.slot_format import SlotMeta
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError
from statekv.ids import BlockHash, SlotId
from statekv.lifecycle import BlockState
from tests.io_helpers import (
    append_stuck_in_the_disk,
    compute,
    serve,
    small_config,
    wait_quiet,
    wait_ready,
)

TTL_A = 600.0
TTL_B = 7200.0
PROMPT = [7000 + t for t in range(9)]
"""Two full blocks of 4 tokens, and one token more."""


def fillers(n: int) -> list[list[int]]:
    return [[100 * (p + 1) + t for t in range(17)] for p in range(n)]


def extend_on_disk(cfg: StateKVConfig) -> dict[BlockHash, float]:
    """Spill PROMPT's blocks with TTL_A, then extend them to TTL_B while they are on disk
    (another request's private duplicate, released with the longer TTL, stamps its cached
    twin).  Returns the extended deadlines, by key."""
    with BlockingCache(cfg) as cache:
        cache.add_request("a", PROMPT, ttl_seconds=TTL_A)
        cache.add_request("b", PROMPT, ttl_seconds=TTL_B)
        compute(cache, "a", PROMPT)
        compute(cache, "b", PROMPT)  # committed after "a": "b"'s blocks stay private
        cache.release("a")
        first = {blk.key: blk.expiry for blk in cache.cached_blocks()
                 if blk.expiry is not None}
        assert len(first) == 2
        for i, tokens in enumerate(fillers(6)):
            serve(cache, f"f{i}", tokens)
            wait_quiet(cache)
        states = {blk.key: blk.state for blk in cache.cached_blocks()}
        assert all(states[key] is BlockState.ON_DISK for key in first), states
        cache.release("b")
        wait_quiet(cache)
        extended = {blk.key: blk.expiry for blk in cache.cached_blocks() if blk.key in first}
        for key, expiry in extended.items():
            assert expiry is not None and expiry > first[key] + (TTL_B - TTL_A) / 2
        cache.check_invariants()
    return {key: expiry for key, expiry in extended.items() if expiry is not None}


def test_an_extended_deadline_of_a_block_on_disk_survives_a_clean_restart(
    tmp_path: Path,
) -> None:
    cfg = small_config(tmp_path, gpu=8, host=1, reserved_host=1, disk=32)
    extended = extend_on_disk(cfg)
    with BlockingCache(cfg) as cache:
        restored = {blk.key: blk for blk in cache.cached_blocks()}
        for key, expiry in extended.items():
            assert restored[key].state is BlockState.ON_DISK
            assert restored[key].expiry == expiry
        # ... and the block is served from its slot, byte for byte.
        match = cache.add_request("again", PROMPT)
        wait_ready(cache, "again")
        assert match.disk_tokens == 8
        cache.release("again")


# --- the journal at the store: replay, what is ignored, and what is refused ----------------------

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32")
MAC_KEY = b"0123456789abcdef"
HEADER_DEADLINE = 2_000_000_000.0


def core(slots: int = 8, fingerprint: str = "") -> CacheConfig:
    return CacheConfig(block_size=4, gpu_blocks=2, host_blocks=2, disk_blocks=slots,
                       layout=LAYOUT, model_fingerprint=fingerprint)


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(4, "little") * 8)


def spill(store: PosixSlotStore, slot: int, n: int) -> None:
    data = page_aligned_buffer(core().block_bytes)
    data.fill_(n)
    store.write(SlotId(slot), key(n), data, SlotMeta(
        parent=bytes(32), depth=0, reuse_count=0, expiry=HEADER_DEADLINE, written_at=1.0,
        sequence=n))


def record(slot: int, n: int, expiry: float) -> RetentionRecord:
    return RetentionRecord(slot=slot, key=key(n), expiry=expiry)


def deadlines(store: PosixSlotStore) -> dict[int, float | None]:
    return {entry.slot: entry.meta.expiry for entry in store.recovery.slots}


def test_the_later_deadline_wins_and_a_reused_slot_makes_its_records_inert(
    tmp_path: Path,
) -> None:
    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    spill(store, 1, 2)
    spill(store, 2, 3)
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 50), record(1, 2, HEADER_DEADLINE + 9)])
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 20)])  # earlier: never shortens
    store.persist_retention([record(2, 3, HEADER_DEADLINE + 70)])
    spill(store, 2, 4)  # slot 2 reused: the record of key 3 says nothing about key 4
    store.persist_retention([record(1, 2, HEADER_DEADLINE - 5)])  # below the header's
    assert store.statistics().retention_records == 5
    store.close()
    store = PosixSlotStore(tmp_path, core())
    assert deadlines(store) == {0: HEADER_DEADLINE + 50, 1: HEADER_DEADLINE + 9,
                                2: HEADER_DEADLINE}
    assert store.recovery.journal == JournalReplay(records=5, applied=4, stale=1)
    store.close()
    # The open rewrote the journal with what still applies: one record per raised slot.
    assert (tmp_path / JOURNAL_FILE).stat().st_size == 2 * RECORD_SIZE
    store = PosixSlotStore(tmp_path, core())
    assert deadlines(store)[0] == HEADER_DEADLINE + 50
    store.close()


def test_a_torn_tail_and_a_rotten_record_are_ignored_and_counted(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    spill(store, 1, 2)
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 10)])
    store.persist_retention([record(1, 2, HEADER_DEADLINE + 20)])
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 30)])
    store.close()
    path = tmp_path / JOURNAL_FILE
    data = bytearray(path.read_bytes())
    data[RECORD_SIZE + 60] ^= 0x01  # the second record's deadline rots
    path.write_bytes(bytes(data[: -RECORD_SIZE // 2]))  # and the last append is torn
    store = PosixSlotStore(tmp_path, core())  # never fails the open
    assert deadlines(store) == {0: HEADER_DEADLINE + 10, 1: HEADER_DEADLINE}
    assert store.recovery.journal == JournalReplay(records=2, applied=1, torn=2)
    store.persist_retention([record(1, 2, HEADER_DEADLINE + 40)])  # appends stay aligned
    store.close()
    store = PosixSlotStore(tmp_path, core())
    assert deadlines(store) == {0: HEADER_DEADLINE + 10, 1: HEADER_DEADLINE + 40}
    assert store.recovery.journal.torn == 0
    store.close()


def test_records_of_another_config_fingerprint_are_ignored(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    store.close()
    config = PosixSlotStore(tmp_path / "other", core(fingerprint="another model"))
    foreign = pack_record(record(0, 1, HEADER_DEADLINE + 10), config.config_fingerprint, None)
    config.close()
    (tmp_path / JOURNAL_FILE).write_bytes(foreign)
    (tmp_path / JOURNAL_FILE).chmod(0o600)
    store = PosixSlotStore(tmp_path, core())
    assert deadlines(store) == {0: HEADER_DEADLINE}
    assert store.recovery.journal == JournalReplay(records=1, foreign=1)
    store.close()


def test_under_a_mac_a_record_without_a_valid_mac_is_ignored_and_counted(
    tmp_path: Path,
) -> None:
    store = PosixSlotStore(tmp_path, core(), mac_key=MAC_KEY)
    spill(store, 0, 1)
    spill(store, 1, 2)
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 10)])
    fingerprint = store.config_fingerprint
    store.close()
    path = tmp_path / JOURNAL_FILE
    # Forged by someone without the key: valid CRC, no MAC / a MAC under another key.
    forged = (pack_record(record(1, 2, HEADER_DEADLINE + 99), fingerprint, None)
              + pack_record(record(0, 1, HEADER_DEADLINE + 99), fingerprint,
                            b"another-key-16by"))
    with path.open("ab") as f:
        f.write(forged)
    store = PosixSlotStore(tmp_path, core(), mac_key=MAC_KEY)
    assert deadlines(store) == {0: HEADER_DEADLINE + 10, 1: HEADER_DEADLINE}
    assert store.recovery.journal == JournalReplay(records=3, applied=1, unauthenticated=2)
    store.close()


def test_the_count_of_ignored_records_is_a_metric(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=8, host=1, reserved_host=1, disk=32,
                       disk_mac_key=MAC_KEY)
    extend_on_disk(cfg)
    rank = cfg.rank_directory()
    assert rank is not None
    path = rank / JOURNAL_FILE
    data = bytearray(path.read_bytes())
    assert len(data) >= RECORD_SIZE
    data[60] ^= 0x01  # the deadline of the first record changes ...
    data[RECORD_SIZE - 4 : RECORD_SIZE] = zlib.crc32(bytes(data[: RECORD_SIZE - 4])).to_bytes(
        4, "little")  # ... its CRC is made to match: only the MAC can tell
    path.write_bytes(bytes(data))
    with BlockingCache(cfg) as cache:
        stats = cache.statistics()
        assert stats.recovery is not None and stats.recovery.journal.unauthenticated == 1
        registry = CollectorRegistry()
        registry.register(StateKVCollector(cache.statistics))
        text = generate_latest(registry).decode()
    assert 'statekv_restore_retention_records{outcome="unauthenticated"} 1.0' in text


@pytest.mark.parametrize("problem", ["group-writable", "symlink"])
def test_a_journal_others_may_write_is_refused_before_anything_changes(
    tmp_path: Path, problem: str,
) -> None:
    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 10)])
    store.close()
    path = tmp_path / JOURNAL_FILE
    before = path.read_bytes()
    if problem == "group-writable":
        path.chmod(0o620)
    else:
        (tmp_path / "elsewhere").write_bytes(before)
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path, core())
    assert info.value.field == "directory"
    assert path.read_bytes() == before
    cfg = small_config(tmp_path / "cache", gpu=8, host=1, reserved_host=1, disk=32)
    rank = cfg.rank_directory()
    assert rank is not None
    PosixSlotStore(rank, cfg.core_config()).close()
    (rank / JOURNAL_FILE).write_bytes(before)
    (rank / JOURNAL_FILE).chmod(0o666)
    with pytest.raises(ConfigError, match="group or others may write") as info:
        BlockingCache(cfg)
    assert info.value.field == "disk_dir"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_journal_of_another_user_is_refused(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 10)])
    store.close()
    os.chown(tmp_path / JOURNAL_FILE, 4242, -1)
    with pytest.raises(ConfigError, match="belongs to uid 4242") as info:
        PosixSlotStore(tmp_path, core())
    assert info.value.field == "directory"


def test_persistence_off_wipes_the_journal_too(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    store.persist_retention([record(0, 1, HEADER_DEADLINE + 10)])
    store.close()
    assert (tmp_path / JOURNAL_FILE).exists()
    PosixSlotStore(tmp_path, core(), persist=False).close()
    assert not (tmp_path / JOURNAL_FILE).exists()
    store = PosixSlotStore(tmp_path, core())
    assert store.recovery.slots == () and store.recovery.journal == JournalReplay()
    store.close()


def test_the_journal_stays_bounded_at_run_time(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, core(slots=4))
    for slot in range(4):
        spill(store, slot, slot + 1)
    for n in range(400):
        store.persist_retention([record(n % 4, n % 4 + 1, HEADER_DEADLINE + n)])
    assert store.statistics().journal_compactions > 0
    assert (tmp_path / JOURNAL_FILE).stat().st_size <= (COMPACT_FACTOR * 4 + 64) * RECORD_SIZE
    store.close()
    store = PosixSlotStore(tmp_path, core(slots=4))
    assert deadlines(store) == {s: HEADER_DEADLINE + 396 + s for s in range(4)}
    store.close()


def test_statistics_never_wait_for_a_retention_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache's statistics() runs on the serving thread: it must not wait for the
    retention task's append (its write and fdatasync hold the journal's lock)."""
    import threading

    store = PosixSlotStore(tmp_path, core())
    spill(store, 0, 1)
    with append_stuck_in_the_disk(
            monkeypatch, JOURNAL_FILE,
            lambda: store.persist_retention([record(0, 1, HEADER_DEADLINE + 50)])):
        seen: list[int] = []
        reader = threading.Thread(target=lambda: seen.append(
            store.statistics().retention_records))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "statistics() waited for the append"
        assert seen == [0]
    assert store.statistics().retention_records == 1
    store.close()
