"""What state-trace recording costs, with it off and on, against the same run without it.

    python -m bench.trace_cost [--users 24] [--rounds 6] [--repeat 15] [--write]

Two paths run the same multi-round chat workload (each round a user's prompt grows by the
last answer and a new turn, so earlier rounds' blocks are matched again after they were
evicted to host and spilled to disk):

* core     a bare KVCacheManager; every disk write and read completes at once, fed back by
           the benchmark; timed in CPU time of the thread (the machines these run on are
           shared: CPU time is not stretched by other processes' time slices).  This is
           the worst case for recording: nothing but bookkeeping between two records.
* serving  the blocking facade over real files (POSIX slot store, CPU tensors): the CPU
           time the serving loop's thread spends inside cache calls (add, allocate, commit,
           release: the core's bookkeeping, the copies, the scheduler and its hooks).  Waits
           for onboards are left out, and each request waits until its spills have landed
           before the next one starts, so that every run does the same work whatever the
           disk's timing.

Each is run with no recorder (recording off, the default) and with a TraceRecorder
attached (recording on), in back-to-back pairs; "on" is the median of the pairs' ratios.

"Off" adds nothing but `is None` tests to code that runs anyway (one per transition in the
core, at most two per cache call and two per completion in the scheduler), so it cannot be
separated from run-to-run noise by timing two runs; the figure is that count, taken from a
recorded run, times the measured cost of one such test, over the run's own time.
"""

from __future__ import annotations

import datetime as dt
import gc
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.flags import OneLineParser, int_at_least
from bench.results_files import source_commit, write_new_results
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.tracing.recorder import RecordKind, TraceRecorder
from statekv import CacheConfig, KVCacheManager
from statekv.config import KVLayout
from statekv.messages import ReadSlot, SlotRead, SlotWritten, WriteSlot

BLOCK_SIZE = 16
TURN_TOKENS = 3 * BLOCK_SIZE + 5
ANSWER_TOKENS = BLOCK_SIZE


def _prompts(users: int, rounds: int) -> list[list[tuple[str, list[int]]]]:
    """Per round, (request id, prompt) of every user: each prompt extends the last one."""
    history = [[u * 1_000_003 + t for t in range(2 * BLOCK_SIZE)] for u in range(users)]
    out = []
    for r in range(rounds):
        batch = []
        for u in range(users):
            turn = [(u * 7919 + r * 104_729 + t) % 50_000 for t in range(TURN_TOKENS)]
            history[u] = history[u] + turn
            batch.append((f"u{u}r{r}", list(history[u])))
            history[u] = history[u] + [(u + r + t) % 50_000 for t in range(ANSWER_TOKENS)]
        out.append(batch)
    return out


def _pool_sizes(users: int) -> tuple[int, int, int]:
    """GPU for a few users at a time, host for a few more, disk for everything."""
    return 4 * 24, 2 * 24, users * 64


# ---------------------------------------------------------------------- the bare core


def core_run(prompts: list[list[tuple[str, list[int]]]], users: int,
             recorder: TraceRecorder | None) -> float:
    gpu, host, disk = _pool_sizes(users)
    cache = KVCacheManager(
        CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=gpu, host_blocks=host, disk_blocks=disk),
        trace=recorder,
    )
    now = 1.0

    def settle() -> None:
        # Complete every disk transfer at once (the core's commands, fed back).
        while True:
            commands = cache.take_commands()
            if not commands:
                return
            for cmd in commands:
                if isinstance(cmd, WriteSlot):
                    cache.handle(SlotWritten(transfer=cmd.transfer), now=now)
                elif isinstance(cmd, ReadSlot):
                    cache.handle(SlotRead(transfer=cmd.transfer), now=now)

    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        for batch in prompts:
            for rid, prompt in batch:
                now += 0.001
                cache.add_request(rid, prompt, now=now)
                settle()
                cache.allocate_nowait(rid, len(prompt), now=now)
                settle()
                cache.commit(rid, len(prompt), now=now)
                cache.release(rid, now=now)
                settle()
        return time.thread_time() - start
    finally:
        gc.enable()


# ---------------------------------------------------------------------- the serving path


def _quiet(cache: BlockingCache) -> None:
    """Until no disk transfer is in flight (between rounds, so that spills land)."""
    deadline = time.monotonic() + 60
    while True:
        stats = cache.statistics()
        if (stats.cache.writes_in_flight == 0 and stats.cache.reads_in_flight == 0
                and stats.spill_backlog == 0):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("disk transfers still in flight after 60 s")
        time.sleep(0.0005)


def serving_run(prompts: list[list[tuple[str, list[int]]]], users: int, directory: Path,
                recorder: TraceRecorder | None,
                clock: Callable[[], float] = time.thread_time) -> float:
    """Seconds (of `clock`) inside cache calls over the whole workload."""
    gpu, host, disk = _pool_sizes(users)
    config = StateKVConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16"),
        block_size=BLOCK_SIZE, gpu=gpu, host=host, reserved_host=8, disk=disk,
        disk_dir=directory, device="cpu", writers=2, readers=2,
        model_fingerprint="trace-cost",
    )
    inside = 0.0
    with BlockingCache(config, recorder=recorder) as cache:
        gc.collect()
        gc.disable()
        try:
            for batch in prompts:
                for rid, prompt in batch:
                    t0 = clock()
                    match = cache.add_request(rid, prompt)
                    inside += clock() - t0
                    if not match.ready and not cache.wait_ready(rid, timeout=60):
                        raise TimeoutError(f"{rid} still parked")
                    t0 = clock()
                    cache.allocate_nowait(rid, len(prompt))
                    cache.commit(rid, len(prompt))
                    cache.release(rid)
                    inside += clock() - t0
                    # Let this request's spills land before the next one: the same work
                    # then happens in every run, whatever the disk's timing.
                    _quiet(cache)
        finally:
            gc.enable()
    return inside


# ---------------------------------------------------------------------- "off"


class _Holder:
    def __init__(self) -> None:
        self.recorder: TraceRecorder | None = None
        self.hits = 0


def _ten_tests(holder: _Holder, n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        # Ten tests as the hooks write them (`if self._recorder is not None:`).
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
        if holder.recorder is not None:
            holder.hits += 1
    return time.thread_time() - start


def _empty_loop(n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        pass
    return time.thread_time() - start


def is_none_test_ns(n: int = 1_000_000) -> float:
    """One `if self.x is not None:` test, net of the loop around it (best of 7)."""
    holder = _Holder()
    tests = min(_ten_tests(holder, n) for _ in range(7))
    loop = min(_empty_loop(n) for _ in range(7))
    return max(tests - loop, 0.0) / (10 * n) * 1e9


def off_checks(recorder: TraceRecorder, calls: int) -> int:
    """`is None` tests a run makes with recording off: one per transition (core), two per
    cache call (park hook, dispatch hook) and two per completion (scheduler)."""
    records = recorder.records()
    transitions = sum(r.kind is RecordKind.TRANSITION for r in records)
    completions = sum(r.kind is RecordKind.COMPLETION for r in records)
    return transitions + 2 * calls + 2 * completions



def paired(run: Callable[[bool], float], repeat: int) -> tuple[float, float, float]:
    """Median of (with / without) over back-to-back pairs, order alternating so that a
    machine getting busier or quieter does not favour one side; and the best of each."""
    ratios, without, with_ = [], [], []
    for i in range(repeat):
        if i % 2:
            on = run(True)
            off = run(False)
        else:
            off = run(False)
            on = run(True)
        ratios.append(on / off)
        without.append(off)
        with_.append(on)
    return statistics.median(ratios), min(without), min(with_)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.trace_cost",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int_at_least(1), default=24)
    parser.add_argument("--rounds", type=int_at_least(1), default=6)
    parser.add_argument("--repeat", type=int_at_least(1), default=15,
                        help="pairs of runs of each path (default 15)")
    parser.add_argument("--write", action="store_true",
                        help="write bench/results/trace-cpu-<date>.json")
    args = parser.parse_args(argv)
    prompts = _prompts(args.users, args.rounds)
    calls_per_run = 4 * args.users * args.rounds
    capacity = 1 << 20  # larger than a run: nothing is overwritten, every record is counted
    recorder = TraceRecorder(capacity)

    def core(on: bool) -> float:
        recorder.clear()
        return core_run(prompts, args.users, recorder if on else None)

    core_ratio, core_none, core_on = paired(core, args.repeat)
    core_records = recorder.recorded
    core_transitions = sum(r.kind is RecordKind.TRANSITION for r in recorder.records())
    check_ns = is_none_test_ns()
    core_off = 1 + core_transitions * check_ns * 1e-9 / core_none

    with tempfile.TemporaryDirectory(prefix="statekv-trace-cost-") as tmp:
        runs = iter(range(1_000_000))

        def serving(on: bool) -> float:
            recorder.clear()
            return serving_run(prompts, args.users, Path(tmp) / f"run{next(runs)}",
                               recorder if on else None)

        serve_ratio, serve_none, serve_on = paired(serving, args.repeat)
    serving_records = recorder.recorded
    serving_off = 1 + off_checks(recorder, calls_per_run) * check_ns * 1e-9 / serve_none
    kinds = {kind.value: sum(r.kind is kind for r in recorder.records()) for kind in RecordKind}

    rows = [
        ("core, recording off (est.)", core_off),
        ("core, recording on", core_ratio),
        ("serving calls, off (est.)", serving_off),
        ("serving calls, recording on", serve_ratio),
    ]
    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
          f"python {platform.python_version()}")
    print(f"workload: {args.users} users x {args.rounds} rounds, {args.repeat} pairs of runs")
    print(f"core: best {core_none * 1e3:.1f} ms CPU without a recorder, {core_on * 1e3:.1f} ms "
          f"with ({core_records} records, {core_transitions} transitions)")
    print(f"serving: best {serve_none * 1e3:.1f} ms inside cache calls without, "
          f"{serve_on * 1e3:.1f} ms with ({serving_records} records: {kinds})")
    print(f"one `is None` test: {check_ns:.2f} ns")
    print(f"{'path':<30}{'vs no recorder (median of pairs)':>34}")
    for name, ratio in rows:
        print(f"{name:<30}{ratio:>33.4f}x")

    if args.write:
        commit = source_commit()
        today = dt.date.today()
        names = ["core_recording_off_estimated", "core_recording_on",
                 "serving_calls_recording_off_estimated", "serving_calls_recording_on"]
        figures: dict[str, dict[str, object]] = {
            name: {"value": round(ratio, 4), "unit": "x", "ratio": round(ratio, 4)}
            for name, (_label, ratio) in zip(names, rows, strict=True)
        }
        figures["record_per_transition_core"] = {
            "value": round((core_ratio - 1) * core_none / max(core_transitions, 1) * 1e9, 1),
            "unit": "ns",
        }
        figures["is_none_test"] = {"value": round(check_ns, 2), "unit": "ns"}
        result = {
            "bench": "trace", "machine": "cpu", "date": today.isoformat(), "commit": commit,
            "command": f"python -m bench.trace_cost --users {args.users} --rounds "
                       f"{args.rounds} --repeat {args.repeat} --write",
            "figures": figures,
        }
        out = write_new_results("trace", "cpu", today, result)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
