"""Many scattered page copies between the host pool and the GPU pool in one kernel launch.

A batch of recalls (host -> GPU) or evictions (GPU -> host) rarely names pages consecutive on
both sides: each page is its own run, and :class:`io_actors.memory.pools.TorchCopyEngine`
issued one DMA per run.  At 256 KiB a page moves in about 5 us at pinned H2D speed, while
enqueueing one ``copy_`` from Python costs about as much, so a batch of small pages ran at
half the link's rate (recall 0.30-0.50x of pinned H2D on the H200 machine).  Here the whole
batch is one CUDA kernel (a CuPy ``RawKernel``: cupy is the ``cu12``/``cu13`` extra): each
thread block copies a 32 KiB piece of a page at a time in 16-byte words, reading or writing
the pinned host pool directly (pinned memory is mapped into the device's address space under
unified addressing, so the kernel dereferences host addresses as it does device ones), and
the threads keep several words in flight to cover the link's latency.

The pairs are checked and deduplicated by the caller: the kernel's thread blocks run in no
defined order, so two copies into one page in a batch would race, where DMAs in stream order
let the later one win.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Final

import torch

from io_actors.storage.cupy_streams import cupy_stream
from io_actors.storage.pinned_tables import PinnedTables

_log = logging.getLogger(__name__)

WORD: Final = 16
"""Bytes each thread moves per load and store (uint4); a page's size must be a multiple."""

_THREADS: Final = 512
_UNROLL: Final = 4
"""Words each thread loads before it stores them: loads in flight over PCIe."""

_BLOCKS_PER_SM: Final = 2
"""Thread blocks per multiprocessor at most: enough to saturate the link (each block keeps
512 x 4 x 16 bytes = 32 KiB of loads in flight: 264 blocks on an H200, 8 MiB), few enough
that a batch leaves room on the device for the forward pass running beside it."""

_CHUNK_WORDS: Final = _THREADS * _UNROLL
"""Words of one page one thread block copies at a time (32 KiB): a batch of 16 pages of
256 KiB is 128 pieces, enough to keep the link busy where one piece per page was not."""

_SOURCE: Final = r"""
extern "C" __global__ void copy_pages(
    unsigned long long src_base,   // address of source page 0 (device, or pinned host)
    unsigned long long dst_base,   // address of destination page 0
    const long long* pairs,        // [n][2]: source page, destination page (ADDRESSED:
                                   // their byte addresses)
    long long n,                   // pairs
    long long words)               // 16-byte words per page
{
    const long long chunks = (words + CHUNK - 1) / CHUNK;
    for (long long j = blockIdx.x; j < n * chunks; j += gridDim.x) {
        const long long k = j / chunks;
        const long long first = (j - k * chunks) * CHUNK;
        const long long end = first + CHUNK < words ? first + CHUNK : words;
#ifdef ADDRESSED
        // pairs holds each copy's byte addresses (src_base and dst_base are 0).
        const uint4* src = (const uint4*)pairs[2 * k];
        uint4* dst = (uint4*)pairs[2 * k + 1];
#else
        const uint4* src = (const uint4*)src_base + pairs[2 * k] * words;
        uint4* dst = (uint4*)dst_base + pairs[2 * k + 1] * words;
#endif
        for (long long w = first + threadIdx.x; w < end; w += (long long)blockDim.x * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long i = w + (long long)u * blockDim.x;
                if (i < end) v[u] = src[i];
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long i = w + (long long)u * blockDim.x;
                if (i < end) dst[i] = v[u];
            }
        }
    }
}
"""


@functools.cache
def _kernel(addressed: bool = False) -> Any | None:
    """The compiled kernel (`addressed`: the one taking each copy's byte addresses), or None
    where cupy is not installed (logged once)."""
    try:
        import cupy
    except ImportError as exc:
        if not addressed:
            _log.info("cupy is not installed (%s): scattered page copies are one DMA each",
                      exc)
        return None
    options = (f"-DUNROLL={_UNROLL}", f"-DCHUNK={_CHUNK_WORDS}")
    return cupy.RawKernel(_SOURCE, "copy_pages",
                          options=options + (("-DADDRESSED",) if addressed else ()))


@functools.cache
def _max_blocks(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(props.multi_processor_count) * _BLOCKS_PER_SM


def have_kernel() -> bool:
    """Whether scattered page copies can run as one kernel (cupy present)."""
    return _kernel() is not None


class PageGather:
    """Batches of page copies as one kernel each, on one CUDA stream (a copy engine's).

    Not thread safe: the engine calls it under its lock.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        kernel = _kernel()
        if kernel is None or device.type != "cuda" or device.index is None:
            raise ValueError("PageGather needs cupy and an indexed CUDA device")
        self._launch = kernel
        self._device_index: int = device.index
        self._stream = stream
        self._cupy_stream = cupy_stream(stream)
        self._max_blocks = _max_blocks(device.index)
        # Each batch's (source, destination) table lives in pinned host memory, which the
        # kernel reads through its mapped address (no copy of its own to enqueue), until the
        # event recorded after its kernel has passed.
        self._tables = PinnedTables()

    def copy(self, src_pool: torch.Tensor, dst_pool: torch.Tensor,
             pairs: Sequence[tuple[int, int]], page_nbytes: int) -> None:
        """Enqueue ``dst_pool[d] = src_pool[s]`` for each (s, d) in `pairs` on the stream, as
        one kernel; no synchronization.

        The pools are contiguous tensors of pages of `page_nbytes` bytes (a multiple of
        :data:`WORD`), each on the device or in pinned host memory.  The caller has checked
        every page number and that no destination repeats.
        """
        import cupy
        import numpy as np

        assert page_nbytes % WORD == 0 and pairs
        table = self._tables.table([page for pair in pairs for page in pair])
        words = page_nbytes // WORD
        blocks = min(len(pairs) * -(-words // _CHUNK_WORDS), self._max_blocks)
        with cupy.cuda.Device(self._device_index), self._cupy_stream:
            self._launch(
                (blocks,), (_THREADS,),
                (
                    np.uint64(src_pool.data_ptr()), np.uint64(dst_pool.data_ptr()),
                    np.uint64(table.data_ptr()), np.int64(len(pairs)), np.int64(words),
                ),
            )
        self._tables.launched(table, self._stream)

    def copy_addressed(self, pairs: Sequence[tuple[int, int]], page_nbytes: int) -> None:
        """Enqueue one kernel copying `page_nbytes` bytes from each (source address,
        destination address) in `pairs` -- device or pinned host memory, any pool -- on the
        stream; no synchronization.

        The copies run in no defined order: the caller guarantees that no destination
        repeats and that no copy reads bytes another of the batch writes
        (:mod:`io_actors.memory.copy_passes` plans such batches).  Every address is
        aligned to :data:`WORD`."""
        import cupy
        import numpy as np

        kernel = _kernel(addressed=True)
        assert kernel is not None and page_nbytes % WORD == 0 and pairs
        table = self._tables.table([address for pair in pairs for address in pair])
        words = page_nbytes // WORD
        blocks = min(len(pairs) * -(-words // _CHUNK_WORDS), self._max_blocks)
        with cupy.cuda.Device(self._device_index), self._cupy_stream:
            kernel(
                (blocks,), (_THREADS,),
                (
                    np.uint64(0), np.uint64(0), np.uint64(table.data_ptr()),
                    np.int64(len(pairs)), np.int64(words),
                ),
            )
        self._tables.launched(table, self._stream)
