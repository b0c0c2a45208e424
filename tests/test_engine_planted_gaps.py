"""Guarantees of statekv.engine_tiers and the vLLM connector that no test pinned down: each
bug of fuzz/planted_engine.py that these tests name survived the suites without them.

Each test is written from the guarantee (the module's docstring, README "Using statekv under
vLLM"), and passes on the real code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest
import torch

from io_actors.config import StateKVConfig
from io_actors.vllm.plans import TransferReport, WorkerReport
from io_actors.vllm.scheduler_side import SchedulerSide
from io_actors.vllm.settings import connector_config
from io_actors.vllm.worker_side import MANIFEST
from statekv.errors import ConfigError
from statekv.ids import TransferId
from statekv.lifecycle import BlockState
from statekv.messages import PersistRetention, WriteSlots
from tests.engine_harness import EngineHarness, engine_config
from tests.test_connector_machine import BS, INSTANCE, LAYOUT, PREFIXES, ConnectorMachine, HeldPool

S = BlockState


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


# ---------------------------------------------------------------------- statekv.engine_tiers


def test_a_host_hit_is_the_last_host_block_evicted() -> None:
    # A block copied out to the engine (COPIED_OUT) is the newest of the host order: the
    # next page a save needs is taken from the block nobody asked for since.
    h = EngineHarness(engine_config(host_blocks=2, reserved_host_blocks=0, disk_blocks=0))
    a, b, c = tokens(h.bs + 1), tokens(h.bs + 1, 100), tokens(h.bs + 1, 200)
    for n, t in enumerate((a, b)):
        h.compute(t, [n])
        h.save(t[: h.bs], [n])
    assert h.tiers.lookup(a, start_block=0).host_blocks == 1
    h.load("r", a, 0, [9])                      # `a` is asked for: `b` is now the coldest
    h.compute(c, [2])
    h.save(c[: h.bs], [2])                      # needs a page: evicts one block
    assert h.tiers.lookup(a, start_block=0).num_blocks == 1
    assert h.tiers.lookup(b, start_block=0).num_blocks == 0
    h.tiers.check_invariants()


def test_saving_a_block_the_tiers_hold_stamps_its_ttl() -> None:
    # "blocks already held are only stamped with the request's TTL": on disk that makes
    # them retained, and the deadline is persisted with the slot.
    h = EngineHarness(write_through="all")
    a = tokens(2 * h.bs + 1)
    h.compute(a, [0, 1])
    h.save(a[: 2 * h.bs], [0, 1])
    h.drain()
    assert h.tiers.statistics().disk_retained_blocks == 0
    out = h.tiers.save(a[: 2 * h.bs], engine_pages=[5, 6], now=h.now, ttl_seconds=60)
    assert (out.saved_blocks, out.cached_blocks) == (0, 2)
    assert h.tiers.statistics().disk_retained_blocks == 2
    persisted = [c for c in h.tiers.take_commands() if isinstance(c, PersistRetention)]
    assert [c.expiry for c in persisted] == [h.now + 60] * 2
    h.tiers.check_invariants()


# ---------------------------------------------------------------------- the scheduler side


def _config(tmp_path: Path, **extra: object) -> StateKVConfig:
    return connector_config(
        {"host": 3, "reserved_host": 1, "disk": 8, "disk_dir": str(tmp_path),
         "model_fingerprint": "fuzz-model", **extra},
        layout=LAYOUT, block_size=BS, gpu_blocks=16, rank=0, default_fingerprint="x")


def _manifest(config: StateKVConfig, rank: int, blocks: list[list[object]],
              instance: str = INSTANCE) -> None:
    directory = attrs.evolve(config, rank=rank).rank_directory()
    assert directory is not None
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps({"instance": instance, "blocks": blocks}))


def _entry(slot: int, key: int) -> list[object]:
    return [slot, bytes([key]).hex() * 32, bytes([0]).hex() * 32, 0, 0, None, 900.0, slot + 1]


def test_a_block_one_rank_lacks_is_not_restored(tmp_path: Path) -> None:
    # Each rank stores its shard of a block: a block is restored only when every rank holds
    # it in the same slot.
    config = _config(tmp_path)
    _manifest(config, 0, [_entry(0, 1), _entry(1, 2)])
    _manifest(config, 1, [_entry(0, 1)])
    sched = SchedulerSide(config, world_size=2, instance=INSTANCE, clock=lambda: 1000.0)
    assert list(sched.core.cached_keys()) == [bytes([1]) * 32]
    sched.core.check_invariants()


def test_a_manifest_of_another_engine_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _manifest(config, 0, [_entry(0, 1)], instance="someone-else")
    with pytest.raises(ConfigError, match="another engine"):
        SchedulerSide(config, world_size=1, instance=INSTANCE, clock=lambda: 1000.0)


def one_rank(tid: TransferId, failure: str | None) -> WorkerReport:
    return WorkerReport(outcomes={tid: TransferReport(ranks=1, failure=failure)})


def test_a_write_is_applied_only_once_every_rank_reported(tmp_path: Path) -> None:
    # A transfer is applied once every rank reported it; a failure on any rank fails it.
    config = _config(tmp_path)
    for rank in (0, 1):
        _manifest(config, rank, [])
    sched = SchedulerSide(config, world_size=2, instance=INSTANCE, clock=lambda: 1000.0)
    assert sched.finished("x", tokens(BS), [0], None, cache_salt=None, lora_id=None)[0]
    plan = sched.plan(num_new_tokens=1, longest_context=1)
    (write,) = [w for c in plan.commands if isinstance(c, WriteSlots) for w in c.writes]
    sched.reported(one_rank(write.transfer, None))
    assert sched.statistics().writes_in_flight == 1    # rank 1 has not reported
    sched.reported(one_rank(write.transfer, "rank 1's disk failed"))
    stats = sched.statistics()
    assert (stats.writes_in_flight, stats.spill_failures, stats.spills_completed) == (0, 1, 0)
    sched.core.check_invariants()


# ---------------------------------------------------------------------- the worker side


def test_a_failed_read_leaves_the_engine_page_untouched() -> None:
    # "A read that fails writes nothing into the engine's pages": its page is reported in
    # the load errors and keeps what it held.
    m = ConnectorMachine()
    try:
        tokens_ = [*PREFIXES[0][:8], 0]
        readers, writers = m.worker._readers, m.worker._writers
        assert isinstance(readers, HeldPool) and isinstance(writers, HeldPool)
        m.end(m.add(tokens_))
        for prefix in PREFIXES[1:]:             # push `tokens_`' blocks off the host tier
            m.step()
            writers.run_all()
            m.end(m.add([*prefix[:8], 0]))
        m.step()
        writers.run_all()
        m.step()
        req = m.add(tokens_)
        assert req.state == "loading"
        m.step()                                 # the reads are submitted, held
        assert readers.jobs
        page = req.pages[0]
        before = m._page(page).clone()
        store = m.worker.store
        store.fail_mask = 1                      # type: ignore[union-attr]
        readers.run(0)
        m.worker.finished(set())
        assert page in m.worker.load_errors()
        assert torch.equal(m._page(page), before), "a failed read wrote into the page"
        readers.run_all()
        writers.run_all()
    finally:
        m.worker.close()
        shutil.rmtree(m.dir, ignore_errors=True)


# ---------------------------------------------------------------------- found by the machine


def test_content_whose_read_failed_is_not_restored_by_a_restart_before_its_last_read() -> None:
    # "A read that fails takes the content out of the cache at once (no later lookup finds
    # it)."  The engine-tiers machine found this sequence (its database replayed it): two
    # reads of one block, the first fails, the process restarts with the second in flight.
    h = EngineHarness(engine_config(host_blocks=1, reserved_host_blocks=1, disk_blocks=2),
                      write_through="all")
    a = tokens(h.bs + 1)
    h.compute(a, [0])
    h.save(a[: h.bs], [0])
    h.land_write()
    h.restart()
    h.load("r1", a, 0, [1])
    h.load("r2", a, 0, [2])
    h.land_load(0, ok=False)
    assert h.tiers.lookup(a, start_block=0).num_blocks == 0
    h.restart()
    assert h.tiers.lookup(a, start_block=0).num_blocks == 0
