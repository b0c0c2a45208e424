"""Device memory for the leak check: what is measured, and what is made to exist first.

:meth:`fuzz.driver.Driver.check_nothing_leaks` compares the device memory held after a cache
closed with what was held before it opened.  Some device memory is held for the life of the
*process*, not of a cache, and appears the first time a path runs:

* the CRC tables of the device checksum (``io_actors.storage.slot_format._crc_device_tables``, an
  ``lru_cache`` of up to 16 entries, one per device, payload size and slot format version),
  built by the first read the kvikio store verifies on the GPU;
* whatever torch creates on first use and keeps -- per-thread CUDA handles and the
  workspaces it allocates through the caching allocator, the caching allocator's own state.

Measured from a cold process, the first example's cache would be charged for all of that
(the GPU profile failed its first example, ``open -> teardown``, and passed the replay: a
flaky failure, not a leak).  So before the first baseline of a process,
:func:`fuzz.driver.warm_up` runs one whole cache life of the same block size on the same
device and store -- a block spilled to disk and read back (the device checksum runs on that
read with kvikio, and once more on a payload of that size in any case), close -- and the
baseline is measured after it.  A real leak (anything a cache keeps after it closed) is
still a leak of every cache, the first one after warming included.  The warm-up lives with
the Driver it runs; this module only measures, so the two do not import each other.

The probe is a function, so that the check runs on the CPU machine too
(:func:`live_pool_bytes`), with the leak it must catch planted in a test.
"""

from __future__ import annotations

import gc
import logging
import sys
import types
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

MemoryProbe = Callable[[], int]
"""Bytes of device memory held now."""



def cuda_memory_probe() -> int:
    """Bytes held by live tensors in the CUDA caching allocator (not what it keeps reserved
    for reuse): what a cache that closed must give back."""
    # Garbage of earlier caches (reference cycles) must go before a baseline, not during the
    # cache measured against it: the GPU profile once saw 32 KiB *less* held after a close.
    gc.collect()
    torch.cuda.synchronize()
    # A tensor freed after record_stream() (the checksum kernel's address and index arrays)
    # stays counted as allocated until the caching allocator processes its stream's events,
    # which it does lazily, at a later allocation; empty_cache() processes them now.
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


def tensor_holders(device_type: str = "cuda", *, limit: int = 6, depth: int = 4,
                   min_bytes: int = 0) -> str:
    """What keeps each live tensor on `device_type` alive, as chains of referrers (type names, and
    file:line for frames), for a leak report: the leak check says how many bytes, this says
    who holds them.  A tensor with no Python referrer is held from C++ (torch, kvikio)."""
    gc.collect()
    here = sys._getframe()
    found = [obj for obj in gc.get_objects()
             if type(obj) in (torch.Tensor, torch.nn.Parameter)
             and obj.device.type == device_type
             and obj.untyped_storage().nbytes() >= min_bytes]
    lines = [f"{len(found)} {device_type} tensors alive"]
    for tensor in found[:limit]:
        storage = tensor.untyped_storage()
        lines.append(f"* {tuple(tensor.shape)} {tensor.dtype}, storage of {storage.nbytes()} "
                     f"bytes at {storage.data_ptr():#x}, held by:")
        lines.extend(_referrers(tensor, depth, {id(found), id(here), id(lines)}, "    "))
    del found
    return "\n".join(lines)


def _referrers(obj: object, depth: int, skip: set[int], indent: str) -> list[str]:
    out: list[str] = []
    if depth == 0:
        return out
    for ref in gc.get_referrers(obj):
        # Modules, and the lists of every object that gc.get_objects() returns elsewhere.
        if id(ref) in skip or isinstance(ref, types.ModuleType) or (
                isinstance(ref, list) and len(ref) > 10_000):
            continue
        skip.add(id(ref))
        if isinstance(ref, types.FrameType):
            name = f"frame {ref.f_code.co_filename}:{ref.f_lineno} {ref.f_code.co_name}"
        else:
            name = f"{type(ref).__module__}.{type(ref).__qualname__}"
        out.append(indent + name)
        out.extend(_referrers(ref, depth - 1, skip, indent + "  "))
        if len(out) > 40:
            out.append(indent + "...")
            break
    return out


def live_pool_bytes() -> int:
    """Bytes of every KV pool tensor still alive, anywhere (any device): the CPU machine's
    probe for a cache whose memory outlives it.  A pool is the one 6-D tensor of its storage
    ([pages, layers, K/V, block size, heads, head dim]); a closed cache gives its own
    references to it back, so a pool still alive is one somebody kept."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some of torch's module objects warn when asked for
        # their class.
        if type(obj) is torch.Tensor and obj._base is None and obj.dim() == _POOL_DIMS:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


_POOL_DIMS = len(("pages", "layers", "K/V", "block size", "heads", "head dim"))
