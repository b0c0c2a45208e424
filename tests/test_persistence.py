"""The persistent disk tier: opening a slot directory safely, and reopening what is in it.

Store level: who may own the directory, an open that fails leaves nothing behind, an existing
data file is resized, a directory of a newer format or held by another process is a typed
error, and the header scan sorts every slot into restorable or reclaimed-for-a-reason.
Cache level: a cache reopened on the directory serves the blocks an earlier one spilled,
byte for byte, as disk hits, with their deadlines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.index_journal import INDEX_FILE
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE
from io_actors.storage.slot_format import (
    HEADER_SIZE,
    MacMismatch,
    SlotHeader,
    SlotMeta,
    payload_checksum,
)
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, DirectoryInUse, NewerFormat, TransferFailed
from statekv.ids import BlockHash, SlotId
from statekv.lifecycle import BlockState
from tests.io_helpers import compute, serve, small_config, wait_quiet, wait_ready

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32")
"""4 tokens -> 1 x 2 x 4 x 1 x 64 x 4 = 2048 bytes a block; a slot is 8 KiB."""
MAC_KEY = b"0123456789abcdef"


def config(disk_blocks: int = 8, fingerprint: str = "") -> CacheConfig:
    return CacheConfig(block_size=4, gpu_blocks=2, host_blocks=2, disk_blocks=disk_blocks,
                       layout=LAYOUT, model_fingerprint=fingerprint)


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(4, "little") * 8)


def meta(n: int, *, expiry: float | None = None) -> SlotMeta:
    return SlotMeta(parent=bytes(32), depth=n % 3, reuse_count=n, expiry=expiry,
                    written_at=1000.0 + n, sequence=n)


def block(seed: int) -> torch.Tensor:
    out = page_aligned_buffer(config().block_bytes)
    out.copy_(torch.randint(0, 256, (out.numel(),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return out


def written(directory: Path, entries: dict[int, int], **kwargs: object) -> None:
    """Write key(n) with meta(n) to slot s for each s -> n, then close."""
    store = PosixSlotStore(directory, config(), **kwargs)  # type: ignore[arg-type]
    for slot, n in entries.items():
        store.write(SlotId(slot), key(n), block(n), meta(n))
    store.close()


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --- ownership and modes ------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["directory", "data file"])
def test_a_directory_or_data_file_others_may_write_is_refused(tmp_path: Path, target: str) -> None:
    written(tmp_path / "d", {0: 1})
    path = tmp_path / "d" if target == "directory" else tmp_path / "d" / DATA_FILE
    before = path.stat().st_mode
    path.chmod(before | 0o020)
    with pytest.raises(ConfigError, match="group or others may write") as info:
        PosixSlotStore(tmp_path / "d", config())
    assert info.value.field == "directory"
    path.chmod(before)
    PosixSlotStore(tmp_path / "d", config()).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
@pytest.mark.parametrize("target", ["directory", "data file"])
def test_a_directory_or_data_file_of_another_user_is_refused(tmp_path: Path, target: str) -> None:
    written(tmp_path / "d", {0: 1})
    path = tmp_path / "d" if target == "directory" else tmp_path / "d" / DATA_FILE
    os.chown(path, 4242, -1)
    with pytest.raises(ConfigError, match="belongs to uid 4242") as info:
        PosixSlotStore(tmp_path / "d", config())
    assert info.value.field == "directory"


# --- nothing half-applied -----------------------------------------------------------------------


def test_a_disk_larger_than_the_free_space_leaves_nothing_behind(tmp_path: Path) -> None:
    fs = os.statvfs(tmp_path)
    # Twice the free space, so that disk freed by other processes meanwhile cannot make it
    # fit (a grow that then succeeds would fill the disk).
    too_many = 2 * (fs.f_bavail * fs.f_frsize // (8 * 1024)) + 1000
    with pytest.raises(ConfigError, match="free") as info:
        PosixSlotStore(tmp_path / "a" / "b", config(too_many))
    assert info.value.field == "disk_blocks"
    assert listing(tmp_path) == []  # the directories it created are gone too


def test_an_existing_file_grows_and_keeps_its_slots(tmp_path: Path) -> None:
    written(tmp_path, {1: 1, 5: 5})
    store = PosixSlotStore(tmp_path, config(12))
    assert os.stat(store.path).st_size == 12 * store.slot_bytes
    assert [(s.slot, s.key) for s in store.recovery.slots] == [(1, key(1)), (5, key(5))]
    dst = page_aligned_buffer(store.payload_len)
    store.read(SlotId(5), key(5), dst)
    assert torch.equal(dst, block(5))
    store.close()


def test_an_existing_file_shrinks_and_counts_the_slots_cut_off(tmp_path: Path) -> None:
    written(tmp_path, {1: 1, 6: 6})
    store = PosixSlotStore(tmp_path, config(4))
    assert os.stat(store.path).st_size == 4 * store.slot_bytes
    assert [s.slot for s in store.recovery.slots] == [1]
    assert store.recovery.beyond_capacity == 1
    store.close()


def test_a_grow_that_does_not_fit_restores_the_file(tmp_path: Path) -> None:
    written(tmp_path, {1: 1})
    size = os.stat(tmp_path / DATA_FILE).st_size
    fs = os.statvfs(tmp_path)
    with pytest.raises(ConfigError) as info:
        # Twice the free space: other processes freeing disk meanwhile must not turn the
        # refusal into a grow that succeeds and fills the disk.
        PosixSlotStore(tmp_path, config(2 * (fs.f_bavail * fs.f_frsize // (8 * 1024)) + 1000))
    assert info.value.field == "disk_blocks"
    assert os.stat(tmp_path / DATA_FILE).st_size == size
    store = PosixSlotStore(tmp_path, config())
    assert [s.key for s in store.recovery.slots] == [key(1)]
    store.close()


def test_a_half_created_file_of_a_failed_open_is_removed(tmp_path: Path) -> None:
    (tmp_path / (DATA_FILE + ".new")).write_bytes(b"x" * 100)
    PosixSlotStore(tmp_path, config()).close()
    assert listing(tmp_path) == [INDEX_FILE, DATA_FILE]


# --- typed errors before anything changes -------------------------------------------------------


def test_a_directory_of_a_newer_format_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "slots.v99").write_bytes(b"")
    with pytest.raises(NewerFormat, match="newer statekv") as info:
        PosixSlotStore(tmp_path, config())
    assert info.value.field == "directory"
    assert listing(tmp_path) == ["slots.v99"]


def test_an_older_format_file_is_reclaimed(tmp_path: Path) -> None:
    (tmp_path / "slots.v1").write_bytes(b"old" * 100)
    store = PosixSlotStore(tmp_path, config())
    assert store.recovery.old_files == 1
    store.close()
    assert listing(tmp_path) == [INDEX_FILE, DATA_FILE]


def test_a_foreign_data_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    data = b"not a statekv file" * 1000
    (tmp_path / DATA_FILE).write_bytes(data)
    (tmp_path / DATA_FILE).chmod(0o600)
    with pytest.raises(ConfigError, match="not a statekv slot file") as info:
        PosixSlotStore(tmp_path, config())
    assert info.value.field == "directory"
    assert (tmp_path / DATA_FILE).read_bytes() == data


def test_a_second_process_on_the_directory_is_a_typed_error(tmp_path: Path) -> None:
    written(tmp_path, {0: 0})
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys\n"
         "from io_actors.storage.posix import PosixSlotStore\n"
         "from tests.test_persistence import config\n"
         f"s = PosixSlotStore({str(tmp_path)!r}, config())\n"
         "print('open', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        with pytest.raises(DirectoryInUse) as info:
            PosixSlotStore(tmp_path, config())
        assert info.value.field == "directory"
    finally:
        holder.communicate("")
    PosixSlotStore(tmp_path, config()).close()  # free again once the other process is gone


# --- the header scan ----------------------------------------------------------------------------


def test_the_scan_sorts_every_slot_into_restorable_or_reclaimed(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path, config())
    store.write(SlotId(0), key(0), block(0), meta(0, expiry=5000.0))
    store.write(SlotId(1), key(1), block(1))               # no meta: not restorable
    store.write(SlotId(2), key(2), block(2), meta(2))
    store.write(SlotId(3), key(2), block(2), attrs_newer(meta(2)))  # the same key, newer
    store.write(SlotId(4), key(4), block(4), meta(4))
    store.close()
    other = PosixSlotStore(tmp_path, config(fingerprint="another model"))
    other.close()
    with open(tmp_path / DATA_FILE, "r+b") as f:           # a header torn by a crash
        f.seek(4 * 8192 + 100)
        f.write(b"\xff")
    store = PosixSlotStore(tmp_path, config())
    rec = store.recovery
    assert [(s.slot, s.key) for s in rec.slots] == [(0, key(0)), (3, key(2))]
    assert rec.slots[0].meta == meta(0, expiry=5000.0)
    assert (rec.foreign, rec.corrupt, rec.duplicates) == (1, 1, 1)
    store.close()
    # The same slots read with another model fingerprint: all foreign, none served.
    store = PosixSlotStore(tmp_path, config(fingerprint="another model"))
    assert store.recovery.slots == () and store.recovery.foreign == 4
    with pytest.raises(TransferFailed, match="another configuration"):
        store.read(SlotId(0), key(0), page_aligned_buffer(store.payload_len))
    store.close()


def attrs_newer(m: SlotMeta) -> SlotMeta:
    return SlotMeta(parent=m.parent, depth=m.depth, reuse_count=m.reuse_count,
                    expiry=m.expiry, written_at=m.written_at + 1, sequence=m.sequence)


def test_persist_off_wipes_the_slots(tmp_path: Path) -> None:
    written(tmp_path, {0: 0, 1: 1})
    store = PosixSlotStore(tmp_path, config(), persist=False)
    assert store.recovery.slots == ()
    store.close()
    store = PosixSlotStore(tmp_path, config())
    assert store.recovery.slots == ()
    store.close()


# --- the keyed MAC ------------------------------------------------------------------------------


def test_a_slot_forged_with_valid_checksums_is_never_served_under_a_mac(tmp_path: Path) -> None:
    written(tmp_path, {2: 2}, mac_key=MAC_KEY)
    # Another user with write access rewrites the payload and fixes up both checksums.
    path = tmp_path / DATA_FILE
    image = bytearray(path.read_bytes())
    at = 2 * 8192
    header = SlotHeader.unpack(image[at:at + HEADER_SIZE], what="slot 2")
    forged = bytes(block(99))
    forged_header = SlotHeader(slot=2, key=header.key, payload_len=len(forged),
                               payload_crc=payload_checksum(forged), config=header.config,
                               meta=header.meta, mac=header.mac)
    image[at:at + HEADER_SIZE] = forged_header.pack()
    image[at + HEADER_SIZE:at + HEADER_SIZE + len(forged)] = forged
    path.write_bytes(bytes(image))
    plain = PosixSlotStore(tmp_path, config())
    dst = page_aligned_buffer(plain.payload_len)
    plain.read(SlotId(2), key(2), dst)  # a CRC alone is fooled: this is the attack
    assert torch.equal(dst, block(99))
    plain.close()
    store = PosixSlotStore(tmp_path, config(), mac_key=MAC_KEY)
    with pytest.raises(MacMismatch):
        store.read(SlotId(2), key(2), dst)
    assert store.statistics().mac_failures == 1
    store.close()


def test_under_a_mac_unsigned_slots_are_reclaimed_and_a_wrong_key_fails(tmp_path: Path) -> None:
    written(tmp_path, {0: 0})
    written(tmp_path, {1: 1}, mac_key=MAC_KEY)
    (tmp_path / INDEX_FILE).unlink()  # the header scan is what looks at slot 0 again
    store = PosixSlotStore(tmp_path, config(), mac_key=MAC_KEY)
    assert [s.slot for s in store.recovery.slots] == [1]
    assert store.recovery.unauthenticated == 1
    dst = page_aligned_buffer(store.payload_len)
    store.read(SlotId(1), key(1), dst)
    assert torch.equal(dst, block(1))
    store.close()
    store = PosixSlotStore(tmp_path, config(), mac_key=b"another-key-16by")
    with pytest.raises(MacMismatch):
        store.read(SlotId(1), key(1), dst)
    store.close()
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path, config(), mac_key=b"short")
    assert info.value.field == "mac_key"


# --- the cache: reopen --------------------------------------------------------------------------

PROMPTS = [[100 * p + t for t in range(9)] for p in range(6)]


def spill_and_close(cfg: StateKVConfig, ttl: float | None = 3600.0) -> None:
    with BlockingCache(cfg) as cache:
        for i, prompt in enumerate(PROMPTS):
            serve(cache, f"r{i}", prompt, ttl_seconds=ttl)
            wait_quiet(cache)
        assert cache.statistics().cache.disk_cached_blocks > 0


def test_a_reopened_cache_serves_spilled_blocks_as_disk_hits(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16)
    spill_and_close(cfg)
    with BlockingCache(cfg) as cache:
        stats = cache.statistics()
        assert stats.recovery is not None
        restored = stats.cache.restored_blocks
        assert restored == stats.cache.disk_cached_blocks == len(stats.recovery.slots) > 0
        on_disk = {b.key: b for b in cache.cached_blocks() if b.state is BlockState.ON_DISK}
        assert all(b.expiry is not None for b in on_disk.values())  # the deadlines came back
        assert stats.cache.disk_retained_blocks == restored
        for i, prompt in enumerate(PROMPTS):
            serve(cache, f"again{i}", prompt)  # checks every matched page byte for byte
            wait_quiet(cache)
        after = cache.statistics().cache
        assert after.hit_blocks_disk >= restored
        assert after.onboard_failures == 0
        cache.check_invariants()


def test_persist_off_starts_empty(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16)
    spill_and_close(cfg)
    with BlockingCache(small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16,
                                    persist=False)) as cache:
        assert cache.statistics().cache.restored_blocks == 0
        assert cache.statistics().cache.disk_cached_blocks == 0


def test_another_model_fingerprint_reclaims_and_counts_everything(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16)
    spill_and_close(cfg)
    other = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16,
                         model_fingerprint="another model")
    with BlockingCache(other) as cache:
        stats = cache.statistics()
        assert stats.cache.restored_blocks == 0
        assert stats.recovery is not None and stats.recovery.foreign > 0


# --- bad input at the public boundary -----------------------------------------------------------


def test_an_empty_disk_dir_is_an_error_not_the_working_directory(tmp_path: Path) -> None:
    for bad in ("", " ", Path("")):
        with pytest.raises(ConfigError) as info:
            small_config(bad)
        assert info.value.field == "disk_dir"


def test_a_disk_smaller_than_one_block_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no slot") as info:
        small_config(tmp_path, disk="1 KiB")
    assert info.value.field == "disk"
    assert small_config(tmp_path, disk=0, reserved_host=0).core_config().disk_blocks == 0


def test_store_errors_name_the_public_fields(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        BlockingCache(small_config(tmp_path / "file"))
    assert info.value.field == "disk_dir"
    fs = os.statvfs(tmp_path)
    huge = 2 * (fs.f_bavail * fs.f_frsize // 8192) + 1000  # twice the free space
    with pytest.raises(ConfigError) as info:
        BlockingCache(small_config(tmp_path / "big", disk=huge))
    assert info.value.field == "disk"
    assert not (tmp_path / "big").exists()
    with BlockingCache(small_config(tmp_path / "held")):
        with pytest.raises(DirectoryInUse) as info:
            BlockingCache(small_config(tmp_path / "held"))
        assert info.value.field == "disk_dir"


@pytest.mark.parametrize(
    ("field", "value"),
    [("persist", "yes"), ("disk_sync", "always"), ("disk_mac_key", "text-not-bytes-16"),
     ("disk_mac_key", b"short")],
)
def test_persistence_options_are_validated(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        small_config(tmp_path, **{field: value})
    assert info.value.field == field


def test_the_mac_key_never_appears_in_the_config_repr(tmp_path: Path) -> None:
    assert MAC_KEY not in repr(small_config(tmp_path, disk_mac_key=MAC_KEY)).encode()


def test_under_another_mac_key_no_restored_block_is_served_and_failures_are_counted(
    tmp_path: Path,
) -> None:
    cfg = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16, disk_mac_key=MAC_KEY)
    spill_and_close(cfg)
    with BlockingCache(cfg) as cache:  # the right key: served
        assert cache.statistics().cache.restored_blocks > 0
        serve(cache, "ok", PROMPTS[-1])
        assert cache.statistics().cache.onboard_failures == 0
    other = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16,
                         disk_mac_key=b"another-key-16by")
    with BlockingCache(other) as cache:
        for i, prompt in enumerate(PROMPTS):
            status = cache.add_request(f"r{i}", prompt)
            wait_ready(cache, f"r{i}")
            # Every read failed its MAC: the request fell back, nothing it holds came from disk.
            assert cache.request_status(f"r{i}").num_computed_tokens <= (
                status.gpu_tokens + status.host_tokens)
            compute(cache, f"r{i}", prompt)
            cache.release(f"r{i}")
            wait_quiet(cache)
        stats = cache.statistics()
        assert stats.cache.hit_blocks_disk > 0
        assert stats.cache.onboards_completed == 0
        assert stats.store is not None
        assert stats.store.mac_failures == stats.cache.onboard_failures > 0


def test_reopening_a_sparse_file_with_preallocation_reserves_every_slot(tmp_path: Path) -> None:
    PosixSlotStore(tmp_path, config(), preallocate=False).close()
    sparse = os.stat(tmp_path / DATA_FILE)
    assert sparse.st_blocks * 512 < sparse.st_size
    PosixSlotStore(tmp_path, config()).close()
    full = os.stat(tmp_path / DATA_FILE)
    assert full.st_size == sparse.st_size and full.st_blocks * 512 >= full.st_size


def test_a_restored_deadline_never_lies_beyond_max_ttl_from_now(tmp_path: Path) -> None:
    """Slot headers that claim ten years (written under a larger maximum, or by anyone who
    can write the disk and holds the key) come back with at most max_ttl_seconds left."""
    import time

    cfg = small_config(tmp_path, disk_mac_key=MAC_KEY, max_ttl_seconds=86400.0)
    rank = cfg.rank_directory()
    assert rank is not None
    ten_years = time.time() + 10 * 365 * 86400.0
    store = PosixSlotStore(rank, cfg.core_config(), mac_key=MAC_KEY)
    for n in range(3):
        store.write(SlotId(n), key(n), block_for(cfg, n), meta(n, expiry=ten_years))
    store.close()
    before = time.time()
    with BlockingCache(cfg) as cache:
        expiries = [b.expiry for b in cache.cached_blocks()]
    assert len(expiries) == 3
    for expiry in expiries:
        assert expiry is not None and expiry <= time.time() + 86400.0
        assert expiry >= before + 86400.0 - 60  # still retained: cut, not dropped


def block_for(cfg: StateKVConfig, seed: int) -> torch.Tensor:
    out = page_aligned_buffer(cfg.block_bytes)
    out.copy_(torch.randint(0, 256, (out.numel(),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return out
