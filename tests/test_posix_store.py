"""PosixSlotStore: real files, real bytes, and every failure ending in TransferFailed."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from io_actors.storage import posix as posix_module
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.open_store import open_slot_store
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE, rank_dir
from io_actors.storage.slot_format import ALIGN, HEADER_SIZE
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

ALIGNED = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
"""8 tokens -> 2 layers x 2 x 8 x 2 heads x 64 x 2 bytes = 8192 bytes: two aligned pages."""
UNALIGNED = KVLayout(num_layers=1, num_kv_heads=1, head_dim=10, dtype="float32")
"""3 tokens -> 240 bytes: exercises the bounce buffer and the padding."""


def config(
    layout: KVLayout = ALIGNED, *, block_size: int = 8, disk_blocks: int = 16
) -> CacheConfig:
    return CacheConfig(
        block_size=block_size, gpu_blocks=2, host_blocks=2, disk_blocks=disk_blocks,
        layout=layout,
    )


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(4, "little") * 8)


def payload(nbytes: int, seed: int, *, aligned: bool = True) -> torch.Tensor:
    """Random bytes in a page-aligned tensor, or in one deliberately off by one byte."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if aligned:
        out = page_aligned_buffer(nbytes)
    else:
        out = page_aligned_buffer(nbytes + 1)[1:]
    out.copy_(data)
    return out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[PosixSlotStore]:
    s = PosixSlotStore(tmp_path / "cache", config())
    yield s
    s.close()


@pytest.fixture(scope="module")
def shared_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PosixSlotStore]]:
    base = tmp_path_factory.mktemp("shared")
    stores = {
        "aligned-direct": PosixSlotStore(base / "a", config()),
        "unaligned-direct": PosixSlotStore(base / "b", config(UNALIGNED, block_size=3)),
        "aligned-buffered": PosixSlotStore(base / "c", config(), direct_io=False),
        "unaligned-buffered": PosixSlotStore(
            base / "d", config(UNALIGNED, block_size=3), direct_io=False
        ),
    }
    yield stores
    for s in stores.values():
        s.close()


# --- round trips ------------------------------------------------------------------------------


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.sampled_from(
        ["aligned-direct", "unaligned-direct", "aligned-buffered", "unaligned-buffered"]
    ),
    slot=st.integers(0, 15),
    seed=st.integers(0, 2**32 - 1),
    src_aligned=st.booleans(),
    dst_aligned=st.booleans(),
)
def test_round_trip_is_byte_identical_for_random_payloads(
    shared_stores: dict[str, PosixSlotStore],
    which: str,
    slot: int,
    seed: int,
    src_aligned: bool,
    dst_aligned: bool,
) -> None:
    s = shared_stores[which]
    src = payload(s.payload_len, seed, aligned=src_aligned)
    s.write(SlotId(slot), key(seed), src)
    dst = payload(s.payload_len, seed + 1, aligned=dst_aligned)
    s.read(SlotId(slot), key(seed), dst)
    assert torch.equal(dst, src)


def test_direct_io_is_used_on_this_filesystem(store: PosixSlotStore) -> None:
    # ext4 and recent tmpfs accept O_DIRECT; the fallback has its own test below.
    assert store.direct_io


def test_aligned_transfers_skip_the_bounce_buffer(store: PosixSlotStore) -> None:
    src = payload(store.payload_len, 1)
    store.write(SlotId(0), key(1), src)
    store.read(SlotId(0), key(1), payload(store.payload_len, 2))
    assert store.statistics().bounced == 0
    store.read(SlotId(0), key(1), payload(store.payload_len, 2, aligned=False))
    assert store.statistics().bounced == 1


def test_content_survives_closing_and_reopening(tmp_path: Path) -> None:
    src = payload(config().block_bytes, 9)
    first = PosixSlotStore(tmp_path, config())
    first.write(SlotId(11), key(9), src)
    first.close()
    second = PosixSlotStore(tmp_path, config())
    dst = payload(config().block_bytes, 0)
    second.read(SlotId(11), key(9), dst)
    second.close()
    assert torch.equal(dst, src)


def test_rewriting_a_slot_replaces_its_content(store: PosixSlotStore) -> None:
    store.write(SlotId(2), key(1), payload(store.payload_len, 1))
    newer = payload(store.payload_len, 2)
    store.write(SlotId(2), key(2), newer)
    dst = payload(store.payload_len, 0)
    store.read(SlotId(2), key(2), dst)
    assert torch.equal(dst, newer)
    with pytest.raises(TransferFailed, match="key mismatch"):
        store.read(SlotId(2), key(1), dst)


def test_discard_keeps_bytes_servable_only_under_their_own_key(store: PosixSlotStore) -> None:
    src = payload(store.payload_len, 4)
    store.write(SlotId(4), key(4), src)
    store.discard(SlotId(4))
    dst = payload(store.payload_len, 0)
    store.read(SlotId(4), key(4), dst)
    assert torch.equal(dst, src)
    with pytest.raises(TransferFailed):
        store.read(SlotId(4), key(5), dst)


# --- corrupt or missing slots -----------------------------------------------------------------


def test_read_with_the_wrong_key_raises(store: PosixSlotStore) -> None:
    store.write(SlotId(1), key(1), payload(store.payload_len, 1))
    with pytest.raises(TransferFailed, match="key mismatch") as info:
        store.read(SlotId(1), key(2), payload(store.payload_len, 0))
    assert info.value.what == "slot 1"


def test_read_of_a_never_written_slot_raises(store: PosixSlotStore) -> None:
    with pytest.raises(TransferFailed, match="never written"):
        store.read(SlotId(7), key(1), payload(store.payload_len, 0))


@pytest.mark.parametrize("where", [0, 100, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 8191])
def test_bit_flip_on_disk_is_caught_at_read(store: PosixSlotStore, where: int) -> None:
    assert store.payload_len == 8192
    store.write(SlotId(3), key(3), payload(store.payload_len, 3))
    extent = store.slot_extent(SlotId(3))
    with open(extent.path, "r+b") as f:
        f.seek(extent.offset + where)
        byte = f.read(1)[0]
        f.seek(extent.offset + where)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(TransferFailed):
        store.read(SlotId(3), key(3), payload(store.payload_len, 0))
    assert store.statistics().read_failures == 1


def test_truncated_data_file_gives_a_short_read(store: PosixSlotStore) -> None:
    last = SlotId(15)
    store.write(last, key(15), payload(store.payload_len, 15))
    extent = store.slot_extent(last)
    os.truncate(extent.path, extent.offset + HEADER_SIZE + ALIGN)
    with pytest.raises(TransferFailed, match="short read"):
        store.read(last, key(15), payload(store.payload_len, 0))


def test_short_read_reported_by_the_kernel_raises(
    store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write(SlotId(0), key(0), payload(store.payload_len, 0))
    real = os.preadv

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, buffers, offset) - ALIGN

    monkeypatch.setattr(os, "preadv", short)
    with pytest.raises(TransferFailed, match="short read"):
        store.read(SlotId(0), key(0), payload(store.payload_len, 1))


def test_short_write_raises(store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: ALIGN)
    with pytest.raises(TransferFailed, match="short write") as info:
        store.write(SlotId(0), key(0), payload(store.payload_len, 0))
    assert info.value.what == "slot 0"
    assert store.statistics().write_failures == 1


@pytest.mark.parametrize(
    ("op", "code"), [("write", errno.ENOSPC), ("write", errno.EIO), ("read", errno.EIO)]
)
def test_os_errors_become_transfer_failed_with_slot_and_cause(
    store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch, op: str, code: int
) -> None:
    store.write(SlotId(6), key(6), payload(store.payload_len, 6))

    def fail(*_args: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev" if op == "write" else "preadv", fail)
    with pytest.raises(TransferFailed) as info:
        if op == "write":
            store.write(SlotId(6), key(6), payload(store.payload_len, 6))
        else:
            store.read(SlotId(6), key(6), payload(store.payload_len, 0))
    assert info.value.what == "slot 6"
    assert os.strerror(code) in info.value.cause


# --- directory, files, permissions ------------------------------------------------------------


def test_missing_directories_are_created_0700_and_the_data_file_0600(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    s = PosixSlotStore(target, config())
    s.close()
    for directory in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((target / DATA_FILE).stat().st_mode) == 0o600


def test_created_modes_do_not_depend_on_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)
    try:
        s = PosixSlotStore(tmp_path / "d", config())
    finally:
        os.umask(old)
    s.close()
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "d" / DATA_FILE).stat().st_mode) == 0o600


def test_a_path_that_is_a_file_is_a_config_error_naming_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    for bad in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(ConfigError) as info:
            PosixSlotStore(bad, config())
        assert info.value.field == "directory"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_an_unwritable_directory_is_a_config_error_naming_directory() -> None:
    # /proc is a directory in which no one, root included, can create a file.
    with pytest.raises(ConfigError) as info:
        PosixSlotStore("/proc", config())
    assert info.value.field == "directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_a_read_only_directory_is_a_config_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError) as info:
            PosixSlotStore(tmp_path, config())
    finally:
        tmp_path.chmod(0o700)
    assert info.value.field == "directory"


@pytest.mark.parametrize("bad", [42, None, ""])
def test_a_non_path_directory_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(bad, config())  # type: ignore[arg-type]
    assert info.value.field == "directory"


def test_a_data_file_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / DATA_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path, config())
    assert info.value.field == "directory"


def test_two_stores_cannot_share_a_directory(store: PosixSlotStore) -> None:
    with pytest.raises(ConfigError, match="in use") as info:
        PosixSlotStore(store.path.parent, config())
    assert info.value.field == "directory"


def test_the_data_file_reserves_every_slot_up_front(store: PosixSlotStore) -> None:
    info = os.stat(store.path)
    assert info.st_size == 16 * store.slot_bytes
    assert info.st_blocks * 512 >= info.st_size


def test_zero_disk_blocks_is_a_config_error(tmp_path: Path) -> None:
    cfg = CacheConfig(block_size=8, gpu_blocks=1, layout=ALIGNED)
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path, cfg)
    assert info.value.field == "disk_blocks"


@pytest.mark.parametrize("field", ["direct_io", "preallocate", "sync_writes"])
def test_non_bool_flags_are_config_errors(tmp_path: Path, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        PosixSlotStore(tmp_path, config(), **{field: 1})  # type: ignore[arg-type]
    assert info.value.field == field


def test_falls_back_to_buffered_io_when_the_filesystem_refuses_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = fcntl.fcntl

    def refuse_direct(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        result: int = real(fd, cmd, arg)
        return result

    monkeypatch.setattr(fcntl, "fcntl", refuse_direct)
    with caplog.at_level(logging.WARNING, logger=posix_module.__name__):
        s = PosixSlotStore(tmp_path, config(), sync_writes=True)
    assert not s.direct_io
    assert "refuses O_DIRECT" in caplog.text
    src = payload(s.payload_len, 5, aligned=False)
    s.write(SlotId(1), key(5), src)
    dst = payload(s.payload_len, 0, aligned=False)
    s.read(SlotId(1), key(5), dst)
    s.close()
    assert torch.equal(dst, src)


def test_a_sparse_store_works_without_preallocation(tmp_path: Path) -> None:
    s = PosixSlotStore(tmp_path, config(), preallocate=False)
    src = payload(s.payload_len, 8)
    s.write(SlotId(9), key(8), src)
    dst = payload(s.payload_len, 0)
    s.read(SlotId(9), key(8), dst)
    s.close()
    assert torch.equal(dst, src)


# --- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slot", "k", "tensor", "field"),
    [
        (16, key(0), "ok", "slot"),
        (-1, key(0), "ok", "slot"),
        (True, key(0), "ok", "slot"),
        (0, b"short", "ok", "key"),
        (0, key(0), torch.zeros(8192, dtype=torch.int16), "TENSOR"),
        (0, key(0), torch.zeros(100, dtype=torch.uint8), "TENSOR"),
        (0, key(0), torch.zeros(2, 4096, dtype=torch.uint8), "TENSOR"),
        (0, key(0), torch.zeros(16384, dtype=torch.uint8)[::2], "TENSOR"),
        (0, key(0), "not a tensor", "TENSOR"),
    ],
)
@pytest.mark.parametrize("op", ["read", "write"])
def test_bad_arguments_raise_usage_error_naming_the_field(
    store: PosixSlotStore, slot: object, k: object, tensor: object, field: str, op: str
) -> None:
    if isinstance(tensor, str) and tensor == "ok":
        tensor = payload(store.payload_len, 0)
    with pytest.raises(UsageError) as info:
        getattr(store, op)(slot, k, tensor)
    assert info.value.field == (("src" if op == "write" else "dst") if field == "TENSOR" else field)


def test_discard_of_an_out_of_range_slot_raises(store: PosixSlotStore) -> None:
    with pytest.raises(UsageError) as info:
        store.discard(SlotId(99))
    assert info.value.field == "slot"


def test_a_closed_store_refuses_transfers_and_closes_once(store: PosixSlotStore) -> None:
    store.close()
    store.close()
    with pytest.raises(UsageError):
        store.write(SlotId(0), key(0), payload(store.payload_len, 0))


# --- concurrency ------------------------------------------------------------------------------


def test_concurrent_writers_and_readers_on_different_slots(tmp_path: Path) -> None:
    s = PosixSlotStore(tmp_path, config(disk_blocks=32))
    failures: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            for round_ in range(20):
                for slot in range(first, 32, 8):
                    seed = slot * 1000 + round_
                    src = payload(s.payload_len, seed, aligned=bool(round_ % 2))
                    s.write(SlotId(slot), key(seed), src)
                    dst = payload(s.payload_len, 0, aligned=bool(slot % 2))
                    s.read(SlotId(slot), key(seed), dst)
                    assert torch.equal(dst, src), f"slot {slot} round {round_}"
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = s.statistics()
    s.close()
    assert not failures, failures[0]
    assert stats.writes == stats.reads == 8 * 20 * 4


def test_close_waits_for_transfers_in_flight(
    store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = threading.Event()
    release = threading.Event()
    real = os.pwritev

    def slow(fd: int, buffers: list[memoryview], offset: int) -> int:
        entered.set()
        release.wait(5)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    writer = threading.Thread(
        target=store.write, args=(SlotId(0), key(0), payload(store.payload_len, 0))
    )
    writer.start()
    assert entered.wait(5)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while a write was in flight"
    release.set()
    writer.join(5)
    closer.join(5)
    assert not closer.is_alive()
    assert store.statistics().writes == 1


# --- selection and naming ---------------------------------------------------------------------


def test_rank_dirs_separate_ranks_and_namespaces(tmp_path: Path) -> None:
    assert rank_dir(tmp_path, 3) == tmp_path / "target" / "rank_3"
    assert rank_dir(tmp_path, 3, "draft") == tmp_path / "draft" / "rank_3"
    target = PosixSlotStore(rank_dir(tmp_path, 0), config())
    draft = PosixSlotStore(rank_dir(tmp_path, 0, "draft"), config())
    assert target.path != draft.path
    target.close()
    draft.close()


@pytest.mark.parametrize(
    ("rank", "namespace", "field"),
    [(-1, "target", "rank"), (True, "target", "rank"), ("0", "target", "rank"),
     (0, "", "namespace"), (0, "..", "namespace"), (0, "a/b", "namespace")],
)
def test_bad_rank_dir_arguments_name_the_field(
    tmp_path: Path, rank: object, namespace: str, field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        rank_dir(tmp_path, rank, namespace)  # type: ignore[arg-type]
    assert info.value.field == field


def test_open_slot_store_selects_posix(tmp_path: Path) -> None:
    s = open_slot_store("posix", tmp_path, config())
    assert isinstance(s, PosixSlotStore)
    assert not s.device_reads
    s.close()


def test_open_slot_store_refuses_an_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        open_slot_store("nfs", tmp_path, config())
    assert info.value.field == "kind"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_open_slot_store_refuses_kvikio_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA") as info:
        open_slot_store("kvikio", tmp_path, config())
    assert info.value.field == "kind"
