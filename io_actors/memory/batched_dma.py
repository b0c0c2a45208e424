"""Many page copies as one call of the CUDA driver's batched memcpy (the copy engines' DMAs).

The gather kernel (:mod:`io_actors.memory.page_gather`) made a batch of scattered page copies
one launch, but it moves the bytes with the device's SMs reading pinned host memory over the
link, which on some H100 instances runs at about 0.6x of a pinned H2D DMA (bench.io's
"recall, kernel only").  A DMA per page moves bytes at the link's rate but costs the caller
an enqueue per page.  ``cuMemcpyBatchAsync`` (CUDA driver 12.8 and later) takes a whole
batch of pointer-to-pointer copies in one call and runs them on the copy engines.

Like the kernel, the copies of a batch run in no defined order ("specifying any dependent
copies within a batch will result in undefined behavior"), so a batch carries the same
contract as :meth:`PageGather.copy_addressed`: no destination repeats and no copy reads
bytes another one writes (:mod:`io_actors.memory.copy_passes` plans such batches).

The entry point is resolved through ``cuGetProcAddress`` at the 12.8 ABI (CUDA 13 changed
the function's parameters under the same name), and checked at construction by a small
copy that must land; where any of that fails, ``TorchCopyEngine(batch_dma=True)`` is a
ConfigError naming ``batch_dma``.  It is not the default: on an H100 it beat the kernel
in one direction (recall at 256 KiB, 0.62x of pinned H2D against 0.56x) but cost the caller
about twice the kernel's time a copy, and lost to it in an admission's chain of both
directions at every page size (BENCHMARKS.md, Transfer paths).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any, Final

import torch

_ABI_VERSION: Final = 12080
"""The cuMemcpyBatchAsync ABI asked for: 12.8's, which takes a failIdx pointer."""

_SRC_ACCESS_ORDER_STREAM: Final = 1
"""CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order (after the copy
stream's earlier work), as a DMA enqueued there would."""

_LOCATION_DEVICE: Final = 1
"""CU_MEM_LOCATION_TYPE_DEVICE: the location hints, which the driver ignores for memory that
is not managed (the pools are cudaMalloc'd and cudaHostAlloc'd), set to a valid value."""

_PREFER_OVERLAP_WITH_COMPUTE: Final = 1
"""CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: the copies are to run beside the forward
pass, on the copy engines, not on the SMs it computes with."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes_v1."""
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location),
                ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


_BATCH_SIGNATURE: Final = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
    ctypes.POINTER(_Attributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
)


class BatchedDMAUnavailable(Exception):
    """The driver here has no usable cuMemcpyBatchAsync."""


@functools.cache
def _driver() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise BatchedDMAUnavailable(f"libcuda.so.1: {exc}") from None


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise BatchedDMAUnavailable(
            f"{what}: {(name.value or b'CUDA error').decode()} ({result})")


def driver_version() -> int | None:
    """The CUDA driver's version (12080 for 12.8), or None where there is no driver."""
    try:
        driver = _driver()
    except BatchedDMAUnavailable:
        return None
    version = ctypes.c_int()
    if driver.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


@functools.cache
def _batch_function() -> Any:
    driver = _driver()
    pfn = ctypes.c_void_p()
    status = ctypes.c_int()
    if hasattr(driver, "cuGetProcAddress_v2"):
        result = driver.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(pfn),
                                            _ABI_VERSION, ctypes.c_uint64(0),
                                            ctypes.byref(status))
    else:  # drivers before 12.0: no status to read
        result = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", ctypes.byref(pfn),
                                         _ABI_VERSION, ctypes.c_uint64(0))
    _check(result, "cuGetProcAddress(cuMemcpyBatchAsync)")
    if not pfn.value or status.value != 0:
        raise BatchedDMAUnavailable(
            f"the driver has no cuMemcpyBatchAsync (query status {status.value})")
    return _BATCH_SIGNATURE(pfn.value)


class BatchedDMA:
    """Batches of page copies as one ``cuMemcpyBatchAsync`` each, on one CUDA stream (a copy
    engine's): the interface of :class:`io_actors.memory.page_gather.PageGather`.

    Not thread safe: the engine calls it under its lock.  Raises BatchedDMAUnavailable at
    construction where the driver cannot run it.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        if device.type != "cuda" or device.index is None:
            raise BatchedDMAUnavailable("needs an indexed CUDA device")
        self._batch = _batch_function()
        driver = _driver()
        handle = ctypes.c_int()
        _check(driver.cuDeviceGet(ctypes.byref(handle), device.index), "cuDeviceGet")
        self._context = ctypes.c_void_p()
        # torch made the device's primary context; the driver call needs it current on the
        # calling thread, which a thread that has only run torch's runtime calls may lack.
        _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), handle),
               "cuDevicePrimaryCtxRetain")
        self._device_handle = handle
        self._stream = stream
        here = _Location(type=_LOCATION_DEVICE, id=device.index)
        self._attributes = _Attributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM,
                                       srcLocHint=here, dstLocHint=here,
                                       flags=_PREFER_OVERLAP_WITH_COMPUTE)
        self._first = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t()
        self._probe(device)

    def _probe(self, device: torch.device) -> None:
        """One copy device -> pinned host that must land: a driver that takes the call
        but moves nothing is not used."""
        src = torch.arange(1, 513, dtype=torch.int32, device=device).view(torch.uint8)
        dst = torch.zeros(src.numel(), dtype=torch.uint8, pin_memory=True)
        torch.cuda.current_stream(device).synchronize()
        self._stream.wait_stream(torch.cuda.current_stream(device))
        self.copy_addressed([(src.data_ptr(), dst.data_ptr())], src.numel())
        self._stream.synchronize()
        if not torch.equal(dst, src.cpu()):
            raise BatchedDMAUnavailable("a probe copy did not land")

    def _current(self) -> None:
        current = ctypes.c_void_p()
        driver = _driver()
        _check(driver.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != self._context.value:
            _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def copy(self, src_pool: torch.Tensor, dst_pool: torch.Tensor,
             pairs: Sequence[tuple[int, int]], page_nbytes: int) -> None:
        """Enqueue ``dst_pool[d] = src_pool[s]`` for each (s, d) in `pairs` (contiguous pools
        of `page_nbytes`-byte pages), as one batch; no destination repeats."""
        src0, dst0 = src_pool.data_ptr(), dst_pool.data_ptr()
        self.copy_addressed([(src0 + s * page_nbytes, dst0 + d * page_nbytes)
                             for s, d in pairs], page_nbytes)

    def copy_addressed(self, pairs: Sequence[tuple[int, int]], page_nbytes: int) -> None:
        """Enqueue `page_nbytes` bytes from each (source address, destination address) in
        `pairs` -- device or pinned host memory -- as one batch on the stream, in no order
        within it: no destination repeats and no copy reads bytes another one writes."""
        n = len(pairs)
        assert n
        srcs = (ctypes.c_uint64 * n)(*(src for src, _dst in pairs))
        dsts = (ctypes.c_uint64 * n)(*(dst for _src, dst in pairs))
        sizes = (ctypes.c_size_t * n)(*([page_nbytes] * n))
        self._current()
        result = self._batch(dsts, srcs, sizes, n, ctypes.byref(self._attributes),
                             self._first, 1, ctypes.byref(self._fail),
                             ctypes.c_void_p(self._stream.cuda_stream))
        _check(result, f"cuMemcpyBatchAsync of {n} copies (failed at {self._fail.value})")

    def release(self) -> None:
        """Give back the primary context reference taken at construction."""
        if self._context.value:
            driver = _driver()
            release = getattr(driver, "cuDevicePrimaryCtxRelease_v2", None) or \
                driver.cuDevicePrimaryCtxRelease
            release(self._device_handle)
            self._context = ctypes.c_void_p()
