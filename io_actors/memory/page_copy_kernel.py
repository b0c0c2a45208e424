"""One kernel launch for a batch of scattered page copies between pinned host memory and a GPU.

``cudaMemcpyAsync`` moves one contiguous range per call: a batch of pages scattered over the
pools costs one call per page, and at 256 KiB pages the calls, not PCIe, bound the rate
(0.49x of pinned H2D on the H200 machine).  Here one CUDA kernel (a CuPy ``RawKernel``; cupy
is the ``cu12``/``cu13`` extra) copies the whole batch: pinned host memory allocated by
torch (``cudaHostAlloc``) is mapped into the device's address space under unified
addressing, so device code reads and writes it through its host address over PCIe -- the
checksum kernel (``io_actors.storage.gpu_checksum``) already writes its results there the
same way.  The design follows LMCache's and vLLM's paged-copy kernels:

* one thread block per 32 KiB chunk of a page (a grid-stride loop past a cap of blocks), so
  a batch of a few pages still spreads over many SMs and keeps enough 16-byte loads in
  flight to cover PCIe latency;
* each thread issues ``UNROLL`` 16-byte loads before it stores them (``int4``: the pages and
  the pools are 16-byte aligned, which :func:`usable` checks);
* the (source page, destination page) pairs travel as one small int64 array, staged through
  pinned memory and copied onto the stream ahead of the kernel (no host wait).

A batch made of one run of consecutive pages is still one ``cudaMemcpyAsync`` (the copy
engine's DMA, no SMs taken from the forward pass); the kernel is for batches of several
runs.  :func:`self_check` copies scattered pages both ways through scratch buffers before a
copy engine trusts the kernel; any failure there (no cupy, no compiler, a device that cannot
map host memory, wrong bytes) leaves the engine on its per-run copies, and says why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Final

import torch

from io_actors.storage.gpu_checksum import _to_device

_log = logging.getLogger(__name__)

CHUNK_BYTES: Final = 32 * 1024
"""Bytes of a page one thread block copies (a multiple of 16)."""
THREADS: Final = 256
UNROLL: Final = 4
BLOCKS_PER_SM: Final = 4
"""The grid's cap, per SM: enough loads in flight for PCIe, without filling every SM's
thread slots while a forward pass runs beside the copy."""

_SOURCE: Final = r"""
extern "C" __global__ void copy_pages(
    unsigned long long src_base,   // device address of page 0 of the source pool
    unsigned long long dst_base,   // device address of page 0 of the destination pool
    const long long* pairs,        // [n][2]: source page, destination page
    long long n,
    long long page_bytes,          // a multiple of 16
    long long chunks)              // chunks per page: ceil(page_bytes / CHUNK)
{
    const long long items = n * chunks;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long k = item / chunks;
        const long long begin = (item - k * chunks) * CHUNK;
        const long long end = begin + CHUNK < page_bytes ? begin + CHUNK : page_bytes;
        const int4* src = (const int4*)(src_base + pairs[2 * k] * page_bytes + begin);
        int4* dst = (int4*)(dst_base + pairs[2 * k + 1] * page_bytes + begin);
        const long long words = (end - begin) / 16;
        const long long stride = (long long)blockDim.x * UNROLL;
        for (long long base = threadIdx.x; base < words; base += stride) {
            int4 v[UNROLL];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long j = base + (long long)u * blockDim.x;
                if (j < words) v[u] = src[j];
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long j = base + (long long)u * blockDim.x;
                if (j < words) dst[j] = v[u];
            }
        }
    }
}
"""


@functools.cache
def _kernel() -> Any:
    """The compiled kernel (raises where cupy or its compiler is missing)."""
    import cupy

    return cupy.RawKernel(_SOURCE, "copy_pages",
                          options=(f"-DCHUNK={CHUNK_BYTES}", f"-DUNROLL={UNROLL}"))


@functools.cache
def _grid_cap(device_index: int) -> int:
    return BLOCKS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def usable(src_pool: torch.Tensor, dst_pool: torch.Tensor, page_bytes: int) -> str | None:
    """None when the kernel can copy pages between these pools; else why not."""
    if page_bytes <= 0 or page_bytes % 16:
        return f"page size {page_bytes} bytes is not a multiple of 16"
    for pool in (src_pool, dst_pool):
        if pool.data_ptr() % 16:
            return "a pool is not 16-byte aligned"
        if pool.device.type == "cpu" and not pool.is_pinned():
            return "the host pool is not pinned (the device cannot map it)"
    return None


def launch(src_pool: torch.Tensor, dst_pool: torch.Tensor, page_bytes: int,
           pairs: Sequence[tuple[int, int]], stream: torch.cuda.Stream) -> None:
    """Enqueue on `stream`: copy page ``s`` of `src_pool` to page ``d`` of `dst_pool` for
    every ``(s, d)`` of `pairs` (pages of `page_bytes` bytes, checked by the caller: in
    range, and :func:`usable` said yes), without waiting.  One pool is on the GPU, the other
    is pinned host memory; the device is the GPU pool's."""
    import cupy
    import numpy as np

    gpu = src_pool if src_pool.device.type == "cuda" else dst_pool
    device = gpu.device
    flat = [page for pair in pairs for page in pair]
    chunks = -(-page_bytes // CHUNK_BYTES)
    items = len(pairs) * chunks
    with torch.cuda.stream(stream):
        index = _to_device(flat, device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        _kernel()(
            (min(items, _grid_cap(device.index or 0)),), (THREADS,),
            (np.uint64(src_pool.data_ptr()), np.uint64(dst_pool.data_ptr()),
             np.uint64(index.data_ptr()), np.int64(len(pairs)), np.int64(page_bytes),
             np.int64(chunks)),
        )
    # The pairs must outlive the kernel: the caching allocator keeps them until the stream
    # passes this point.
    index.record_stream(stream)


def self_check(device: torch.device, page_bytes: int) -> str | None:
    """Copy scattered pages host -> GPU and back through scratch pools with the kernel and
    compare the bytes.  None when they match; else what went wrong (the caller falls back to
    per-run copies and says so).

    Pages above 1 MiB are checked at 1 MiB plus the real pages' last, partial chunk: the
    same code paths (whole chunks, a tail), without pinning five large pages for good (torch
    keeps pinned blocks cached)."""
    pages = 5
    if page_bytes > 1 << 20:
        page_bytes = (1 << 20) + (page_bytes % CHUNK_BYTES or CHUNK_BYTES // 2)
    try:
        pattern = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(page_bytes))
        host = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
        host.copy_(pattern)
        gpu = torch.zeros((pages, page_bytes), dtype=torch.uint8, device=device)
        why = usable(host, gpu, page_bytes)
        if why is not None:
            return why
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        to_gpu = [(0, 3), (2, 0), (4, 1)]  # scattered, out of order
        launch(host, gpu, page_bytes, to_gpu, stream)
        stream.synchronize()
        for s, d in to_gpu:
            if not torch.equal(gpu[d].cpu(), pattern[s]):
                return f"host page {s} -> GPU page {d}: the bytes differ"
        back = host.new_zeros(host.shape).pin_memory()
        to_host = [(3, 4), (0, 1), (1, 2)]
        launch(gpu, back, page_bytes, to_host, stream)
        stream.synchronize()
        for s, d in to_host:
            if not torch.equal(back[d], gpu[s].cpu()):
                return f"GPU page {s} -> host page {d}: the bytes differ"
    except Exception as exc:  # no cupy, no NVRTC, a device that cannot map host memory...
        return f"{type(exc).__name__}: {exc}"
    return None
