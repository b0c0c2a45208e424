"""KvikioSlotStore: reads straight into GPU pages, verified by the GPU-side checksum.

Everything but the refusal test needs CUDA and kvikio, and is skipped elsewhere.
"""

from __future__ import annotations

import importlib
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest
import torch

from io_actors.storage.faults import Fault, FaultPlan, FaultRule, FaultyStore, Op
from io_actors.storage.kvikio_store import KvikioSlotStore
from io_actors.storage.open_store import open_slot_store
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE
from io_actors.storage.slot_format import payload_checksum_torch
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, TransferFailed
from statekv.ids import BlockHash, SlotId

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=128, dtype="bfloat16")
CONFIG = CacheConfig(block_size=16, gpu_blocks=4, host_blocks=4, disk_blocks=8, layout=LAYOUT)


def _kvikio_importable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("kvikio")
    except (ImportError, OSError):
        return False
    return True


requires_kvikio = pytest.mark.skipif(not _kvikio_importable(), reason="needs CUDA and kvikio")


def key(n: int) -> BlockHash:
    return BlockHash(bytes([n]) * 32)


def host_payload(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (CONFIG.block_bytes,), dtype=torch.uint8, generator=gen)
    return data.pin_memory() if torch.cuda.is_available() else data


def gpu_page() -> torch.Tensor:
    return torch.zeros(CONFIG.block_bytes, dtype=torch.uint8, device="cuda")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KvikioSlotStore]:
    s = KvikioSlotStore(tmp_path, CONFIG)
    yield s
    s.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_store_refuses_to_open_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA") as info:
        KvikioSlotStore(tmp_path, CONFIG)
    assert info.value.field == "kind"
    assert not (tmp_path / DATA_FILE).exists()


@pytest.mark.gpu
@requires_kvikio
def test_device_reads_are_byte_identical_to_what_was_written(store: KvikioSlotStore) -> None:
    assert store.device_reads
    for slot in range(CONFIG.disk_blocks):
        src = host_payload(slot)
        store.write(SlotId(slot), key(slot), src)
        dst = gpu_page()
        store.read(SlotId(slot), key(slot), dst)
        assert torch.equal(dst.cpu(), src.cpu())
    assert store.statistics().reads == CONFIG.disk_blocks


@pytest.mark.gpu
@requires_kvikio
def test_a_device_read_under_the_wrong_key_raises(store: KvikioSlotStore) -> None:
    store.write(SlotId(0), key(1), host_payload(1))
    with pytest.raises(TransferFailed, match="key mismatch"):
        store.read(SlotId(0), key(2), gpu_page())
    with pytest.raises(TransferFailed, match="never written"):
        store.read(SlotId(1), key(1), gpu_page())
    assert store.statistics().read_failures == 2


@pytest.mark.gpu
@requires_kvikio
@pytest.mark.parametrize("fault", [Fault.BIT_FLIP, Fault.TORN_WRITE_SILENT])
def test_silent_corruption_is_caught_by_the_gpu_checksum(
    store: KvikioSlotStore, fault: Fault
) -> None:
    store.write(SlotId(2), key(7), host_payload(7))
    faulty = FaultyStore(
        store, FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=fault, nth=1),), seed=5)
    )
    faulty.write(SlotId(2), key(8), host_payload(8))
    with pytest.raises(TransferFailed):
        faulty.read(SlotId(2), key(8), gpu_page())


@pytest.mark.gpu
@requires_kvikio
def test_slots_written_by_the_posix_store_read_onto_the_gpu(tmp_path: Path) -> None:
    posix = PosixSlotStore(tmp_path, CONFIG)
    src = host_payload(3)
    posix.write(SlotId(5), key(3), src)
    posix.close()
    kv = open_slot_store("kvikio", tmp_path, CONFIG)
    assert isinstance(kv, KvikioSlotStore)
    dst = gpu_page()
    kv.read(SlotId(5), key(3), dst)
    host_dst = torch.zeros(CONFIG.block_bytes, dtype=torch.uint8)
    kv.read(SlotId(5), key(3), host_dst)
    kv.close()
    assert torch.equal(dst.cpu(), src.cpu())
    assert torch.equal(host_dst, src.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("length", [1, 4095, 4096, 4097, 1 << 20, (4 << 20) + 3])
def test_the_gpu_checksum_equals_the_host_checksum_of_both_versions(length: int) -> None:
    data = os.urandom(length)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    assert payload_checksum_torch(tensor) == crc32c.crc32c(data)
    assert payload_checksum_torch(tensor, version=2) == zlib.crc32(data)
