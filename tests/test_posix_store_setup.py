"""PosixSlotStore: opening a directory and its data file when something is off, the header
scan's counts, and counters over more than one transfer -- cases that mutants of the store
showed no other test pinned (fuzz/README.md, "Mutation testing")."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from io_actors.storage import ownership, posix_open
from io_actors.storage import posix as posix_module
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.index_journal import INDEX_FILE
from io_actors.storage.interfaces import SlotIO
from io_actors.storage.ownership import prepare_directory
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE
from io_actors.storage.slot_format import CONFIG_FINGERPRINT_SIZE, HEADER_SIZE, SlotMeta, pack_slot
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32")
UNALIGNED = KVLayout(num_layers=1, num_kv_heads=1, head_dim=10, dtype="float32")


def config(disk_blocks: int = 8, layout: KVLayout = LAYOUT, block_size: int = 4) -> CacheConfig:
    return CacheConfig(block_size=block_size, gpu_blocks=2, host_blocks=2,
                       disk_blocks=disk_blocks, layout=layout)


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(4, "little") * 8)


def meta(n: int) -> SlotMeta:
    return SlotMeta(parent=bytes(32), depth=n % 3, reuse_count=n, expiry=None,
                    written_at=1000.0 + n, sequence=n)


def block(nbytes: int, seed: int, *, aligned: bool = True) -> torch.Tensor:
    out = page_aligned_buffer(nbytes) if aligned else page_aligned_buffer(nbytes + 1)[1:]
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return out


def test_a_dangling_symbolic_link_is_a_config_error_naming_directory(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError) as info:
        prepare_directory(tmp_path / "link" / "store")
    assert info.value.field == "directory"
    assert str(info.value) == f"directory: {tmp_path / 'link'} is a dangling symbolic link"


def test_a_failed_mkdir_removes_the_components_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = os.mkdir

    def refuse_deepest(path: object, mode: int = 0o777) -> None:
        if Path(str(path)).name == "c":
            raise PermissionError(errno.EACCES, "Permission denied")
        real(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", refuse_deepest)
    with pytest.raises(ConfigError, match="cannot create") as info:
        prepare_directory(tmp_path / "a" / "b" / "c")
    assert info.value.field == "directory"
    assert os.listdir(tmp_path) == []
    # The same when the chmod after a mkdir fails.
    monkeypatch.setattr(os, "mkdir", real)
    real_chmod = os.chmod

    def refuse_chmod(path: object, mode: int) -> None:
        if Path(str(path)).name == "c":
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real_chmod(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "chmod", refuse_chmod)
    with pytest.raises(ConfigError, match="cannot use") as info:
        prepare_directory(tmp_path / "a" / "b" / "c")
    assert info.value.field == "directory"
    assert os.listdir(tmp_path) == []


def test_a_data_file_that_cannot_be_inspected_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = os.lstat

    def refuse(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).endswith(DATA_FILE):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", refuse)
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path, config())
    assert info.value.field == "directory"
    assert str(info.value) == (f"directory: cannot inspect {tmp_path / DATA_FILE}: "
                               "[Errno 13] Permission denied")


def test_leftovers_and_wiping_are_logged_and_cleaned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    store = PosixSlotStore(tmp_path, config())
    store.write(SlotId(0), key(1), block(store.payload_len, 1), meta(1))
    store.close()
    # A half-created file next to an existing data file: removed once the open succeeded.
    (tmp_path / (DATA_FILE + ".new")).write_bytes(b"x" * 100)
    with caplog.at_level(logging.WARNING, logger=posix_open.__name__):
        PosixSlotStore(tmp_path, config()).close()
    assert not (tmp_path / (DATA_FILE + ".new")).exists()
    caplog.clear()
    (tmp_path / (DATA_FILE + ".new")).write_bytes(b"x" * 100)
    with caplog.at_level(logging.WARNING, logger=posix_open.__name__):
        wiped = PosixSlotStore(tmp_path, config(), persist=False)
    assert wiped.recovery.slots == ()
    wiped.close()
    assert not (tmp_path / (DATA_FILE + ".new")).exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: removing a half-created data file",
        f"{tmp_path / DATA_FILE}: persist is off, existing slots are wiped",
    ]


def test_a_failed_resize_restores_the_file_and_names_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    PosixSlotStore(tmp_path, config(disk_blocks=4)).close()
    size = (tmp_path / DATA_FILE).stat().st_size
    for code, field in ((errno.ENOSPC, "disk_blocks"), (errno.EIO, "directory")):
        def refuse(fd: int, offset: int, length: int, code: int = code) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "posix_fallocate", refuse)
        with pytest.raises(ConfigError) as info:
            PosixSlotStore(tmp_path, config(disk_blocks=16))
        assert info.value.field == field, info.value
        assert (tmp_path / DATA_FILE).stat().st_size == size
    assert str(info.value) == (f"directory: cannot resize {tmp_path / DATA_FILE}: "
                               "[Errno 5] Input/output error")


def test_o_direct_missing_on_the_platform_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(posix_module, "_O_DIRECT", 0)
    with caplog.at_level(logging.WARNING, logger=posix_module.__name__):
        store = PosixSlotStore(tmp_path, config())
    assert not store.direct_io
    store.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / DATA_FILE}: O_DIRECT is not available on this platform"]


def test_the_header_scan_counts_each_corrupt_slot_and_restores_the_rest(
    tmp_path: Path,
) -> None:
    # 16 slots: the scan's threads take two each, so a range holds two damaged slots, or a
    # damaged slot followed by a good one.
    store = PosixSlotStore(tmp_path, config(disk_blocks=16))
    for slot in range(10):
        store.write(SlotId(slot), key(slot), block(store.payload_len, slot), meta(slot))
    slot_bytes = store.slot_bytes
    store.close()
    # Damage the magic of slots 4, 6 and 7 and the middle of the headers of slots 2, 3 and
    # 8; drop the index journal: the next open scans every header.
    with open(tmp_path / DATA_FILE, "r+b") as f:
        for slot, offset in ((2, HEADER_SIZE // 2), (3, HEADER_SIZE // 2), (4, 0), (6, 0),
                             (7, 0), (8, HEADER_SIZE // 2)):
            f.seek(slot * slot_bytes + offset)
            f.write(b"\xff" * 8)
    (tmp_path / INDEX_FILE).unlink()
    reopened = PosixSlotStore(tmp_path, config(disk_blocks=16))
    rec = reopened.recovery
    assert sorted(e.slot for e in rec.slots) == [0, 1, 5, 9]
    assert (rec.foreign, rec.corrupt, rec.unauthenticated, rec.duplicates,
            rec.beyond_capacity) == (0, 6, 0, 0, 0)
    reopened.close()


def test_unaligned_batches_keep_their_restore_metadata_and_count_every_bounce(
    tmp_path: Path,
) -> None:
    cfg = config(layout=UNALIGNED, block_size=3)
    store = PosixSlotStore(tmp_path, cfg)
    if not store.direct_io:
        store.close()
        pytest.skip("O_DIRECT refused by this file system: nothing to bounce")
    n = store.payload_len
    data = [block(n, seed, aligned=False) for seed in range(3)]
    assert store.write_many([SlotIO(SlotId(i), key(i), data[i], None, meta(i))
                             for i in range(3)]) == [None, None, None]
    bounced = store.statistics().bounced
    store.write(SlotId(3), key(3), block(n, 3, aligned=False), meta(3))
    store.write(SlotId(4), key(4), block(n, 4, aligned=False), meta(4))
    assert store.statistics().bounced == bounced + 2
    # Two failed reads in one batch: both counted.
    out = store.read_many([SlotIO(SlotId(i), key(9), block(n, 0)) for i in range(2)])
    assert all(isinstance(error, TransferFailed) for error in out)
    assert store.statistics().read_failures == 2
    with pytest.raises(UsageError) as info:
        store.write(SlotId(5), key(5), data[0], "meta")  # type: ignore[arg-type]
    assert str(info.value) == "meta: must be a SlotMeta or None, got 'meta'"
    store.close()
    (tmp_path / INDEX_FILE).unlink()
    reopened = PosixSlotStore(tmp_path, cfg)
    assert {e.slot: e.meta for e in reopened.recovery.slots} == {i: meta(i) for i in range(5)}
    reopened.close()


def test_a_partial_vector_read_resumes_and_a_short_one_names_each_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = PosixSlotStore(tmp_path, config())
    n = store.payload_len
    data = [block(n, seed) for seed in range(3)]
    assert store.write_many([SlotIO(SlotId(i), key(i), data[i]) for i in range(3)]) == [
        None, None, None]
    real = os.preadv
    offsets: list[int] = []

    def partial(fd: int, buffers: list[memoryview], offset: int) -> int:
        # The kernel may move fewer bytes than asked: here one slot, on the first call.
        offsets.append(offset)
        moved = real(fd, buffers, offset)
        return min(moved, store.slot_bytes) if len(offsets) == 1 else moved

    monkeypatch.setattr(os, "preadv", partial)
    back = [page_aligned_buffer(n) for _ in range(3)]
    assert store.read_many([SlotIO(SlotId(i), key(i), back[i]) for i in range(3)]) == [
        None, None, None]
    assert all(torch.equal(b, d) for b, d in zip(back, data, strict=True))
    assert offsets[:2] == [0, store.slot_bytes]  # resumed at the first slot not moved
    # A call that moves less than a slot fails every slot it did not move, each by name.
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 100)
    out = store.read_many([SlotIO(SlotId(i), key(i), back[i]) for i in range(3)])
    assert [(e.what, str(e)) if isinstance(e, TransferFailed) else e for e in out] == [
        (f"slot {i}", f"slot {i}: short read: 100 of {store.slot_bytes} bytes")
        for i in range(3)]
    store.close()


def test_the_header_scan_counts_a_failed_or_short_header_read_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header the scan cannot read (EIO) or reads short is counted as corrupt, and the
    scan goes on to the next slot of its range."""
    store = PosixSlotStore(tmp_path, config(disk_blocks=16))
    for slot in range(10):
        store.write(SlotId(slot), key(slot), block(store.payload_len, slot), meta(slot))
    slot_bytes = store.slot_bytes
    store.close()
    (tmp_path / INDEX_FILE).unlink()
    real = os.preadv

    def flaky(fd: int, buffers: list[memoryview], offset: int) -> int:
        if threading.current_thread().name.startswith("statekv-scan"):
            # Two of each in one scan thread's range (16 slots: two a thread).
            if offset in (2 * slot_bytes, 3 * slot_bytes):
                raise OSError(errno.EIO, "injected")
            if offset in (8 * slot_bytes, 9 * slot_bytes):
                return real(fd, buffers, offset) - 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    reopened = PosixSlotStore(tmp_path, config(disk_blocks=16))
    monkeypatch.undo()
    rec = reopened.recovery
    assert sorted(e.slot for e in rec.slots) == [0, 1, 4, 5, 6, 7]
    assert (rec.foreign, rec.corrupt) == (0, 4)
    reopened.close()


def _slot_1_of_another_configuration(tmp_path: Path) -> torch.Tensor:
    """A closed store whose slot 0 holds a block of this configuration (returned) and slot
    1 one with the right key and length and an intact checksum, written under another
    configuration fingerprint (another model, layout or block size)."""
    store = PosixSlotStore(tmp_path, config())
    n = store.payload_len
    good = block(n, 0)
    store.write(SlotId(0), key(0), good, meta(0))
    slot_bytes = store.slot_bytes
    store.close()
    image = pack_slot(slot=SlotId(1), key=key(1), payload=block(n, 1).numpy().tobytes(),
                      config=b"\x01" * CONFIG_FINGERPRINT_SIZE, meta=meta(1))
    with open(tmp_path / DATA_FILE, "r+b") as f:
        f.seek(slot_bytes)
        f.write(image)
    return good


@pytest.mark.parametrize("batched", [False, True])
def test_a_slot_written_under_another_configuration_is_refused_by_name(
    tmp_path: Path, batched: bool
) -> None:
    """Right key, right length, intact checksum, but another configuration fingerprint:
    never served, on either read path."""
    _slot_1_of_another_configuration(tmp_path)
    reopened = PosixSlotStore(tmp_path, config())
    dst = page_aligned_buffer(reopened.payload_len)
    expected = "slot 1: written under another configuration fingerprint"
    if batched:
        out = reopened.read_many([SlotIO(SlotId(1), key(1), dst, None, None)])
        assert isinstance(out[0], TransferFailed) and str(out[0]) == expected
    else:
        with pytest.raises(TransferFailed) as caught:
            reopened.read(SlotId(1), key(1), dst)
        assert str(caught.value) == expected
    reopened.close()


def test_a_directory_others_can_read_is_named_in_the_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="io_actors.storage.ownership"):
        ownership.check_private(directory, directory.stat())
    assert caplog.messages == [f"{directory} has mode 755: other users can read cached KV"]


def test_a_header_that_names_another_slot_is_corrupt(tmp_path: Path) -> None:
    """A header copied into the wrong slot (two of them, in one scan thread's range) is
    counted once each, and neither slot is restored."""
    store = PosixSlotStore(tmp_path, config(disk_blocks=16))
    for slot in range(6):
        store.write(SlotId(slot), key(slot), block(store.payload_len, slot), meta(slot))
    slot_bytes = store.slot_bytes
    store.close()
    with open(tmp_path / DATA_FILE, "r+b") as f:
        image = f.read(slot_bytes)  # slot 0's header and payload
        for slot in (6, 7):
            f.seek(slot * slot_bytes)
            f.write(image)
    (tmp_path / INDEX_FILE).unlink()
    reopened = PosixSlotStore(tmp_path, config(disk_blocks=16))
    rec = reopened.recovery
    assert sorted(e.slot for e in rec.slots) == [0, 1, 2, 3, 4, 5]
    assert (rec.foreign, rec.corrupt, rec.duplicates) == (0, 2, 0)
    reopened.close()


def test_a_batch_refuses_the_slot_of_another_configuration_and_serves_its_neighbour(
    tmp_path: Path,
) -> None:
    """Two consecutive slots read as one vectored run (buffered I/O: any payload size goes
    to the kernel as it is): the one written under another configuration fingerprint fails
    by name, the other lands."""
    good = _slot_1_of_another_configuration(tmp_path)
    reopened = PosixSlotStore(tmp_path, config(), direct_io=False)
    n = reopened.payload_len
    dst = [page_aligned_buffer(n), page_aligned_buffer(n)]
    out = reopened.read_many([SlotIO(SlotId(0), key(0), dst[0], None, None),
                              SlotIO(SlotId(1), key(1), dst[1], None, None)])
    assert out[0] is None and torch.equal(dst[0], good)
    assert isinstance(out[1], TransferFailed)
    assert str(out[1]) == "slot 1: written under another configuration fingerprint"
    reopened.close()
