"""KVPools and TorchCopyEngine: shapes, views, validation, and real byte copies."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from io_actors.memory.pools import TORCH_DTYPES, KVPools, TorchCopyEngine, torch_dtype
from io_actors.storage.buffers import aligned_within, page_aligned_buffer
from statekv.config import DTYPE_BYTES, CacheConfig, KVLayout
from statekv.errors import ConfigError, UsageError
from statekv.ids import PageId

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16")


DEVICE = os.environ.get("STATEKV_TEST_DEVICE", "cpu")
"""The GPU machine runs the batch copy test on CUDA (STATEKV_TEST_DEVICE=cuda)."""


def config(**overrides: object) -> CacheConfig:
    fields: dict[str, object] = {
        "block_size": 4, "gpu_blocks": 5, "host_blocks": 3, "reserved_host_blocks": 2,
        "disk_blocks": 4, "layout": LAYOUT,
    }
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


def fill(page: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen)
    page.copy_(data)
    return data


def test_every_layout_dtype_has_a_torch_dtype_of_its_size() -> None:
    assert set(TORCH_DTYPES) == set(DTYPE_BYTES)
    for name, size in DTYPE_BYTES.items():
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == size


def test_unknown_dtype_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        torch_dtype("int4")
    assert info.value.field == "dtype"


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_pools_have_the_layout_shape_and_dtype(dtype: str) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype)
    pools = KVPools(config(layout=layout), "cpu")
    assert pools.gpu.shape == (5, 3, 2, 4, 2, 16)
    assert pools.host.shape == (3 + 2, 3, 2, 4, 2, 16)
    assert pools.gpu.dtype == pools.host.dtype == torch_dtype(dtype)
    assert pools.block_nbytes == layout.block_bytes(4)
    assert pools.gpu_page(PageId(0)).numel() == pools.block_nbytes


def test_page_views_alias_the_pool_and_are_contiguous_bytes() -> None:
    pools = KVPools(config(), "cpu")
    view = pools.host_page(PageId(4))
    assert view.dtype == torch.uint8 and view.dim() == 1 and view.is_contiguous()
    fill(view, 1)
    assert torch.equal(pools.host[4].reshape(-1).view(torch.uint8), view)
    assert not pools.host[3].any()
    gpu_view = pools.gpu_page(PageId(2))
    gpu_view.fill_(7)
    assert torch.equal(pools.gpu[2].reshape(-1).view(torch.uint8), gpu_view)
    assert not pools.gpu[1].any() and not pools.gpu[3].any()


def test_every_page_view_is_its_own_page_across_the_runs_views_are_made_in() -> None:
    # Views are made a run of pages at a time: each must still be exactly its page, the
    # last (short) run included, whichever page of a run is asked for first.
    pools = KVPools(CacheConfig(block_size=1, gpu_blocks=600, host_blocks=300,
                                layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=4,
                                                dtype="bfloat16")), "cpu")
    for pool, page_of, pages in ((pools.host, pools.host_page, 300),
                                 (pools.gpu, pools.gpu_page, 600)):
        nbytes = pools.block_nbytes
        for page in (299, 3, 0, 257, 256, pages - 1, 511 % pages):
            view = page_of(PageId(page))
            assert view.data_ptr() == pool.data_ptr() + page * nbytes
            assert view.numel() == nbytes and view.is_contiguous() and view.dtype == torch.uint8
            assert page_of(PageId(page)) is view  # made once


def test_pages_start_zeroed() -> None:
    pools = KVPools(config(), "cpu")
    assert not pools.gpu.view(torch.uint8).any()
    assert not pools.host.view(torch.uint8).any()


def test_host_pages_are_page_aligned_for_direct_io() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    pools = KVPools(config(block_size=16, layout=layout), "cpu")
    assert pools.block_nbytes % 4096 == 0
    for page in range(pools.host_pages):
        assert pools.host_page(PageId(page)).data_ptr() % 4096 == 0


@pytest.mark.parametrize(("method", "page"), [("gpu_page", 5), ("gpu_page", -1),
                                              ("host_page", 5), ("host_page", True)])
def test_out_of_range_pages_raise_usage_error_naming_the_field(method: str, page: int) -> None:
    pools = KVPools(config(), "cpu")
    with pytest.raises(UsageError) as info:
        getattr(pools, method)(page)
    assert info.value.field == method


def test_a_cache_without_host_tier_has_an_empty_host_pool() -> None:
    pools = KVPools(CacheConfig(block_size=4, gpu_blocks=2, layout=LAYOUT), "cpu")
    assert pools.host.shape[0] == 0
    with pytest.raises(UsageError):
        pools.host_page(PageId(0))


@pytest.mark.parametrize("device", ["tpu", "not a device", 42, "meta"])
def test_bad_devices_are_config_errors_naming_device(device: object) -> None:
    with pytest.raises(ConfigError) as info:
        KVPools(config(), device)  # type: ignore[arg-type]
    assert info.value.field == "device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_device_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="CUDA") as info:
        KVPools(config(), "cuda")
    assert info.value.field == "device"


def test_a_host_pool_larger_than_memory_is_a_config_error_naming_host_blocks() -> None:
    with pytest.raises(ConfigError) as info:
        KVPools(config(host_blocks=2**40), "cpu")
    assert info.value.field == "host_blocks"


def test_a_cpu_gpu_pool_larger_than_memory_is_a_config_error_naming_gpu_blocks() -> None:
    with pytest.raises(ConfigError) as info:
        KVPools(config(gpu_blocks=2**40), "cpu")
    assert info.value.field == "gpu_blocks"


def test_a_non_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        KVPools({"block_size": 4}, "cpu")  # type: ignore[arg-type]
    assert info.value.field == "config"


def test_staging_buffers_are_one_aligned_block() -> None:
    pools = KVPools(config(), "cpu")
    a, b = pools.new_staging_buffer(), pools.new_staging_buffer()
    assert a.numel() == pools.block_nbytes and a.dtype == torch.uint8
    assert a.data_ptr() % 4096 == 0 and a.data_ptr() != b.data_ptr()


def test_page_aligned_buffer_is_zeroed_and_aligned() -> None:
    buf = page_aligned_buffer(10_000)
    assert buf.numel() == 10_000 and buf.data_ptr() % 4096 == 0 and not buf.any()
    assert page_aligned_buffer(0).numel() == 0


# --- copy engine ------------------------------------------------------------------------------


def test_copy_engine_copies_real_bytes_gpu_to_host_and_back() -> None:
    pools = KVPools(config(), "cpu")
    engine = TorchCopyEngine(pools)
    original = fill(pools.gpu_page(PageId(1)), 42)
    engine.copy_gpu_to_host(PageId(1), PageId(3))
    assert torch.equal(pools.host_page(PageId(3)), original)
    engine.copy_host_to_gpu(PageId(3), PageId(4))
    engine.fence().wait()
    assert torch.equal(pools.gpu_page(PageId(4)), original)
    assert not pools.gpu_page(PageId(0)).any()


def test_copies_run_in_command_order() -> None:
    pools = KVPools(config(), "cpu")
    engine = TorchCopyEngine(pools)
    first = fill(pools.gpu_page(PageId(0)), 1)
    second = fill(pools.gpu_page(PageId(1)), 2)
    # Evict page 0 to host 0, reuse GPU page 0 for a copy of page 1, bring host 0 back to 2.
    engine.copy_gpu_to_host(PageId(0), PageId(0))
    engine.copy_gpu_to_host(PageId(1), PageId(1))
    engine.copy_host_to_gpu(PageId(1), PageId(0))
    engine.copy_host_to_gpu(PageId(0), PageId(2))
    engine.order_before_compute()
    engine.fence().wait()
    assert torch.equal(pools.gpu_page(PageId(0)), second)
    assert torch.equal(pools.gpu_page(PageId(2)), first)


@pytest.mark.parametrize("pairs", [
    [(0, 2), (1, 3)],          # one run: one copy
    [(1, 0), (0, 2), (2, 1)],  # no runs
    [(0, 0), (1, 1), (3, 4)],  # a run and a lone page
], ids=["run", "scattered", "mixed"])
def test_a_batch_of_page_copies_moves_every_page_to_its_destination(
    pairs: list[tuple[int, int]],
) -> None:
    pools = KVPools(config(), DEVICE)
    engine = TorchCopyEngine(pools)
    originals = {h: fill(pools.host_page(PageId(h)), 10 + h).clone() for h, _g in pairs}
    engine.copy_pages([(PageId(h), PageId(g)) for h, g in pairs], to_gpu=True)
    engine.fence().wait()
    for h, g in pairs:
        assert torch.equal(pools.gpu_page(PageId(g)).cpu(), originals[h].cpu())
    back = [(PageId(g), PageId(h)) for h, g in pairs]
    for h, _g in pairs:
        pools.host_page(PageId(h)).zero_()
    engine.copy_pages(back, to_gpu=False)
    engine.fence().wait()
    for h, _g in pairs:
        assert torch.equal(pools.host_page(PageId(h)).cpu(), originals[h].cpu())
    assert engine.statistics().copies_to_gpu == engine.statistics().copies_to_host == len(pairs)


@pytest.mark.parametrize("block_size", [4, 100], ids=["1.5KiB", "37.5KiB"])
@pytest.mark.parametrize("gather_kernel", [True, False], ids=["kernel", "dma"])
@pytest.mark.skipif(DEVICE != "cuda", reason="the gather kernel runs on CUDA only")
def test_scattered_batches_with_repeated_destinations_leave_each_pages_last_copy(
    gather_kernel: bool, block_size: int,
) -> None:
    # 40 pages each way, shuffled, with some destinations named twice: the kernel's thread
    # blocks run in no defined order, so only a batch's last copy into a page may land.
    # 37.5 KiB pages are two of the kernel's 32 KiB pieces, the second one partial.
    pools = KVPools(config(gpu_blocks=40, host_blocks=40, reserved_host_blocks=0,
                           block_size=block_size), DEVICE)
    engine = TorchCopyEngine(pools, gather_kernel=gather_kernel)
    gen = torch.Generator().manual_seed(7)
    for to_gpu in (True, False):
        # Compared as bytes: random bytes read as bfloat16 hold NaNs, never equal.
        src_pool, dst_pool = (pools.host, pools.gpu) if to_gpu else (pools.gpu, pools.host)
        src_pool, dst_pool = (p.view(p.shape[0], -1).view(torch.uint8)
                              for p in (src_pool, dst_pool))
        src_pool.copy_(torch.randint(0, 256, src_pool.shape, dtype=torch.uint8, generator=gen))
        dst_pool.zero_()
        targets = torch.randperm(40, generator=gen).tolist()
        pairs = [(s, d) for s, d in enumerate(targets)]
        pairs += [(s, targets[(s * 7) % 40]) for s in range(5)]  # 5 destinations again
        engine.copy_pages([(PageId(s), PageId(d)) for s, d in pairs], to_gpu=to_gpu)
        engine.fence().wait()
        expected = {d: s for s, d in pairs}
        for d, s in expected.items():
            assert torch.equal(dst_pool[d].cpu(), src_pool[s].cpu()), (to_gpu, s, d)
    assert engine.statistics().kernel_batches == (2 if gather_kernel else 0)


def test_a_gather_kernel_where_it_cannot_run_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError) as info:
        TorchCopyEngine(KVPools(config(), "cpu"), gather_kernel=True)
    assert info.value.field == "gather_kernel"
    with pytest.raises(ConfigError) as info:
        TorchCopyEngine(KVPools(config(), "cpu"), gather_kernel="yes")  # type: ignore[arg-type]
    assert info.value.field == "gather_kernel"
    assert TorchCopyEngine(KVPools(config(), "cpu"), gather_kernel=None).statistics(
        ).kernel_batches == 0


def test_a_batch_of_copies_refuses_a_page_out_of_range_before_copying() -> None:
    pools = KVPools(config(), "cpu")
    engine = TorchCopyEngine(pools)
    with pytest.raises(UsageError):
        engine.copy_pages([(PageId(0), PageId(0)), (PageId(99), PageId(1))], to_gpu=True)
    assert engine.statistics().copies_to_gpu == 0


def test_staging_buffer_copies_into_a_gpu_page() -> None:
    pools = KVPools(config(), "cpu")
    engine = TorchCopyEngine(pools)
    staging = pools.new_staging_buffer()
    data = fill(staging, 3)
    engine.copy_buffer_to_gpu(staging, PageId(2))
    engine.fence().wait()
    assert torch.equal(pools.gpu_page(PageId(2)), data)


@pytest.mark.parametrize(
    "src",
    [torch.zeros(10, dtype=torch.uint8), torch.zeros(768, dtype=torch.int16), "bytes"],
)
def test_staging_copy_refuses_a_bad_buffer(src: object) -> None:
    engine = TorchCopyEngine(KVPools(config(), "cpu"))
    with pytest.raises(UsageError) as info:
        engine.copy_buffer_to_gpu(src, PageId(0))  # type: ignore[arg-type]
    assert info.value.field == "src"


def test_copies_to_bad_pages_raise_and_copy_nothing() -> None:
    pools = KVPools(config(), "cpu")
    engine = TorchCopyEngine(pools)
    with pytest.raises(UsageError) as info:
        engine.copy_gpu_to_host(PageId(0), PageId(99))
    assert info.value.field == "host_page"
    with pytest.raises(UsageError) as info:
        engine.copy_host_to_gpu(PageId(0), PageId(99))
    assert info.value.field == "gpu_page"
    assert engine.statistics().copies_to_host == engine.statistics().copies_to_gpu == 0


def test_cpu_engine_is_synchronous_and_counts() -> None:
    pools = KVPools(config(), "cpu")
    engine = TorchCopyEngine(pools)
    engine.copy_gpu_to_host(PageId(0), PageId(0))
    engine.copy_host_to_gpu(PageId(0), PageId(1))
    engine.copy_host_to_gpu(PageId(0), PageId(2))
    engine.fence().wait()
    stats = engine.statistics()
    assert not stats.asynchronous
    assert (stats.copies_to_host, stats.copies_to_gpu, stats.fences) == (1, 2, 1)
    assert stats.bytes_to_gpu == 2 * pools.block_nbytes


def test_a_compute_stream_on_cpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        TorchCopyEngine(KVPools(config(), "cpu"), compute_stream=object())  # type: ignore[arg-type]
    assert info.value.field == "compute_stream"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_see_compute_written_before_and_fence_covers_them() -> None:
    pools = KVPools(config(gpu_blocks=8), "cuda")
    assert pools.host_pinned
    engine = TorchCopyEngine(pools)
    page = pools.gpu_page(PageId(0))
    # A long kernel queue on the compute stream, whose last kernel writes the page.
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    page.fill_(0)
    page.copy_(torch.full_like(page, 9))
    engine.copy_gpu_to_host(PageId(0), PageId(0))
    engine.fence().wait()
    assert bool((pools.host_page(PageId(0)) == 9).all())
    engine.copy_host_to_gpu(PageId(0), PageId(5))
    engine.order_before_compute()
    assert bool((pools.gpu_page(PageId(5)) == 9).all())
    assert engine.statistics().asynchronous


def test_the_aligned_part_of_a_buffer_starts_at_a_page_boundary() -> None:
    """Pinned memory is not promised page aligned (the H200 machine handed out a host pool
    2,560 bytes past a boundary): the pools take the aligned part of one page more, and
    O_DIRECT moves their pages without the bounce buffer."""
    page = mmap.PAGESIZE
    backing = page_aligned_buffer(4 * page)
    raw = backing[2560 : 2560 + 2 * page + page - 1]       # starts off a page boundary
    assert raw.data_ptr() % page != 0
    part = aligned_within(raw, 2 * page)
    assert part.data_ptr() % page == 0 and part.numel() == 2 * page
    part.fill_(7)                                             # the same memory, not a copy
    assert int(backing[page]) == 7 and int(backing[3 * page - 1]) == 7
    with pytest.raises(ValueError):
        aligned_within(raw, 3 * page)
