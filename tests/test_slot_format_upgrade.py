"""A disk directory written by the previous build (slot format version 2, zlib CRC-32
checksums) keeps working after the upgrade to version 3 (CRC-32C): its slots are restored,
served byte for byte and verified with the checksum they were written with, a corrupted one
is still refused, and new slots are written as version 3 beside them.

The old build's slots are made here by rewriting every slot of a data file this build wrote
into version 2 (``pack_slot(version=2)``; tests/test_slot_format.py pins those bytes to the
version 2 build's own): the data file keeps its name (``slots.v2``) and the journals their
records, as the old build left them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from io_actors.embed import BlockingCache
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.index_journal import INDEX_FILE
from io_actors.storage.interfaces import SlotIO
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE
from io_actors.storage.slot_format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    SlotHeader,
    payload_checksum,
)
from statekv.errors import TransferFailed
from statekv.ids import SlotId
from tests.io_helpers import compute, serve, small_config, wait_quiet, wait_ready
from tests.test_persistence import MAC_KEY, PROMPTS, block, config, key, meta, spill_and_close
from tests.test_persistence import written as written_v3

SLOT_BYTES = 8192
"""tests.test_persistence.config(): a 2048-byte payload padded, behind its 4 KiB header."""


def as_version_2(path: Path, slot_bytes: int, mac_key: bytes | None = None) -> list[int]:
    """Rewrite every written slot of the data file at `path` as the version 2 build wrote
    it (zlib CRC-32 for both checksums, the MAC over a version 2 header); the slots
    rewritten."""
    data = bytearray(path.read_bytes())
    slots = []
    for at in range(0, len(data), slot_bytes):
        if data[at:at + len(MAGIC)] != MAGIC:
            continue
        header = SlotHeader.unpack(data[at:at + HEADER_SIZE], what="slot")
        assert header.version in (2, FORMAT_VERSION)
        payload = bytes(data[at + HEADER_SIZE:at + HEADER_SIZE + header.payload_len])
        old = SlotHeader(slot=header.slot, key=header.key, payload_len=header.payload_len,
                         payload_crc=payload_checksum(payload, version=2), version=2,
                         config=header.config, meta=header.meta)
        block_view = memoryview(data)[at:at + HEADER_SIZE]
        old.pack_into(block_view, mac_key=mac_key, payload=payload)
        assert SlotHeader.unpack(block_view, what="slot").version == 2
        slots.append(header.slot)
    path.write_bytes(bytes(data))
    return slots


def header_version(path: Path, slot: int) -> int:
    with open(path, "rb") as f:
        f.seek(slot * SLOT_BYTES)
        return SlotHeader.unpack(f.read(HEADER_SIZE), what=f"slot {slot}").version


ENTRIES = {0: 0, 1: 1, 3: 3, 6: 6}


@pytest.mark.parametrize("rebuild", ["journal", "scan"])
def test_a_directory_of_version_2_slots_is_restored_and_served(tmp_path: Path,
                                                               rebuild: str) -> None:
    written_v3(tmp_path, ENTRIES)
    assert as_version_2(tmp_path / DATA_FILE, SLOT_BYTES) == sorted(ENTRIES)
    if rebuild == "scan":
        (tmp_path / INDEX_FILE).unlink()
    store = PosixSlotStore(tmp_path, config())
    try:
        rec = store.recovery
        assert [(s.slot, s.key, s.meta) for s in rec.slots] == [
            (slot, key(n), meta(n)) for slot, n in sorted(ENTRIES.items())
        ]
        assert (rec.corrupt, rec.foreign, rec.old_files) == (0, 0, 0)
        for slot, n in ENTRIES.items():
            dst = page_aligned_buffer(store.payload_len)
            store.read(SlotId(slot), key(n), dst)
            assert torch.equal(dst, block(n))
        # The batched read path verifies each slot with its own version's checksum too.
        dsts = {slot: page_aligned_buffer(store.payload_len) for slot in ENTRIES}
        outcome = store.read_many([SlotIO(SlotId(slot), key(n), dsts[slot])
                                   for slot, n in ENTRIES.items()])
        assert outcome == [None] * len(ENTRIES)
        assert all(torch.equal(dsts[slot], block(n)) for slot, n in ENTRIES.items())
        # New content goes down as version 3 beside the old slots; both read back.
        store.write(SlotId(2), key(2), block(2), meta(2))
        store.write_many([SlotIO(SlotId(4), key(4), block(4), meta=meta(4))])
    finally:
        store.close()
    assert [header_version(tmp_path / DATA_FILE, s) for s in (0, 1, 2, 3, 4, 6)] == [
        2, 2, 3, 2, 3, 2]
    assert sorted(os.listdir(tmp_path)) == [INDEX_FILE, DATA_FILE]
    (tmp_path / INDEX_FILE).unlink()  # the scan reads both versions' headers
    store = PosixSlotStore(tmp_path, config())
    try:
        assert [s.slot for s in store.recovery.slots] == [0, 1, 2, 3, 4, 6]
        assert store.recovery.corrupt == 0
        dsts = {slot: page_aligned_buffer(store.payload_len) for slot in (0, 2, 4, 6)}
        outcome = store.read_many([SlotIO(SlotId(slot), key(slot), dsts[slot])
                                   for slot in (0, 2, 4, 6)])
        assert outcome == [None] * 4
        assert all(torch.equal(dsts[slot], block(slot)) for slot in (0, 2, 4, 6))
    finally:
        store.close()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x04]))


def test_a_corrupted_version_2_slot_is_still_refused(tmp_path: Path) -> None:
    written_v3(tmp_path, ENTRIES)
    path = tmp_path / DATA_FILE
    as_version_2(path, SLOT_BYTES)
    _flip(path, 1 * SLOT_BYTES + HEADER_SIZE + 1000)   # slot 1: a payload bit
    _flip(path, 3 * SLOT_BYTES + 40)                   # slot 3: a header bit (the key)
    store = PosixSlotStore(tmp_path, config())
    try:
        dst = page_aligned_buffer(store.payload_len)
        with pytest.raises(TransferFailed, match="payload checksum mismatch"):
            store.read(SlotId(1), key(1), dst)
        with pytest.raises(TransferFailed, match="header checksum mismatch"):
            store.read(SlotId(3), key(3), dst)
        outcome = store.read_many([SlotIO(SlotId(s), key(n), page_aligned_buffer(
            store.payload_len)) for s, n in ENTRIES.items()])
        assert [o is None for o in outcome] == [True, False, False, True]
        assert "payload checksum mismatch" in str(outcome[1])
        store.read(SlotId(6), key(6), dst)
        assert torch.equal(dst, block(6))
    finally:
        store.close()
    (tmp_path / INDEX_FILE).unlink()
    store = PosixSlotStore(tmp_path, config())
    try:
        # The scan reads headers only: the torn header is found there, the payload at its read.
        assert [s.slot for s in store.recovery.slots] == [0, 1, 6]
        assert store.recovery.corrupt == 1
    finally:
        store.close()


def test_version_2_slots_under_a_mac_key_verify_and_a_forged_one_fails(tmp_path: Path) -> None:
    written_v3(tmp_path, {0: 0, 1: 1}, mac_key=MAC_KEY)
    path = tmp_path / DATA_FILE
    as_version_2(path, SLOT_BYTES, mac_key=MAC_KEY)
    store = PosixSlotStore(tmp_path, config(), mac_key=MAC_KEY)
    try:
        dst = page_aligned_buffer(store.payload_len)
        store.read(SlotId(0), key(0), dst)
        assert torch.equal(dst, block(0))
    finally:
        store.close()
    as_version_2(path, SLOT_BYTES, mac_key=b"not-the-key-16by")  # valid CRCs, a wrong MAC
    store = PosixSlotStore(tmp_path, config(), mac_key=MAC_KEY)
    try:
        with pytest.raises(TransferFailed, match="MAC mismatch"):
            store.read(SlotId(1), key(1), page_aligned_buffer(store.payload_len))
    finally:
        store.close()


def _data_file(disk_dir: Path) -> Path:
    (path,) = disk_dir.rglob(DATA_FILE)
    return path


def test_a_cache_restarted_on_a_version_2_directory_serves_it_as_disk_hits(
        tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16)
    spill_and_close(cfg)
    path = _data_file(tmp_path)
    slot_bytes = HEADER_SIZE + -(-cfg.core_config().block_bytes // 4096) * 4096
    assert as_version_2(path, slot_bytes)
    with BlockingCache(cfg) as cache:
        stats = cache.statistics()
        restored = stats.cache.restored_blocks
        assert restored == stats.cache.disk_cached_blocks > 0
        for i, prompt in enumerate(PROMPTS):
            serve(cache, f"again{i}", prompt)  # checks every matched page byte for byte
            wait_quiet(cache)
        after = cache.statistics().cache
        assert after.hit_blocks_disk >= restored
        assert after.onboard_failures == 0
        cache.check_invariants()


def test_a_cache_never_serves_a_corrupted_version_2_slot(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16)
    spill_and_close(cfg)
    path = _data_file(tmp_path)
    slot_bytes = HEADER_SIZE + -(-cfg.core_config().block_bytes // 4096) * 4096
    slots = as_version_2(path, slot_bytes)
    for slot in slots:  # one payload bit in every slot
        _flip(path, slot * slot_bytes + HEADER_SIZE + 7)
    with BlockingCache(cfg) as cache:
        assert cache.statistics().cache.restored_blocks > 0
        for i, prompt in enumerate(PROMPTS):
            status = cache.add_request(f"r{i}", prompt)
            wait_ready(cache, f"r{i}")
            # Every read failed its checksum: the request fell back, nothing it holds came
            # from disk.
            assert cache.request_status(f"r{i}").num_computed_tokens <= (
                status.gpu_tokens + status.host_tokens)
            compute(cache, f"r{i}", prompt)
            cache.release(f"r{i}")
            wait_quiet(cache)
        stats = cache.statistics().cache
        assert stats.onboards_completed == 0
        assert stats.onboard_failures > 0
        cache.check_invariants()
