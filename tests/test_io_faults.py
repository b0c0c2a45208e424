"""I/O faults injected at the backend seam, through the whole actor stack.

SQLite-style: a counting run learns how many writes and reads a scenario makes, then the
scenario runs again once for every (fault kind, call number), failing exactly that call.
After each run: no request was ever handed bytes other than those computed for its prefix,
every failure was counted, a request whose read failed fell back to recompute, and the cache
still serves afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from io_actors.embed import BlockingCache
from io_actors.storage.faults import Fault, FaultPlan, FaultRule, FaultyStore, Op
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.slot_format import SlotMeta
from statekv.ids import BlockHash, SlotId
from tests.harness import block_keys
from tests.io_helpers import check_pages, compute, serve, small_config, wait_quiet, wait_ready

PROMPT = list(range(9))  # two full blocks of 4, then one token


class KeyLog:
    """Passes calls through to a store and remembers the key of every write, in order."""

    def __init__(self, inner: SlotStore) -> None:
        self.inner = inner
        self.written: list[BlockHash] = []

    @property
    def device_reads(self) -> bool:
        return False

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        self.written.append(key)
        self.inner.write(slot, key, src, meta)

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        self.inner.read(slot, key, dst)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        self.written += [item.key for item in writes]
        return self.inner.write_many(writes)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        return self.inner.read_many(reads)

    def discard(self, slot: SlotId) -> None:
        self.inner.discard(slot)

    def close(self) -> None:
        self.inner.close()


PROMPT_KEYS = set(block_keys(PROMPT, 4))


def scenario(tmp_path: Path, plan: FaultPlan) -> tuple[FaultyStore, dict[str, int]]:
    """Cache PROMPT, push it to disk, read it back; return what the run observed."""
    config = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16, writers=1,
                          readers=1)
    core = config.core_config()
    directory = config.rank_directory()
    assert directory is not None
    store = FaultyStore(PosixSlotStore(directory, core), plan)
    log = KeyLog(store)
    try:
        with BlockingCache(config, store=log) as cache:
            serve(cache, "first", PROMPT)
            wait_quiet(cache)
            for i in range(2):
                serve(cache, f"churn{i}", [1000 + 100 * i + t for t in range(9)])
                wait_quiet(cache)
            match = cache.add_request("again", PROMPT)
            wait_ready(cache, "again")
            status = cache.request_status("again")
            # Whatever the cache says is computed must be exactly what was computed.
            check_pages(cache, "again", PROMPT, status.num_computed_tokens // 4)
            compute(cache, "again", PROMPT)
            check_pages(cache, "again", PROMPT, 2)
            cache.release("again")
            wait_quiet(cache)
            # The cache keeps serving afterwards.
            serve(cache, "after", [7, 7, 7, 7, 8, 8, 8, 8, 9])
            wait_quiet(cache)
            cache.check_invariants()
            stats = cache.statistics().cache
            faulted = [int(item.split("#")[1].split(":")[0])
                       for item in store.statistics().injected if item.startswith("write")]
            observed = {
                "faulted_prompt_write": int(any(
                    log.written[k - 1] in PROMPT_KEYS for k in faulted)),
                "disk_tokens": match.disk_tokens,
                "io_errors": stats.io_errors,
                "spill_failures": stats.spill_failures,
                "onboard_failures": stats.onboard_failures,
                "fallbacks": stats.requests_fallen_back,
                "onboards_completed": stats.onboards_completed,
            }
    finally:
        store.close()
    return store, observed


def counted(tmp_path: Path) -> tuple[int, int, dict[str, int]]:
    store, observed = scenario(tmp_path / "count", FaultPlan())
    return store.calls(Op.WRITE), store.calls(Op.READ), observed


def test_the_counting_run_spills_and_onboards(tmp_path: Path) -> None:
    writes, reads, observed = counted(tmp_path)
    assert writes >= 2 and reads == 2
    assert observed["disk_tokens"] == 8
    assert observed["io_errors"] == 0


WRITE_FAULTS = [Fault.EIO, Fault.ENOSPC, Fault.SHORT_WRITE, Fault.TORN_WRITE,
                Fault.TORN_WRITE_SILENT, Fault.BIT_FLIP, Fault.EIO_OPEN]
READ_FAULTS = [Fault.EIO, Fault.SHORT_READ, Fault.EIO_OPEN]
SILENT = {Fault.TORN_WRITE_SILENT, Fault.BIT_FLIP}


@pytest.mark.parametrize("fault", WRITE_FAULTS, ids=lambda f: f.value)
def test_every_write_fault_is_caught_and_never_served(tmp_path: Path, fault: Fault) -> None:
    writes, _reads, _ = counted(tmp_path)
    for k in range(1, writes + 1):
        plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=fault, nth=k),), seed=k)
        _store, seen = scenario(tmp_path / f"w{k}", plan)
        if fault in SILENT:
            # The write said yes; the bytes on disk are wrong.  Only a read can tell, and
            # the checksum must: a read of that slot fails and the request falls back.
            if seen["faulted_prompt_write"] and seen["disk_tokens"]:
                assert seen["onboard_failures"] >= 1, (fault, k, seen)
        else:
            assert seen["spill_failures"] == 1, (fault, k, seen)
        assert seen["fallbacks"] == seen["onboard_failures"], (fault, k, seen)


@pytest.mark.parametrize("fault", READ_FAULTS, ids=lambda f: f.value)
def test_every_read_fault_falls_back_to_recompute(tmp_path: Path, fault: Fault) -> None:
    _writes, reads, _ = counted(tmp_path)
    for k in range(1, reads + 1):
        plan = FaultPlan(rules=(FaultRule(op=Op.READ, fault=fault, nth=k),), seed=k)
        _store, seen = scenario(tmp_path / f"r{k}", plan)
        assert seen["onboard_failures"] == 1, (fault, k, seen)
        assert seen["io_errors"] == 1
        assert seen["fallbacks"] == 1
        assert seen["onboards_completed"] == reads - 1


def test_a_disk_that_fails_every_write_keeps_content_on_host(tmp_path: Path) -> None:
    plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=Fault.ENOSPC, nth=1, onward=True),))
    _store, seen = scenario(tmp_path, plan)
    assert seen["spill_failures"] >= 1
    assert seen["disk_tokens"] == 0
    assert seen["onboard_failures"] == 0
