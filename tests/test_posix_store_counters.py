"""The POSIX store's counters, file modes and refusals, exactly (mutation testing showed them
unchecked: statistics() fields, the bounce count, the data file's mode, the slot named in a
short read, the field named in each refusal)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from io_actors.storage.buffers import check_block_tensor
from io_actors.storage.posix import PosixSlotStore, SlotStoreStatistics
from io_actors.storage.posix_open import DATA_FILE, rank_dir
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import SlotId
from tests.test_posix_store import ALIGNED, UNALIGNED, config, key, payload


def test_statistics_count_every_transfer_and_its_bytes(tmp_path: Path) -> None:
    cfg = config()
    store = PosixSlotStore(tmp_path / "s", cfg, direct_io=False)
    try:
        nbytes = cfg.block_bytes
        for slot in range(3):
            store.write(SlotId(slot), key(slot), payload(nbytes, slot))
        out = payload(nbytes, 99)
        store.read(SlotId(1), key(1), out)
        with pytest.raises(TransferFailed):
            store.read(SlotId(2), key(5), out)
        assert store.statistics() == SlotStoreStatistics(
            writes=3, reads=1, write_failures=0, read_failures=1, bytes_written=3 * nbytes,
            bytes_read=nbytes, bounced=0, direct_io=False)
    finally:
        store.close()


def test_every_unaligned_transfer_is_bounced_once(tmp_path: Path) -> None:
    cfg = config(UNALIGNED, block_size=3)
    store = PosixSlotStore(tmp_path / "s", cfg)
    try:
        if not store.direct_io:
            pytest.skip("O_DIRECT refused by this file system: nothing to bounce")
        src = payload(cfg.block_bytes, 1, aligned=False)
        store.write(SlotId(0), key(0), src)
        dst = payload(cfg.block_bytes, 2, aligned=False)
        store.read(SlotId(0), key(0), dst)
        assert torch.equal(dst, src)
        stats = store.statistics()
        assert (stats.bounced, stats.direct_io) == (2, True)
    finally:
        store.close()


def test_the_data_file_is_private(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path / "s", config(ALIGNED))
    try:
        mode = stat.S_IMODE(os.stat(tmp_path / "s" / DATA_FILE).st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    finally:
        store.close()


def test_a_short_slot_file_names_the_slot(tmp_path: Path) -> None:
    cfg = config()
    store = PosixSlotStore(tmp_path / "s", cfg, direct_io=False, preallocate=False)
    try:
        store.write(SlotId(0), key(0), payload(cfg.block_bytes, 0))
        os.truncate(tmp_path / "s" / DATA_FILE, 4096 + 10)
        with pytest.raises(TransferFailed) as info:
            store.read(SlotId(0), key(0), payload(cfg.block_bytes, 1))
        assert info.value.what == "slot 0"
        assert info.value.cause == f"short read: {4096 + 10} of {store.slot_bytes} bytes"
    finally:
        store.close()


@pytest.mark.parametrize(("args", "field", "message"), [
    ((-1, "target"), "rank", "must be an integer >= 0, got -1"),
    ((True, "target"), "rank", "must be an integer >= 0, got True"),
    ((0, "."), "namespace", "must be a plain directory name, got '.'"),
    ((0, ".."), "namespace", "must be a plain directory name, got '..'"),
    ((0, "a\x00b"), "namespace", "must be a plain directory name, got 'a\\x00b'"),
    ((0, "a/b"), "namespace", "must be a plain directory name, got 'a/b'"),
    ((0, ""), "namespace", "must be a plain directory name, got ''"),
])
def test_rank_dir_refuses_what_is_not_a_plain_name(
        tmp_path: Path, args: tuple[object, object], field: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        rank_dir(tmp_path, *args)  # type: ignore[arg-type]
    assert str(info.value) == f"{field}: {message}"


def test_rank_dir_accepts_names_with_dots() -> None:
    assert rank_dir("/x", 3, "a.b") == Path("/x/a.b/rank_3")
    assert rank_dir("/x", 0, "...") == Path("/x/.../rank_0")


@pytest.mark.parametrize(("tensor", "message"), [
    (b"bytes", "must be a torch.Tensor, got bytes"),
    (torch.zeros(8, dtype=torch.uint8, device="meta"), "must be on cpu, got meta"),
    (torch.zeros(8, dtype=torch.int8), "must be a contiguous 1-D uint8 tensor, got "
                                        "torch.int8 (8,)"),
    (torch.zeros(4, dtype=torch.uint8), "must hold one block of 8 bytes, got 4"),
])
def test_a_bad_block_tensor_is_named_with_what_is_wrong(tensor: object, message: str) -> None:
    with pytest.raises(UsageError) as info:
        check_block_tensor("src", tensor, 8, device_type="cpu")
    assert str(info.value) == f"src: {message}"


def test_a_store_refuses_a_config_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path / "s", "config")  # type: ignore[arg-type]
    assert str(info.value) == "config: must be a CacheConfig, got 'config'"


def test_read_header_returns_what_the_write_put_there(tmp_path: Path) -> None:
    """The header alone (what an index rebuild reads, and the kvikio store before its device
    read): the slot's own header, self-checked; an unwritten slot has none."""
    cfg = config()
    store = PosixSlotStore(tmp_path / "s", cfg, direct_io=False)
    try:
        store.write(SlotId(3), key(3), payload(cfg.block_bytes, 3))
        header = store.read_header(SlotId(3))
        assert (header.slot, header.key, header.payload_len) == (3, key(3), cfg.block_bytes)
        with pytest.raises(TransferFailed) as info:
            store.read_header(SlotId(4))
        assert info.value.what == "slot 4"
        assert info.value.cause.startswith("no slot header")
        with pytest.raises(UsageError, match="slot: slot 16 out of range"):
            store.read_header(SlotId(16))
    finally:
        store.close()
    with pytest.raises(UsageError, match="is closed"):
        store.read_header(SlotId(3))
