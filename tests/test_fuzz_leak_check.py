"""The leak check of the system harnesses still catches a real leak once the process-lifetime
caches are warmed before its baseline (fuzz/memory_probe.py).

On the CPU machine the probe is the bytes of every KV pool still alive (the GPU profile uses
the CUDA allocator's count); the leak is planted: every cache that closes leaves its pools
referenced from outside.
"""

from __future__ import annotations

import logging

import attrs
import pytest
import torch

from fuzz import driver, memory_probe, planted
from fuzz.driver import Driver
from fuzz.memory_probe import live_pool_bytes
from fuzz.system_machine import SystemMachine
from tests.test_fuzz_races import BASE


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    logging.getLogger("io_actors").setLevel(logging.ERROR)


def one_cache_life() -> None:
    """Open, serve through every tier, close: the teardown's leak check runs."""
    spec = attrs.evolve(BASE, gpu=4, host=1, reserved_host=0, disk=4)
    d = Driver(spec, device="cpu", backend="posix", memory_probe=live_pool_bytes)
    try:
        first = d.fresh_prompt(None)
        d.serve(first, None, 0)
        for _ in range(3):
            d.serve(d.fresh_prompt(None), None, 0)
            driver._until_quiet(d)
        d.check_nothing_leaks()
    finally:
        d.clean_up()


def test_the_leak_check_passes_a_cache_that_gives_its_memory_back() -> None:
    one_cache_life()
    one_cache_life()


def test_the_leak_check_catches_a_cache_that_keeps_its_memory() -> None:
    one_cache_life()  # warmed: the planted leak is the only difference
    with planted.pools_kept_after_close(), pytest.raises(AssertionError,
                                                         match="GPU memory leaked"):
        one_cache_life()


def test_the_warm_up_runs_once_per_process_and_shape() -> None:
    one_cache_life()
    spec = attrs.evolve(BASE, gpu=4, host=1, reserved_host=0, disk=4)
    assert not driver.warm_up(spec, "cpu", "posix")


def test_a_cache_closed_mid_work_is_not_counted_against_the_next_one() -> None:
    """close_with_work_in_flight opens a fresh cache: the closed one must be unreachable by
    then, or the fresh cache's baseline counts its pools and the teardown's check sees memory
    "given back" (the GPU profile's "leaked: -32768 bytes")."""
    one_cache_life()  # warmed
    m = SystemMachine()
    m.memory_probe = live_pool_bytes
    m.open(attrs.evolve(BASE, gpu=4, host=1, reserved_host=0, disk=1))
    m.close_with_work_in_flight()
    m.close_with_work_in_flight()
    m.system_agrees_with_the_spec()
    m.teardown()


def test_a_reopened_cache_is_held_to_the_first_caches_baseline() -> None:
    """Each cache of an example must give back what it took: a cache reopened after a close
    keeps the example's first baseline (measured once, since each measurement collects
    garbage), so a leak of any closed cache is still seen at the teardown."""
    one_cache_life()  # warmed
    m = SystemMachine()
    m.memory_probe = live_pool_bytes
    m.open(attrs.evolve(BASE, gpu=4, host=1, reserved_host=0, disk=1))
    first = m.d.gpu_memory_at_start
    m.close_with_work_in_flight()
    assert m.d.gpu_memory_at_start == first
    assert m.d.cache is not None
    kept = m.d.cache.kv_pool  # the second cache's GPU pool outlives it
    m.close_with_work_in_flight()
    m.system_agrees_with_the_spec()
    with pytest.raises(AssertionError, match="GPU memory leaked: 32768 bytes"):
        m.teardown()
    del kept


def test_a_leak_report_names_what_holds_the_tensor() -> None:
    """The leak check's report says who keeps device memory alive (here a CPU tensor
    kept by an object of a class only this test has)."""
    class Keeper:
        def __init__(self) -> None:
            self.kept = torch.zeros(123_457, dtype=torch.uint8)

    keeper = Keeper()
    report = memory_probe.tensor_holders("cpu", min_bytes=123_457, limit=50)
    assert "(123457,) torch.uint8, storage of 123457 bytes" in report
    assert "Keeper" in report.split("(123457,)")[1]
    del keeper
