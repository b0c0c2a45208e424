"""The slot format's payload checksum of many GPU pages in one kernel launch.

:func:`io_actors.storage.slot_format.payload_checksum_torch` computes the payload checksum
(CRC-32C; zlib's CRC-32 for version 2 slots) of one device buffer from gathers and XORs on
int32 tensors: exact on any torch device, but about a dozen
kernel launches and tensor temporaries per block, all issued from Python.  A reader that
verifies a batch of pages read straight into GPU memory would pay that per block, on a
worker thread that competes with the serving loop for the interpreter lock.  Here the same
arithmetic runs as one CUDA kernel (a CuPy ``RawKernel``: cupy is the ``cu12``/``cu13``
extra) for a whole batch: one thread block per page, one thread per 4 KiB chunk, each thread
running the byte-at-a-time CRC register over its chunk (table in shared memory), shifting it
past the chunks after it with the same per-chunk byte tables the torch version uses
(``_crc_device_tables``), and the block XOR-reducing its threads' results.  The kernel
knows no polynomial: the byte table, the shift tables and the CRC of zeros it is given are
those of the slot format version asked for, so one kernel computes both checksums, each
bit-identical to the host's (``crc32c.crc32c``, ``zlib.crc32``); the torch path stays the
fallback where cupy is missing and the reference the tests compare against.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Final

import torch

from io_actors.storage.cupy_streams import cupy_stream
from io_actors.storage.pinned_tables import PinnedTables
from io_actors.storage.slot_format import (
    _CRC_CHUNK,
    FORMAT_VERSION,
    _crc_device_tables,
    _crc_of_zeros,
    _crc_table,
    payload_checksum_torch,
)
from statekv.errors import UsageError

_log = logging.getLogger(__name__)

_THREADS: Final = 512
"""Threads per page (a power of two, for the XOR reduction)."""

_SOURCE: Final = r"""
extern "C" __global__ void crc32_pages(
    const unsigned long long* pages,  // device address of each page (in pinned host memory)
    long long length,                 // bytes per page
    int chunks,                       // ceil(length / CHUNK)
    const unsigned int* table,        // the 256-entry table of the CRC's polynomial
    const unsigned int* shifts,       // [chunks][1024]: byte tables of Z^(CHUNK*(chunks-1-k))
    unsigned int zeros_crc,           // the CRC of `length` zero bytes
    unsigned int* out,                // the CRCs (device memory, or pinned host memory)
    const long long* out_index)       // where page k's CRC goes (null: at k; pinned host)
{
    __shared__ unsigned int t[256];
    __shared__ unsigned int red[THREADS];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) t[i] = table[i];
    __syncthreads();
    const unsigned char* data = (const unsigned char*)pages[blockIdx.x];
    const long long pad = (long long)chunks * CHUNK - length;  // zeros in front of chunk 0
    unsigned int mine = 0;
    for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
        const long long start = (long long)k * CHUNK - pad;
        unsigned int c = 0;  // the register from zero state, no inversions
        for (long long i = start < 0 ? 0 : start; i < start + CHUNK; ++i)
            c = t[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
        const unsigned int* s = shifts + (long long)k * 1024;
        mine ^= s[c & 0xFFu] ^ s[256 + ((c >> 8) & 0xFFu)] ^ s[512 + ((c >> 16) & 0xFFu)]
              ^ s[768 + (c >> 24)];
    }
    red[threadIdx.x] = mine;
    __syncthreads();
    for (int w = THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) red[threadIdx.x] ^= red[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[out_index ? out_index[blockIdx.x] : blockIdx.x] = red[0] ^ zeros_crc;
}
"""


@functools.cache
def _kernel() -> Any | None:
    """The compiled kernel, or None where cupy is not installed (logged once)."""
    try:
        import cupy
    except ImportError as exc:
        _log.info("cupy is not installed (%s): GPU checksums use the torch path", exc)
        return None
    return cupy.RawKernel(
        _SOURCE, "crc32_pages",
        options=(f"-DCHUNK={_CRC_CHUNK}", f"-DTHREADS={_THREADS}"),
    )


@functools.cache
def _table(device: torch.device, version: int) -> torch.Tensor:
    return torch.tensor(_crc_table(version), dtype=torch.int64).to(torch.int32).to(device)


def have_kernel() -> bool:
    """Whether batched checksums run as one kernel (cupy present)."""
    return _kernel() is not None


def _check_pages(pages: Sequence[torch.Tensor]) -> int:
    first = pages[0]
    length = first.numel()
    for page in pages:
        if (
            not isinstance(page, torch.Tensor) or page.device != first.device
            or page.device.type != "cuda" or page.dtype != torch.uint8 or page.dim() != 1
            or not page.is_contiguous() or page.numel() != length
        ):
            raise UsageError("pages", "must be contiguous 1-D uint8 CUDA tensors of one length "
                             "on one device")
    return length


_TABLES: Final = PinnedTables()
"""The kernel's page addresses and result slots, read from pinned host memory (shared by
every thread that launches it: the serving thread's evictions, a reader's verifications)."""


def _launch(pages: Sequence[torch.Tensor], length: int, out: torch.Tensor,
            index: Sequence[int] | None, version: int) -> None:
    """Enqueue the kernel, computing the checksum of slot format `version`, on the current
    stream (no synchronization).  Page k's result goes to ``out[index[k]]`` (at k without
    an index)."""
    import cupy
    import numpy as np

    kernel = _kernel()
    assert kernel is not None
    device = pages[0].device
    chunks = -(-length // _CRC_CHUNK)
    _position, shifts = _crc_device_tables(device, chunks, version)
    crc_table = _table(device, version)
    n = len(pages)
    # One pinned table: the pages' addresses, then where each result goes.
    entries = _TABLES.table(
        [p.data_ptr() for p in pages] + ([] if index is None else list(index)))
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy_stream(stream):
        kernel(
            (len(pages),), (_THREADS,),
            (
                np.uint64(entries.data_ptr()), np.int64(length), np.int32(chunks),
                np.uint64(crc_table.data_ptr()), np.uint64(shifts.data_ptr()),
                np.uint32(_crc_of_zeros(length, version)), np.uint64(out.data_ptr()),
                np.uint64(0 if index is None else entries.data_ptr() + 8 * n),
            ),
        )
    _TABLES.launched(entries, stream)


def warm_up(length: int, device: torch.device) -> None:
    """Compile the kernel and build the tables for pages of `length` bytes on `device`, now.

    The first call otherwise pays for both (about 0.7 s on the H200 machine, measured): on a
    serving thread's first eviction, or inside the first batch of reads.  Caches open their
    pools and stores with this.  The tables are those of the format this build writes; the
    first read of a version 2 slot builds that version's (the kernel is the same).
    """
    if _kernel() is None or length <= 0:
        return
    page = torch.zeros(length, dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        payload_checksums_cuda([page])


def payload_checksums_cuda(pages: Sequence[torch.Tensor], *,
                           version: int = FORMAT_VERSION) -> list[int]:
    """The payload checksum of slot format `version` (``payload_checksum``) of each page:
    contiguous 1-D uint8 CUDA tensors of one length, on one device.  Runs on the current
    stream and reads the results back with one synchronizing copy."""
    if not pages:
        return []
    length = _check_pages(pages)
    if _kernel() is None or length == 0:
        return [payload_checksum_torch(page, version=version) for page in pages]
    out = torch.empty(len(pages), dtype=torch.int32, device=pages[0].device)
    _launch(pages, length, out, None, version)
    return [int(v) & 0xFFFFFFFF for v in out.cpu().tolist()]


def checksums_into(pages: Sequence[torch.Tensor], out: torch.Tensor,
                   slots: Sequence[int]) -> None:
    """Enqueue on the current stream: ``out[slots[k]] = payload_checksum(pages[k])``, of the
    format this build writes (a writer stores it in a new slot's header), without waiting.
    `out` is int32, on the pages' device or in pinned host memory (which a CUDA kernel
    writes directly: pinned memory is mapped into the device's address space under unified
    addressing).  Whoever reads an entry first waits for an event recorded after
    this call on the same stream.  Needs the kernel (``have_kernel()``)."""
    if not pages:
        return
    length = _check_pages(pages)
    if _kernel() is None:
        raise UsageError("pages", "checksums_into needs cupy")
    if (out.dtype != torch.int32 or out.dim() != 1 or not out.is_contiguous()
            or not (out.device == pages[0].device or out.is_pinned())):
        raise UsageError("out", "must be a contiguous 1-D int32 tensor on the pages' device "
                         "or in pinned host memory")
    if len(slots) != len(pages) or not all(0 <= s < out.numel() for s in slots):
        raise UsageError("slots", "one index into `out` per page")
    _launch(pages, length, out, slots, FORMAT_VERSION)
