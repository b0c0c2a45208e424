"""Batched slot transfers: write_many / read_many on the POSIX store, and the GPU checksum.

A batch moves with one vector call per run of consecutive slots; what these tests pin down is
what a caller can see: every slot round-trips byte for byte whatever the run structure, each
item's failure is its own (the others land), and nothing moves when the batch is malformed.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest
import torch

from io_actors.memory.host_checksums import HostChecksums
from io_actors.memory.pools import KVPools, TorchCopyEngine
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.gpu_checksum import have_kernel
from io_actors.storage.interfaces import SlotIO
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.slot_format import HEADER_SIZE
from statekv.config import CacheConfig
from statekv.errors import TransferFailed, UsageError
from statekv.ids import PageId, SlotId
from tests.test_posix_store import UNALIGNED, config, key, payload


@pytest.fixture
def store(tmp_path: Path) -> Iterator[PosixSlotStore]:
    s = PosixSlotStore(tmp_path / "slots", config(disk_blocks=32))
    yield s
    s.close()


def batch(store: PosixSlotStore, slots: list[int], seed: int = 0) -> list[SlotIO]:
    return [SlotIO(SlotId(s), key(s), payload(store.payload_len, seed + s)) for s in slots]


def empty_like(items: list[SlotIO]) -> list[SlotIO]:
    return [SlotIO(i.slot, i.key, page_aligned_buffer(i.buffer.numel())) for i in items]


@pytest.mark.parametrize("slots", [
    [3], [0, 1, 2, 3], [7, 2, 3, 4, 9], [31, 0], list(range(32)),
], ids=["one", "run", "runs-out-of-order", "ends", "all"])
def test_a_batch_round_trips_byte_for_byte(store: PosixSlotStore, slots: list[int]) -> None:
    items = batch(store, slots)
    assert store.write_many(items) == [None] * len(items)
    back = empty_like(items)
    assert store.read_many(back) == [None] * len(items)
    for wrote, read in zip(items, back, strict=True):
        assert torch.equal(wrote.buffer, read.buffer)
    stats = store.statistics()
    assert (stats.writes, stats.reads, stats.bounced) == (len(slots), len(slots), 0)


def test_a_run_of_consecutive_slots_is_one_vector_call(
    store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = os.pwritev

    def counting(fd: int, iov: object, offset: int) -> int:
        calls.append(offset)
        return real(fd, iov, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwritev", counting)
    assert store.write_many(batch(store, [5, 6, 7, 8, 20, 21])) == [None] * 6
    assert calls == [5 * store.slot_bytes, 20 * store.slot_bytes]


def test_one_bad_slot_fails_alone_and_the_rest_land(store: PosixSlotStore) -> None:
    items = batch(store, [0, 1, 2, 3])
    assert store.write_many(items) == [None] * 4
    # Rot the payload of slot 2 on disk.
    with open(store.path, "r+b") as f:
        f.seek(2 * store.slot_bytes + HEADER_SIZE + 10)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0x40]))
    back = empty_like(items)
    out = store.read_many(back)
    assert [o is None for o in out] == [True, True, False, True]
    assert isinstance(out[2], TransferFailed) and "checksum" in str(out[2])
    for n in (0, 1, 3):
        assert torch.equal(items[n].buffer, back[n].buffer)
    assert store.statistics().read_failures == 1


def test_a_wrong_key_fails_only_its_item(store: PosixSlotStore) -> None:
    items = batch(store, [4, 5])
    store.write_many(items)
    back = [SlotIO(items[0].slot, key(99), page_aligned_buffer(store.payload_len)),
            SlotIO(items[1].slot, items[1].key, page_aligned_buffer(store.payload_len))]
    out = store.read_many(back)
    assert isinstance(out[0], TransferFailed) and "key mismatch" in str(out[0])
    assert out[1] is None and torch.equal(back[1].buffer, items[1].buffer)


def test_a_short_vector_write_resumes_and_then_fails_what_did_not_land(
    store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwritev
    budget = [store.slot_bytes + 4096, 0]  # 1 slot and a page, then nothing more

    def short(fd: int, iov: list[memoryview], offset: int) -> int:
        allowed = budget.pop(0)
        if allowed == 0:
            return 0
        total = 0
        kept: list[memoryview] = []
        for part in iov:
            if total + part.nbytes > allowed:
                kept.append(part[: allowed - total])
                break
            kept.append(part)
            total += part.nbytes
        return real(fd, kept, offset)

    monkeypatch.setattr(os, "pwritev", short)
    out = store.write_many(batch(store, [0, 1, 2]))
    assert out[0] is None
    assert all(isinstance(o, TransferFailed) and "short write" in str(o) for o in out[1:])


def test_an_io_error_fails_the_run_it_hit(
    store: PosixSlotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int, iov: object, offset: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    items = batch(store, [0, 1])
    out = store.read_many(empty_like(items))
    assert all(isinstance(o, TransferFailed) and "Input/output" in str(o) for o in out)


def test_unaligned_buffers_are_bounced_one_by_one(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path / "u", config(UNALIGNED, block_size=3))
    try:
        items = [SlotIO(SlotId(s), key(s), payload(store.payload_len, s, aligned=False))
                 for s in (0, 1, 2)]
        assert store.write_many(items) == [None] * 3
        back = [SlotIO(i.slot, i.key, payload(store.payload_len, 99, aligned=False))
                for i in items]
        assert store.read_many(back) == [None] * 3
        for a, b in zip(items, back, strict=True):
            assert torch.equal(a.buffer, b.buffer)
    finally:
        store.close()


@pytest.mark.parametrize("bad", [
    "duplicate", "slot", "key", "buffer", "type", "crc-high", "crc-negative", "crc-bool",
    "crc-text", "meta",
])
def test_a_malformed_batch_moves_nothing(store: PosixSlotStore, bad: str) -> None:
    items = batch(store, [0, 1])
    # The bad item is a run of its own, after a good run: a check made only when its header
    # is packed would come after the good run had landed.
    crc: object = {"crc-high": 1 << 32, "crc-negative": -1, "crc-bool": True,
                   "crc-text": "0"}.get(bad)
    if crc is not None:
        items.append(SlotIO(SlotId(5), key(5), payload(store.payload_len, 5),
                            crc=crc))  # type: ignore[arg-type]
    elif bad == "meta":
        items.append(SlotIO(SlotId(5), key(5), payload(store.payload_len, 5),
                            meta={"depth": 1}))  # type: ignore[arg-type]
    elif bad == "duplicate":
        items.append(items[0])
    elif bad == "slot":
        items.append(SlotIO(SlotId(32), key(1), payload(store.payload_len, 1)))
    elif bad == "key":
        items.append(SlotIO(SlotId(2), b"short", payload(store.payload_len, 1)))  # type: ignore[arg-type]
    elif bad == "buffer":
        items.append(SlotIO(SlotId(2), key(2), torch.zeros(3, dtype=torch.uint8)))
    else:
        items.append((2, key(2), payload(store.payload_len, 1)))  # type: ignore[arg-type]
    with pytest.raises(UsageError) as error:
        store.write_many(items)
    if bad.startswith(("crc", "meta")):
        assert error.value.field == bad.split("-", maxsplit=1)[0], error.value
    assert store.statistics().writes == 0
    assert store.read_many(empty_like(batch(store, [0]))) != [None]  # nothing landed


def test_a_closed_store_refuses_batches(tmp_path: Path) -> None:
    store = PosixSlotStore(tmp_path / "c", config())
    store.close()
    with pytest.raises(UsageError):
        store.write_many(batch(store, [0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("length", [1, 100, 4095, 4096, 4097, 65536 + 3, 2 * 1024 * 1024])
def test_the_batched_gpu_checksum_is_the_host_checksum_of_both_versions(length: int) -> None:
    from io_actors.storage.gpu_checksum import payload_checksums_cuda

    gen = torch.Generator().manual_seed(length)
    pages = [torch.randint(0, 256, (length,), dtype=torch.uint8, generator=gen)
             for _ in range(5)]
    expected = [crc32c.crc32c(p.numpy().tobytes()) for p in pages]
    assert payload_checksums_cuda([p.cuda() for p in pages]) == expected
    old = [zlib.crc32(p.numpy().tobytes()) for p in pages]  # version 2 slots
    assert payload_checksums_cuda([p.cuda() for p in pages], version=2) == old


def _cuda_pools_with_random_pages(
        gpu_blocks: int, host_blocks: int, seed: int,
) -> tuple[KVPools, TorchCopyEngine, HostChecksums]:
    """CUDA pools whose GPU pages hold seeded random bytes, their copy engine, and the host
    checksums it fills (skips without cupy, whose kernel computes them)."""
    pools = KVPools(CacheConfig(block_size=8, gpu_blocks=gpu_blocks, host_blocks=host_blocks,
                                layout=config().layout), "cuda")
    if not have_kernel():
        pytest.skip("needs cupy")
    checksums = pools.host_checksums
    assert checksums is not None
    gen = torch.Generator().manual_seed(seed)
    for page in range(gpu_blocks):
        pools.gpu_page(PageId(page)).copy_(
            torch.randint(0, 256, (pools.block_nbytes,), dtype=torch.uint8, generator=gen))
    return pools, TorchCopyEngine(pools), checksums


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copying_pages_to_host_records_their_checksums_on_the_gpu() -> None:
    pools, engine, checksums = _cuda_pools_with_random_pages(6, 6, seed=7)
    pairs = [(PageId(g), PageId(h)) for g, h in [(0, 5), (1, 0), (2, 1), (4, 3)]]
    engine.copy_pages(pairs, to_gpu=False)
    engine.fence().wait()
    for _g, h in pairs:
        # The checksum a new (version 3) slot's header stores: CRC-32C.
        expected = crc32c.crc32c(pools.host_page(h).numpy().tobytes())
        assert checksums.of(h) == expected
    # Pages no copy filled have no current checksum: a writer computes theirs.
    assert checksums.of(PageId(2)) is None and checksums.of(PageId(4)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_page_filled_twice_in_one_batch_keeps_the_last_copys_checksum() -> None:
    """A batch of GPU -> host copies may fill one host page twice (the first victim's page
    freed again in the same decision and handed to the next): the page ends with the last
    copy's bytes, so its checksum must be the last copy's -- the kernel's blocks write their
    entries in no defined order, so one entry per page is computed."""
    pools, engine, checksums = _cuda_pools_with_random_pages(16, 4, seed=11)
    for trial in range(8):
        # Fifteen copies into host page 1, the last from GPU page `last`, around others.
        last = 15 - trial
        pairs = [(PageId(g), PageId(1)) for g in range(16) if g != last]
        pairs = [(PageId(trial), PageId(0)), *pairs, (PageId(last), PageId(1)),
                 (PageId(trial + 1), PageId(2))]
        engine.copy_pages(pairs, to_gpu=False)
        engine.fence().wait()
        for h in (0, 1, 2):
            expected = crc32c.crc32c(pools.host_page(PageId(h)).numpy().tobytes())
            assert checksums.of(PageId(h)) == expected, (trial, h)
        assert torch.equal(pools.host_page(PageId(1)), pools.gpu_page(PageId(last)).cpu())
