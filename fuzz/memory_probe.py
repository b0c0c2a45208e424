"""Device memory for the leak check: what is measured, and what is made to exist first.

:meth:`fuzz.driver.Driver.check_nothing_leaks` compares the device memory held after a cache
closed with what was held before it opened.  Some device memory is held for the life of the
*process*, not of a cache, and appears the first time a path runs:

* the CRC tables of the device checksum (``io_actors.slot_format._crc_device_tables``, an
  ``lru_cache`` of up to 16 entries, one per device and payload size), built by the first
  read the kvikio store verifies on the GPU;
* whatever torch creates on first use and keeps -- per-thread CUDA handles and the
  workspaces it allocates through the caching allocator, the caching allocator's own state.

Measured from a cold process, the first example's cache would be charged for all of that
(the GPU profile failed its first example, ``open -> teardown``, and passed the replay: a
flaky failure, not a leak).  So before the first baseline of a process, :func:`warm_up` runs
one whole cache life of the same block size on the same device and store -- a block spilled
to disk and read back (the device checksum runs on that read with kvikio, and once more on
a payload of that size in any case), close -- and the baseline is measured after it.  A real
leak (anything a cache keeps after it closed) is still a leak of every cache, the first one
after warming included.

The probe is a function, so that the check runs on the CPU machine too
(:func:`live_pool_bytes`), with the leak it must catch planted in a test.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from io_actors.memory import KVPools
from io_actors.slot_format import payload_checksum_torch
from statekv.config import SpillMode

if TYPE_CHECKING:
    from fuzz.driver import Driver, SystemSpec

log = logging.getLogger(__name__)

MemoryProbe = Callable[[], int]
"""Bytes of device memory held now."""

WARM_TIMEOUT = 30.0
"""Seconds the warm-up's transfers may take to land."""

_warmed: set[tuple[str, str, int]] = set()


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


def live_pool_bytes() -> int:
    """Bytes of the GPU pools of every KV pool still alive (any device): the CPU machine's
    probe for a cache whose memory outlives it."""
    gc.collect()
    return sum(obj.gpu.untyped_storage().nbytes() for obj in gc.get_objects()
               # type(), not isinstance(): some of torch's module objects warn when asked
               # for their class.
               if type(obj) is KVPools)


def warm_up(spec: SystemSpec, device: str, backend: str) -> bool:
    """Run one whole cache life of `spec`'s shape on `device` over `backend`, once per
    process for each (device, backend, block size); True if it ran now."""
    from fuzz.driver import Driver  # which calls this before it measures

    shape = attrs.evolve(spec, spill_mode=SpillMode.ALL, drop_on_pressure=False,
                         protect_unexpired=False)
    d = Driver(shape, device=device, backend=backend, warm=False)
    key = (device, backend, d.payloads.nbytes)
    if key in _warmed:
        d.clean_up()
        return False
    try:
        payload_checksum_torch(torch.zeros(d.payloads.nbytes, dtype=torch.uint8,
                                           device=d.api.device))
        first = d.fresh_prompt(1)  # one block: it fits the smallest host tier
        d.serve(first, None, 0)
        # Push it down the tiers (GPU -> host copies, spills) without displacing it from
        # the disk, then read it back.
        for _ in range(2):
            d.serve(d.fresh_prompt(None), None, 0)
            _until_quiet(d)
        req = d.add(first, None, 0, None)
        if req is not None:
            d.api.wait_ready(req.rid, timeout=WARM_TIMEOUT)
            _until_quiet(d)
            d.release(req.rid)
        _until_quiet(d)
        stats = d.api.statistics().cache
        log.debug("warm-up: %d spills, %d onboards", stats.spills_completed,
                  stats.onboards_completed)
        d.api.close(drain=True)
    finally:
        d.clean_up()
    _warmed.add(key)
    return True


def _until_quiet(d: Driver) -> None:
    deadline = time.monotonic() + WARM_TIMEOUT
    while True:
        stats = d.api.statistics()
        if not (stats.cache.writes_in_flight or stats.cache.reads_in_flight):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the warm-up's transfers did not land: {stats}")
        time.sleep(0.001)
