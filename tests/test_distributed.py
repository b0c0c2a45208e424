"""Tensor-parallel ranks agree (io_actors.tensor_parallel): real processes, gloo, real disk.

Each job starts 2 or 4 processes that rendezvous through a file store and run, in order:

1. refusals -- unsupported layouts and mismatched configurations, one rank at a time
   refusing: every rank must get the ConfigError, quickly, nobody left in a collective;
2. agreement -- bench.tp_check's cache scenario: random per-rank read and write delays, a
   read failing on rank 1 and a write on rank 0, per-rank skewed clocks;
3. serving -- the serving loop over the model with its heads split across the ranks;
4. no disk tier (no collective per step), a draft and a target cache side by side;
5. a rank that hangs (2 ranks) and a rank that dies: the others fail with RankGroupFailed
   and shut down cleanly.

Every rank writes its findings to ``rank_<r>.json`` after each phase; the tests compare the
ranks' records in this process.  Workers are forked from a forkserver that imported torch
once (an import costs seconds on a busy 2-core machine); each job has a hard deadline and
its processes are killed past it, so nothing here can hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch.distributed as dist

from bench import tp_check
from io_actors.config import StateKVConfig
from io_actors.tensor_parallel.agreement import (
    ParallelLayout,
    RankGroup,
    RankGroupFailed,
    TensorParallelCache,
    _LockstepGate,
    draft_config,
)
from models.model import PagedDecoder
from models.serving_loop import ServeRequest, ServingLoop
from statekv.config import KVLayout
from statekv.errors import ConfigError, OutOfBlocks
from statekv.ids import TransferId
from statekv.messages import SlotRead, SlotReadFailed, SlotWriteFailed, SlotWritten

JOB_DEADLINE_S = {2: 150.0, 4: 240.0}
"""Hard limits per job (generous: the machine is shared); a job past it is killed."""
DEATH_TIMEOUT_S = 30.0
"""The dying rank's group timeout: detection must come far sooner, from closed sockets."""
STALL_TIMEOUT_S = 2.0

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "bench.tp_check",
                             "tests.test_distributed"])


# ---------------------------------------------------------------------------- in the workers


class _Out:
    """One rank's findings, rewritten after every phase (a rank that dies keeps its past)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def _refusal(make: Callable[[], object]) -> list[Any] | None:
    """[field, message, seconds] of the ConfigError `make` raised; None if it raised none."""
    started = time.monotonic()
    try:
        made = make()
    except ConfigError as exc:
        return [exc.field, str(exc), time.monotonic() - started]
    if isinstance(made, RankGroup | TensorParallelCache):
        made.close()
    return None


def _small_config(world: int, disk_dir: Path, **changes: Any) -> StateKVConfig:
    args: dict[str, Any] = {
        "layout": tp_check.TINY.kv_layout(world), "block_size": 4, "gpu": 16, "host": 2,
        "reserved_host": 1, "disk": 16, "disk_dir": disk_dir, "device": "cpu",
        "model_fingerprint": "tiny-tp-test",
    }
    args.update(changes)
    if not args["disk"]:
        args["reserved_host"] = 0  # reserved pages serve spills: only with a disk tier
    return StateKVConfig(**args)


def _phase_refusals(out: _Out, rank: int, world: int, tmp: Path) -> None:
    last = world - 1
    found = {
        "pipeline_parallel": _refusal(lambda: RankGroup(ParallelLayout(
            tensor_parallel=world, pipeline_parallel=2 if rank == 1 else 1))),
        "attention_dp": _refusal(lambda: RankGroup(ParallelLayout(
            tensor_parallel=world, attention_dp=True))),
        "tensor_parallel": _refusal(lambda: RankGroup(ParallelLayout(
            tensor_parallel=world + 1))),
    }
    with RankGroup(ParallelLayout(tensor_parallel=world)) as group:
        found["disk_blocks"] = _refusal(lambda: TensorParallelCache(
            _small_config(world, tmp, disk=0 if rank == last else 16, namespace="mismatch"),
            group))
        found["rank"] = _refusal(lambda: TensorParallelCache(
            _small_config(world, tmp, rank=world + 5 if rank == 0 else 0, namespace="rank"),
            group))
        found["remote_url"] = _refusal(lambda: TensorParallelCache(attrs.evolve(
            _small_config(world, tmp, namespace="remote"), remote_url="redis://127.0.0.1:1",
            remote_secret=b"s" * 16),
            group))
        # Refused caches left nothing behind: the same directories open now.
        with TensorParallelCache(_small_config(world, tmp, namespace="mismatch"), group) as tp:
            tp.sync()
        found["group_still_works"] = [group.statistics().failure is None]
    out.put("refusals", found)


def _phase_no_disk_and_draft(out: _Out, rank: int, world: int, tmp: Path,
                             group: RankGroup) -> None:
    # Without a disk tier the serving loop runs with no agreement collective at all.
    model = tp_check.TINY
    with TensorParallelCache(_small_config(world, tmp, gpu=32, disk=0, namespace="nodisk"),
                             group) as tp:
        before = group.statistics().collectives
        net = PagedDecoder(model, tp_rank=rank, tp_size=world,
                           all_reduce=group.model_all_reduce)
        loop = ServingLoop(net, tp.cache, clock=tp.clock, ready_everywhere=tp.ready_everywhere)
        for i in range(4):
            loop.submit(ServeRequest(request_id=f"n{i}", prompt=tuple(range(3 * i, 3 * i + 9)),
                                     max_new_tokens=3))
        outputs = {res.request_id: res.output for res in loop.drain(timeout=120)}
        out.put("no_disk", {"collectives": group.statistics().collectives - before,
                            "steps": loop.statistics().steps, "outputs": outputs,
                            "lockstep": tp.lockstep})

    # A draft model's cache next to the target's, sharing disk_dir, both spilling.
    shared = tmp / "shared"
    target = _small_config(world, shared, gpu=6, host=1, reserved_host=1, disk=24)
    draft = draft_config(target, layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=32,
                                                  dtype="float32"))
    spills = {}
    with TensorParallelCache(target, group) as target_tp, \
            TensorParallelCache(draft, group) as draft_tp:
        duplicate = _refusal(lambda: TensorParallelCache(attrs.evolve(draft, gpu=5), group))
        for name, tp in (("target", target_tp), ("draft", draft_tp)):
            for i in range(10):
                # The same prompts for both: the same block keys, different slot files.
                _compute(tp, f"d{i}", [i * 100 + j for j in range(8)])
            tp.quiesce()
            tp.check_agreement()
            spills[name] = tp.cache.statistics().cache.spills
    files = sorted(str(p.relative_to(shared)) for p in shared.rglob("*") if p.is_file())
    out.put("draft", {"duplicate": duplicate, "files": files,
                      "target_spills": spills["target"], "draft_spills": spills["draft"]})


def _compute(tp: TensorParallelCache, rid: str, tokens: list[int]) -> None:
    """One request's step on every rank: add it, agree until its blocks landed everywhere,
    compute (allocate, commit) and release it."""
    cache = tp.cache
    cache.add_request(rid, tokens)
    while True:
        ready = tp.ready_everywhere([rid])  # collective: every rank loops as often
        if ready:
            break
        time.sleep(0.001)
    cache.allocate_nowait(rid, len(tokens))
    cache.commit(rid, len(tokens))
    cache.release(rid)


def _phase_failure(out: _Out, key: str, rank: int, world: int, tmp: Path, *,
                   timeout_s: float, fail: Callable[[int], None]) -> None:
    """Run steps until the group fails; `fail(step)` misbehaves on the chosen rank."""
    record: dict[str, Any] = {"error": None}
    group = RankGroup(ParallelLayout(tensor_parallel=world), timeout_s=timeout_s)
    config = _small_config(world, tmp, namespace=key)
    store = tp_check.make_store(attrs.evolve(config, rank=rank), seed=rank, max_read_s=0.004,
                                max_write_s=0.004)
    tp = TensorParallelCache(config, group, store=store)
    last_ok = time.monotonic()
    try:
        for step in range(200):
            fail(step)
            with contextlib.suppress(OutOfBlocks):
                _compute(tp, f"f{step}", [step % 7 * 50 + j for j in range(6)])
            last_ok = time.monotonic()
            time.sleep(0.002)
    except RankGroupFailed as exc:
        record["error"] = [type(exc).__name__, str(exc)]
        record["detected_after_s"] = time.monotonic() - last_ok
        started = time.monotonic()
        try:
            tp.sync()
        except RankGroupFailed:
            record["again_after_s"] = time.monotonic() - started
    finally:
        started = time.monotonic()
        report = tp.close()
        group.close()
        store.close()
        record["close_s"] = time.monotonic() - started
        record["close_report"] = None if report is None else attrs.asdict(report)
    out.put(key, record)


def _rank_main(rank: int, world: int, tmp: str) -> None:
    """One rank of a job (the forkserver's child)."""
    root = Path(tmp)
    out = _Out(root / f"rank_{rank}.json")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        _phase_refusals(out, rank, world, root)
        with RankGroup(ParallelLayout(tensor_parallel=world),
                       time_source=tp_check.SkewedClock(rank)) as group:
            out.put("agreement", tp_check.run_agreement(
                group, root, device="cpu", drop_on_pressure=world == 4))
            out.put("serving", tp_check.run_serving(group, root, device="cpu"))
            _phase_no_disk_and_draft(out, rank, world, root, group)
        last = world - 1

        if world == 2:
            def stall(step: int) -> None:
                if rank == last and step == 5:
                    time.sleep(STALL_TIMEOUT_S + 2.5)

            _phase_failure(out, "stall", rank, world, root, timeout_s=STALL_TIMEOUT_S,
                           fail=stall)

        def die(step: int) -> None:
            if rank == last and step == 8:
                os._exit(7)

        _phase_failure(out, "death", rank, world, root, timeout_s=DEATH_TIMEOUT_S, fail=die)
        out.put("finished", True)
    except BaseException:
        out.put("crash", traceback.format_exc())
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- the jobs


@attrs.frozen
class Job:
    world: int
    exit_codes: tuple[int | None, ...]
    records: tuple[dict[str, Any], ...]
    seconds: float


def _run_job(world: int, tmp: Path) -> Job:
    started = time.monotonic()
    procs = [_CTX.Process(target=_rank_main, args=(r, world, str(tmp)), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = started + JOB_DEADLINE_S[world]
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    records = []
    for r in range(world):
        path = tmp / f"rank_{r}.json"
        records.append(json.loads(path.read_text()) if path.exists() else {})
    for r, rec in enumerate(records):
        assert "crash" not in rec, f"rank {r} crashed:\n{rec['crash']}"
    assert not hung, f"ranks {hung} still ran after {JOB_DEADLINE_S[world]} s: killed"
    return Job(world, tuple(p.exitcode for p in procs), tuple(records),
               time.monotonic() - started)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Job]:
    world: int = request.param
    yield _run_job(world, tmp_path_factory.mktemp(f"tp{world}"))


# ---------------------------------------------------------------------------- the tests


def test_every_rank_refuses_an_unsupported_layout_or_a_mismatched_config(job: Job) -> None:
    for rank, rec in enumerate(job.records):
        found = rec["refusals"]
        for field in ("pipeline_parallel", "attention_dp", "tensor_parallel", "disk_blocks",
                      "rank", "remote_url"):
            refusal = found[field]
            assert refusal is not None, f"rank {rank} accepted a bad {field}"
            assert refusal[0] == field, f"rank {rank}: {refusal}"
            assert refusal[2] < 20.0, f"rank {rank} took {refusal[2]:.1f} s to refuse {field}"
        # Only rank 1 asked for pipeline parallelism: the others learn it from the exchange.
        assert ("refused on rank 1" in found["pipeline_parallel"][1]) == (rank != 1)
        assert found["group_still_works"] == [True]


def test_ranks_take_identical_decisions_under_random_read_delays(job: Job) -> None:
    records = [rec["agreement"] for rec in job.records]
    first = records[0]
    for rank, rec in enumerate(records[1:], start=1):
        for key in ("steps", "stats", "blocks"):
            assert rec[key] == first[key], f"rank {rank} differs from rank 0 in {key}"
    stats = first["stats"]
    # The scenario exercised what could diverge: onboards, parking, spills, I/O failures.
    assert stats["onboards"] >= 5 and stats["requests_parked"] >= 3 and stats["spills"] >= 10
    assert any(block[4] is not None for block in first["blocks"])  # retention stamps
    # Delays made ranks land completions at different steps, and the agreement held them.
    assert sum(rec["agreement"]["held_over"] for rec in records) > 0
    assert all(rec["bad_pages"] == 0 for rec in records)
    assert all(rec["clock_monotonic"] for rec in records)


def test_a_transfer_failed_on_one_rank_is_failed_on_every_rank(job: Job) -> None:
    records = [rec["agreement"] for rec in job.records]
    for rec in records:
        assert rec["stats"]["onboard_failures"] == 1 and rec["stats"]["spill_failures"] == 1
        assert rec["stats"]["requests_fallen_back"] >= 1
    # Rank 1 failed a read, rank 0 a write; every other rank applied each as failed.
    assert sum(rec["agreement"]["failed_elsewhere"] for rec in records) == 2 * (job.world - 1)


def test_the_head_split_serving_loop_runs_identical_batches_on_every_rank(job: Job) -> None:
    records = [rec["serving"] for rec in job.records]
    first = records[0]
    for rank, rec in enumerate(records[1:], start=1):
        for key in ("batches", "outputs", "results", "stats", "blocks"):
            assert rec[key] == first[key], f"rank {rank} differs from rank 0 in {key}"
    assert first["stats"]["hit_blocks_disk"] > 0 and first["stats"]["requests_parked"] > 0
    assert len(first["outputs"]) == 18


def test_no_collective_runs_per_step_without_a_disk_tier(job: Job) -> None:
    records = [rec["no_disk"] for rec in job.records]
    for rec in records:
        assert rec["collectives"] == 0 and not rec["lockstep"] and rec["steps"] >= 3
        assert rec["outputs"] == records[0]["outputs"]


def test_a_draft_cache_and_the_target_cache_never_share_slot_files(job: Job) -> None:
    files = job.records[0]["draft"]["files"]
    for rec in job.records:
        draft = rec["draft"]
        assert draft["target_spills"] > 0 and draft["draft_spills"] > 0
        assert draft["duplicate"] is not None and draft["duplicate"][0] == "namespace"
    # Every file lies in one namespace's rank directory, and each of those has its own.
    expected = {f"{ns}/rank_{r}" for ns in ("target", "draft") for r in range(job.world)}
    assert {str(Path(f).parent) for f in files} == expected, files
    assert all(Path(f).parent.parent.name in ("target", "draft") for f in files)


def test_a_dead_rank_fails_the_others_promptly_and_they_shut_down_cleanly(job: Job) -> None:
    last = job.world - 1
    assert job.exit_codes[last] == 7
    for rank, rec in enumerate(job.records[:last]):
        death = rec["death"]
        assert death["error"] is not None and death["error"][0] == "RankGroupFailed", death
        # From the dead rank's closed sockets, not from the 30 s timeout.
        assert death["detected_after_s"] < DEATH_TIMEOUT_S / 3, death
        assert death["again_after_s"] < 1.0  # the failed group refuses at once
        assert death["close_s"] < 10.0
        assert rec.get("finished") is True and job.exit_codes[rank] == 0


def test_a_hung_rank_times_out_into_an_error_not_a_hang(job: Job) -> None:
    if job.world != 2:
        pytest.skip("the 2-rank job covers the hang")
    for rank, rec in enumerate(job.records):
        stall = rec["stall"]
        assert stall["error"] is not None and stall["error"][0] == "RankGroupFailed", stall
        if rank == 0:
            assert STALL_TIMEOUT_S - 0.5 < stall["detected_after_s"] < STALL_TIMEOUT_S + 5


# ---------------------------------------------------------------------------- in-process


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        (ParallelLayout(tensor_parallel=2, pipeline_parallel=2), "pipeline_parallel"),
        (ParallelLayout(tensor_parallel=2, attention_dp=True), "attention_dp"),
        (ParallelLayout(tensor_parallel=1, data_parallel=2), "data_parallel"),
        (ParallelLayout(tensor_parallel=4), "tensor_parallel"),
    ],
)
def test_layout_check_names_the_unsupported_field(layout: ParallelLayout, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        layout.check(world_size=2)
    assert info.value.field == field


def test_layout_fields_are_validated() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel"):
        ParallelLayout(tensor_parallel=0)
    with pytest.raises(ConfigError, match="attention_dp"):
        ParallelLayout(tensor_parallel=1, attention_dp=1)  # type: ignore[arg-type]
    ParallelLayout(tensor_parallel=2).check(world_size=2)


def test_a_draft_config_refuses_the_target_namespace(tmp_path: Path) -> None:
    target = _small_config(1, tmp_path)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")
    with pytest.raises(ConfigError) as info:
        draft_config(target, layout=layout, namespace="target")
    assert info.value.field == "namespace"
    draft = draft_config(target, layout=layout)
    assert draft.rank_directory() != target.rank_directory()
    assert draft.rank_directory() == tmp_path / "draft" / "rank_0"


def test_the_gate_turns_a_success_into_the_failure_another_rank_saw() -> None:
    gate = _LockstepGate(timeout_s=5.0)
    ok_read, ok_write = SlotRead(transfer=TransferId(3)), SlotWritten(transfer=TransferId(4))
    assert gate.completion_filter(ok_read) is ok_read  # no verdict: as reported
    gate._fail.update({TransferId(3), TransferId(4)})
    assert isinstance(gate.completion_filter(ok_read), SlotReadFailed)
    assert isinstance(gate.completion_filter(ok_write), SlotWriteFailed)
    assert gate.completion_filter(ok_read) is ok_read  # a verdict is used once

