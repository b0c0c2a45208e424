"""The index journal: an open rebuilds the disk index from one sequential file, no header scan.

What it records (a SLOT record after each landed spill, a FREE record before a slot is written
again and for each discarded slot, a seal at close), when an open trusts it (complete, this
data file, this config, signed under a MAC key) and when it falls back to the header scan
(with the reason), and that a journal entry gone stale can only fail a read, never serve
wrong bytes.  The crash points of its appends are in test_crash_consistency.py.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from fuzz.crash import prompts, serve_checked, workload_config
from io_actors.embed import BlockingCache
from io_actors.metrics import StateKVCollector
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.index_journal import (
    COMPACT_FACTOR,
    FREE,
    HEAD,
    INDEX_FILE,
    RECORD_SIZE,
    SEAL,
    SLOT,
)
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE, StoreOpening
from io_actors.storage.record_file import RecordFile
from io_actors.storage.slot_format import pack_slot
from statekv.errors import ConfigError, TransferFailed
from statekv.ids import SlotId
from tests.io_helpers import append_stuck_in_the_disk, small_config
from tests.test_persistence import MAC_KEY, block, config, key, meta


def kinds(directory: Path) -> list[tuple[int, int]]:
    """(kind, slot) of every whole record of the journal."""
    data = (directory / INDEX_FILE).read_bytes()
    return [(struct.unpack_from("<I", data, n + 12)[0], struct.unpack_from("<Q", data, n + 24)[0])
            for n in range(0, len(data) - len(data) % RECORD_SIZE, RECORD_SIZE)]


def restored(store: PosixSlotStore) -> dict[int, bytes]:
    return {s.slot: bytes(s.key) for s in store.recovery.slots}


def reopen(directory: Path, **kwargs: object) -> PosixSlotStore:
    return PosixSlotStore(directory, config(), **kwargs)  # type: ignore[arg-type]


def test_a_reopen_rebuilds_from_the_journal_without_a_header_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = reopen(tmp_path)
    assert store.recovery.index.source == "none"
    for slot in range(5):
        store.write(SlotId(slot), key(slot), block(slot), meta(slot, expiry=9000.0 + slot))
    store.close()

    def no_scan(*_args: object) -> None:
        raise AssertionError("the header scan ran")

    monkeypatch.setattr(StoreOpening, "_scan", no_scan)
    store = reopen(tmp_path)
    index = store.recovery.index
    assert (index.source, index.sealed, index.torn, index.reason) == ("journal", True, 0, "")
    assert restored(store) == {s: key(s) for s in range(5)}
    assert store.recovery.slots[2].meta == meta(2, expiry=9002.0)
    dst = page_aligned_buffer(store.payload_len)
    store.read(SlotId(3), key(3), dst)
    assert torch.equal(dst, block(3))
    store.close()


def test_the_journal_restores_what_the_scan_restores_less_the_discarded(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    for slot in range(6):
        store.write(SlotId(slot), key(slot), block(slot), meta(slot))
    store.write(SlotId(1), key(11), block(11), meta(11))  # a displacement reusing slot 1
    store.write(SlotId(2), key(12), block(12))  # no restore metadata: not restorable
    store.discard(SlotId(4))  # the content left the cache; its bytes stay
    store.close()
    store = reopen(tmp_path)
    from_journal = restored(store)
    assert store.recovery.index.source == "journal"
    assert store.recovery.index.freed >= 2
    store.close()
    (tmp_path / INDEX_FILE).unlink()
    store = reopen(tmp_path)
    assert store.recovery.index.source == "scan"
    assert store.recovery.index.reason == "no index journal"
    from_scan = restored(store)
    store.close()
    assert from_journal == {0: key(0), 1: key(11), 3: key(3), 5: key(5)}
    assert from_scan == {**from_journal, 4: key(4)}  # the scan resurrects the discarded slot


def test_a_displacement_is_freed_before_its_write_and_indexed_after(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    store.write(SlotId(3), key(1), block(1), meta(1))
    store.write(SlotId(3), key(2), block(2), meta(2))
    store.discard(SlotId(3))
    store.close()
    assert kinds(tmp_path) == [(HEAD, 8), (SLOT, 3), (FREE, 3), (SLOT, 3), (FREE, 3), (SEAL, 5)]


def test_a_crash_loses_held_discards_and_the_seal_only(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    store.write(SlotId(0), key(0), block(0), meta(0))
    store.write(SlotId(1), key(1), block(1), meta(1))
    store.discard(SlotId(1))
    store.abandon()  # as kill -9 would leave it: the discard was never appended
    store = reopen(tmp_path)
    index = store.recovery.index
    assert (index.source, index.sealed) == ("journal", False)
    # Slot 1's bytes are its key's KV, with the metadata its spill wrote: still correct.
    assert restored(store) == {0: key(0), 1: key(1)}
    store.close()


@pytest.mark.parametrize("tail", ["partial", "whole"])
def test_a_torn_last_record_is_ignored_and_counted(tmp_path: Path, tail: str) -> None:
    store = reopen(tmp_path)
    for slot in range(3):
        store.write(SlotId(slot), key(slot), block(slot), meta(slot))
    store.abandon()
    path = tmp_path / INDEX_FILE
    data = bytearray(path.read_bytes())
    if tail == "partial":
        data = data[: -RECORD_SIZE // 3]  # the last append, torn inside its record
    else:
        data[-10] ^= 0xFF  # the last record whole, but rotten
    path.write_bytes(bytes(data))
    store = reopen(tmp_path)
    assert store.recovery.index.source == "journal"
    assert store.recovery.index.torn == 1
    assert restored(store) == {0: key(0), 1: key(1)}  # slot 2's record is the torn one
    store.close()
    assert path.stat().st_size % RECORD_SIZE == 0  # the torn tail was cut off
    store = reopen(tmp_path)
    assert (store.recovery.index.source, store.recovery.index.torn) == ("journal", 0)
    store.close()


def test_a_record_torn_in_the_middle_falls_back_to_the_scan_and_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = reopen(tmp_path)
    for slot in range(3):
        store.write(SlotId(slot), key(slot), block(slot), meta(slot))
    store.close()
    path = tmp_path / INDEX_FILE
    data = bytearray(path.read_bytes())
    data[RECORD_SIZE + 40] ^= 0x01  # record 1's key rots
    path.write_bytes(bytes(data))
    # The open's own logger, whatever other tests did to logging's configuration.
    logger = logging.getLogger("io_actors.storage.posix_open")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign, assignment]
    monkeypatch.setattr(logger, "disabled", False)
    # The fuzz tests' modules set the "io_actors" loggers to ERROR when imported
    # (setLevel, not the attribute: it clears the loggers' cached levels).
    previous = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        store = reopen(tmp_path)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    assert store.recovery.index.source == "scan"
    assert "middle" in store.recovery.index.reason
    assert any("index rebuilt from the slot headers" in r.getMessage()
               and store.recovery.index.reason in r.getMessage() for r in records)
    assert restored(store) == {s: key(s) for s in range(3)}  # the scan found them all
    store.close()
    store = reopen(tmp_path)
    assert store.recovery.index.source == "journal"  # the open rewrote it
    assert restored(store) == {s: key(s) for s in range(3)}
    store.close()


def test_a_journal_of_another_data_file_or_config_is_not_used(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    store.write(SlotId(0), key(0), block(0), meta(0))
    store.write(SlotId(6), key(6), block(6), meta(6))
    store.close()
    # Resized: the journal still describes the file as it was read; the open rewrites it.
    shrunk = PosixSlotStore(tmp_path, config(disk_blocks=4))
    assert shrunk.recovery.index.source == "journal"
    assert restored(shrunk) == {0: key(0)} and shrunk.recovery.beyond_capacity == 1
    shrunk.close()
    grown = PosixSlotStore(tmp_path, config(disk_blocks=12))
    assert grown.recovery.index.source == "journal" and restored(grown) == {0: key(0)}
    grown.close()
    other = PosixSlotStore(tmp_path, config(disk_blocks=12, fingerprint="another model"))
    assert other.recovery.index.source == "scan"
    assert "config fingerprint" in other.recovery.index.reason
    assert other.recovery.foreign == 1
    other.close()
    store = PosixSlotStore(tmp_path, config(disk_blocks=12))
    assert store.recovery.index.source == "scan" and restored(store) == {0: key(0)}
    store.close()
    # A data file replaced behind the journal's back (same size, another inode).
    data = tmp_path / DATA_FILE
    copy = tmp_path / "copy"
    copy.write_bytes(data.read_bytes())
    copy.chmod(0o600)
    os.replace(copy, data)
    store = PosixSlotStore(tmp_path, config(disk_blocks=12))
    assert store.recovery.index.source == "scan"
    assert "another data file" in store.recovery.index.reason
    store.close()


def test_a_slot_changed_behind_the_journals_back_is_never_served(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    for slot in range(3):
        store.write(SlotId(slot), key(slot), block(slot), meta(slot))
    fingerprint = store.config_fingerprint
    store.close()
    path = tmp_path / DATA_FILE
    with open(path, "r+b") as f:
        f.seek(1 * 8192 + 4096 + 17)  # slot 1: one payload byte rots
        f.write(b"\x5a")
        # Slot 2 now holds another block, whole and valid under its own key.
        f.seek(2 * 8192)
        f.write(pack_slot(slot=SlotId(2), key=key(7), payload=bytes(block(7)),
                          config=fingerprint, meta=meta(7)))
    store = reopen(tmp_path)
    assert store.recovery.index.source == "journal"
    assert restored(store) == {s: key(s) for s in range(3)}  # the journal still names them
    dst = page_aligned_buffer(store.payload_len)
    with pytest.raises(TransferFailed, match="checksum"):
        store.read(SlotId(1), key(1), dst)
    with pytest.raises(TransferFailed, match="key mismatch"):
        store.read(SlotId(2), key(2), dst)
    store.read(SlotId(0), key(0), dst)
    assert torch.equal(dst, block(0))
    assert store.statistics().read_failures == 2
    store.close()


def test_a_cache_recomputes_a_block_whose_slot_changed_behind_the_journal(
    tmp_path: Path,
) -> None:
    cfg = workload_config(tmp_path)
    all_prompts = prompts(3, 12)
    with BlockingCache(cfg) as cache:
        assert sum(serve_checked(cache, f"r{i}", p, 3600.0)
                   for i, p in enumerate(all_prompts)) == 0
    rank = cfg.rank_directory()
    assert rank is not None
    store = PosixSlotStore(rank, cfg.core_config())
    slots = [s.slot for s in store.recovery.slots]
    slot_bytes = store.slot_bytes
    store.close()
    assert slots
    with open(rank / DATA_FILE, "r+b") as f:
        for slot in slots:  # every restored slot's payload rots
            f.seek(slot * slot_bytes + 4096 + 5)
            f.write(b"\xee")
    with BlockingCache(cfg) as cache:
        recovery = cache.statistics().recovery
        assert recovery is not None and recovery.index.source == "journal"
        # serve_checked compares every page the cache hands over with its key's KV.
        assert sum(serve_checked(cache, f"again{i}", p, None)
                   for i, p in enumerate(all_prompts)) == 0
        stats = cache.statistics().cache
        assert stats.onboard_failures > 0  # found at the read, recomputed
        cache.check_invariants()
        registry = CollectorRegistry()
        registry.register(StateKVCollector(cache.statistics))
        text = generate_latest(registry).decode()
        assert "statekv_restore_from_index_journal 1.0" in text
        assert "statekv_index_records_journaled_total" in text


def test_under_a_mac_key_an_unsigned_or_forged_journal_is_not_used(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    store.write(SlotId(0), key(0), block(0), meta(0))
    store.close()
    signed = reopen(tmp_path, mac_key=MAC_KEY)
    assert signed.recovery.index.source == "scan"
    assert "unauthenticated" in signed.recovery.index.reason
    signed.write(SlotId(1), key(1), block(1), meta(1))
    signed.close()
    path = tmp_path / INDEX_FILE
    signed = reopen(tmp_path, mac_key=MAC_KEY)
    assert signed.recovery.index.source == "journal"
    assert restored(signed) == {1: key(1)}
    signed.close()
    # Someone who can write the file but has no key forges a record (CRC fixed up).
    data = bytearray(path.read_bytes())
    at = RECORD_SIZE  # the first SLOT record: point it at slot 5
    data[at + 24 : at + 32] = (5).to_bytes(8, "little")
    data[at + RECORD_SIZE - 4 : at + RECORD_SIZE] = zlib.crc32(
        bytes(data[at : at + RECORD_SIZE - 4])).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    signed = reopen(tmp_path, mac_key=MAC_KEY)
    assert signed.recovery.index.source == "scan"
    assert "unauthenticated" in signed.recovery.index.reason
    signed.close()


def test_persist_off_wipes_the_index_journal(tmp_path: Path) -> None:
    store = reopen(tmp_path)
    store.write(SlotId(0), key(0), block(0), meta(0))
    store.close()
    wiped = reopen(tmp_path, persist=False)
    assert wiped.recovery.slots == () and wiped.recovery.index.source == "none"
    wiped.close()
    assert kinds(tmp_path) == [(HEAD, 8), (SEAL, 1)]
    store = reopen(tmp_path)
    assert store.recovery.index.source == "journal" and store.recovery.slots == ()
    store.close()


def test_an_index_journal_others_may_write_is_refused_naming_disk_dir(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, disk=8)
    with BlockingCache(cfg):
        pass
    rank = cfg.rank_directory()
    assert rank is not None
    path = rank / INDEX_FILE
    path.chmod(0o620)
    with pytest.raises(ConfigError, match="group or others may write") as info:
        BlockingCache(cfg)
    assert info.value.field == "disk_dir"
    with pytest.raises(ConfigError) as store_info:
        PosixSlotStore(rank, cfg.core_config())
    assert store_info.value.field == "directory"
    assert path.stat().st_mode & 0o777 == 0o620  # refused before anything changed
    path.chmod(0o600)
    BlockingCache(cfg).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_an_index_journal_of_another_user_is_refused_naming_disk_dir(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, disk=8)
    with BlockingCache(cfg):
        pass
    rank = cfg.rank_directory()
    assert rank is not None
    os.chown(rank / INDEX_FILE, 4242, -1)
    with pytest.raises(ConfigError, match="belongs to uid 4242") as info:
        BlockingCache(cfg)
    assert info.value.field == "disk_dir"


def test_an_index_journal_that_is_a_link_is_refused(tmp_path: Path) -> None:
    reopen(tmp_path).close()
    (tmp_path / INDEX_FILE).unlink()
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / INDEX_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="not a regular file") as info:
        reopen(tmp_path)
    assert info.value.field == "directory"


def test_a_failed_append_gives_the_journal_up_until_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = reopen(tmp_path)
    store.write(SlotId(0), key(0), block(0), meta(0))

    def failing(self: RecordFile, data: bytes, *, sync: bool) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RecordFile, "append", failing)
    store.write(SlotId(1), key(1), block(1), meta(1))  # the spill itself still lands
    store.write(SlotId(2), key(2), block(2), meta(2))
    stats = store.statistics()
    assert (stats.writes, stats.index_failures) == (3, 1)
    assert not (tmp_path / INDEX_FILE).exists()  # so the next open cannot trust a hole
    store.close()
    monkeypatch.undo()
    store = reopen(tmp_path)
    assert store.recovery.index.source == "scan"
    assert restored(store) == {s: key(s) for s in range(3)}
    store.close()


def test_the_journal_stays_bounded_and_right(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, config(disk_blocks=2))
    for n in range(60):
        store.write(SlotId(n % 2), key(n), block(n % 4), meta(n))
    store.close()
    assert (tmp_path / INDEX_FILE).stat().st_size <= (COMPACT_FACTOR * 2 + 64 + 2) * RECORD_SIZE
    store = PosixSlotStore(tmp_path, config(disk_blocks=2))
    assert store.recovery.index.source == "journal"
    assert restored(store) == {0: key(58), 1: key(59)}
    store.close()


def test_under_disk_sync_data_the_journal_is_kept_the_same_way(tmp_path: Path) -> None:
    store = reopen(tmp_path, sync_writes=True)
    store.write(SlotId(0), key(0), block(0), meta(0))
    store.abandon()
    store = reopen(tmp_path, sync_writes=True)
    assert store.recovery.index.source == "journal"
    assert restored(store) == {0: key(0)}
    store.close()


def test_a_full_disk_with_no_index_journal_starts_the_cache_and_the_next_open_scans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """ENOSPC while writing a missing index journal: the cache starts (from the header
    scan), runs without the journal, and a later open finds the content by the scan."""
    import errno as errno_module

    from io_actors.embed import BlockingCache
    from io_actors.storage.record_file import RecordFile
    from tests.io_helpers import serve, small_config, wait_quiet, wait_ready
    from tests.test_io_actors import churn

    config = small_config(tmp_path)
    prompt = list(range(13))
    with BlockingCache(config) as cache:
        serve(cache, "p", prompt, ttl_seconds=600)
        churn(cache, 6)
        wait_quiet(cache)
    rank = config.rank_directory()
    assert rank is not None
    (rank / INDEX_FILE).unlink()
    real_replace = RecordFile.replace

    def full_disk(self: RecordFile, data: bytes) -> None:
        if self.path.name == INDEX_FILE:
            raise OSError(errno_module.ENOSPC, "No space left on device")
        real_replace(self, data)

    monkeypatch.setattr(RecordFile, "replace", full_disk)
    with caplog.at_level("WARNING", logger="io_actors.storage.index_journal"), \
            BlockingCache(config) as cache:
        match = cache.add_request("again", prompt)
        assert match.disk_tokens == 12
        wait_ready(cache, "again")
        cache.release("again")
    assert "this run keeps none" in caplog.text
    assert not (rank / INDEX_FILE).exists()
    monkeypatch.setattr(RecordFile, "replace", real_replace)
    with BlockingCache(config) as cache:
        assert cache.statistics().recovery.index.source == "scan"  # type: ignore[union-attr]
        assert cache.add_request("third", prompt).disk_tokens == 12


def test_a_compaction_copies_each_indexed_record_as_it_was_appended(tmp_path: Path) -> None:
    # The compacted journal is the head and, in slot order, the very bytes each slot's
    # last SLOT record had when it was appended: nothing is packed again.
    from io_actors.storage.index_journal import IndexJournal
    from io_actors.storage.slot_format import SlotMeta

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        journal = IndexJournal(tmp_path, fd, slots=3, config=b"c" * 16, mac_key=MAC_KEY,
                               sync=False)
        journal.start([], b"f" * 32)
        head = (tmp_path / INDEX_FILE).read_bytes()
        last: dict[int, bytes] = {}
        appended: list[bytes] = []

        def observe(what: str, path: Path, before: int, after: int) -> None:
            appended.append(path.read_bytes()[before:after])

        journal.observer = observe
        n = 0
        while journal.statistics().compactions == 0:
            slot = n % 3 if n % 7 else 1  # slot 1 written more often: orders differ
            record_meta = SlotMeta(parent=bytes([n % 251]) * 32, depth=n % 5,
                                   reuse_count=n, expiry=None if n % 2 else 1e9 + n,
                                   written_at=float(n), sequence=n)
            # The append that crosses the bound is compacted along with the rest.
            journal.landed([(slot, bytes([n % 256]) * 32, record_meta)])
            last[slot] = appended[-1]
            n += 1
        data = (tmp_path / INDEX_FILE).read_bytes()
        assert data == head + b"".join(last[s] for s in sorted(last))
        journal.close()
    finally:
        os.close(fd)


def test_a_record_changed_behind_the_journal_is_not_given_a_fresh_checksum(
    tmp_path: Path,
) -> None:
    store = reopen(tmp_path, mac_key=MAC_KEY)
    store.write(SlotId(0), key(0), block(0), meta(0))
    path = tmp_path / INDEX_FILE
    data = bytearray(path.read_bytes())
    at = RECORD_SIZE * max(i for i, record in enumerate(kinds(tmp_path))
                           if record == (SLOT, 0))
    data[at + 40] ^= 0xFF  # a byte of slot 0's key (bytes 32-63 of its record), on disk
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data[at : at + RECORD_SIZE])
    # Enough appends for slot 1 that the journal compacts, copying slot 0's record along.
    writes = (COMPACT_FACTOR * 8 + 64) // 2 + 8  # a FREE and a SLOT record each
    for n in range(1, writes + 1):
        store.write(SlotId(1), key(n), block(n % 4), meta(n))
    assert len(kinds(tmp_path)) < 2 * writes  # compacted
    store.close()
    store = reopen(tmp_path, mac_key=MAC_KEY)
    # The changed record still fails its checksum, so the index comes from the headers and
    # names slot 0's real key (a fresh checksum would have restored the changed one).
    assert store.recovery.index.source == "scan"
    assert restored(store)[0] == key(0)
    store.close()


def test_the_serving_threads_calls_never_wait_for_a_writers_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A discard (the scheduler dispatching a FreeSlot, under its lock) and statistics()
    return while a writer's append is stuck in the disk; the discard's FREE record still
    goes with the next append, ahead of the slot's next write."""
    import threading

    store = reopen(tmp_path)
    store.write(SlotId(0), key(0), block(0), meta(0))
    store.write(SlotId(1), key(1), block(1), meta(1))
    with append_stuck_in_the_disk(monkeypatch, INDEX_FILE,
                                  lambda: store.write(SlotId(2), key(2), block(2), meta(2))):
        def serving_thread_calls() -> None:
            store.discard(SlotId(0))
            store.statistics()

        calls = threading.Thread(target=serving_thread_calls)
        calls.start()
        calls.join(5)
        assert not calls.is_alive(), "discard() or statistics() waited for the append"
    store.write(SlotId(1), key(3), block(3), meta(3))
    assert kinds(tmp_path)[-3:] == [(FREE, 0), (FREE, 1), (SLOT, 1)]
    store.close()
    store = reopen(tmp_path)
    assert restored(store) == {1: key(3), 2: key(2)}
    store.close()
