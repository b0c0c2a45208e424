"""`statekv demo`: multi-round chat on a small model, with budgets that force the disk tier.

The main run serves an LMBenchmark-shaped multi-round chat (a shared system prompt, each
user's history growing round after round) through a GPU pool and a host pool far too small
for the working set, so earlier rounds' KV is spilled to a temporary disk directory and read
back when the user returns; part of the users ask for a retention TTL.  Then, unless
``--no-identity``:

* the same workload runs with a GPU pool large enough for everything (no tier below GPU is
  ever used): every request must generate exactly the same tokens, because onboarded KV is
  byte-identical to what was computed (same chunking: both runs reuse the same prefixes);
* and once more with no prefix reuse at all (each request its own cache salt): its token
  match rate is reported (recomputing with other chunk boundaries may round differently).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from .chat_run import (
    Budgets,
    RunResult,
    build_model,
    identical_outputs,
    run_workload,
    token_match_rate,
    ttft_summary,
)
from .config import preset
from .workloads import ChatWorkload, ChatWorkloadConfig

if TYPE_CHECKING:
    from io_actors.tracing.recorder import TraceRecorder

TIMING_MARK: Final = "~"
"""Marks the report's figures that depend on timing, not only on the seed and the sizes."""


@attrs.frozen(kw_only=True)
class DemoOptions:
    """What one demo run serves, on which budgets (the ``statekv demo`` flags, read by the
    command into this record)."""

    model: str = "tiny"
    layers: int | None = None
    device: str = "auto"
    users: int = 8
    rounds: int = 4
    system_tokens: int = 96
    question_tokens: int = 24
    answer_tokens: int = 16
    arrival_rate: float = 40.0
    ttl: float = 600.0
    retained_fraction: float = 0.5
    budgets: Budgets
    disk_dir: Path | None = None
    seed: int = 0
    trace: Path | None = None
    identity: bool = True
    """Also run the comparison runs (unlimited GPU, no reuse)."""


Progress = Callable[[str, int], Callable[[int, int], None]]
"""Given a run's label and its request count, a callback told (done, total) as requests
finish (the command draws it; tests pass none)."""


def run(options: DemoOptions, *, progress: Progress | None = None) -> int:
    """Serve the demo workload, print the report; 1 if the identity check failed."""
    model_config = preset(options.model, num_layers=options.layers)
    model = build_model(model_config, options.device)

    def workload() -> ChatWorkload:
        return ChatWorkload(ChatWorkloadConfig(
            num_users=options.users, num_rounds=options.rounds,
            system_prompt_tokens=options.system_tokens,
            question_tokens=options.question_tokens, answer_tokens=options.answer_tokens,
            arrival_rate=options.arrival_rate, vocab_size=model_config.vocab_size,
            seed=options.seed, ttl_seconds=options.ttl,
            retained_fraction=options.retained_fraction,
        ))

    total = workload().total_requests

    def bar(label: str) -> Callable[[int, int], None] | None:
        return None if progress is None else progress(label, total)

    tight = options.budgets
    recorder = _recorder(options.trace)
    print(f"model {options.model} ({model_config.num_layers} layers, {model.device}), "
          f"{options.users} users x {options.rounds} rounds; GPU {tight.gpu_blocks} blocks, "
          f"host {tight.host_blocks}+{tight.reserved_host_blocks}, disk {tight.disk_blocks} "
          f"blocks of {tight.block_size} tokens", flush=True)
    main_run = run_workload(model, workload(), tight, device=options.device,
                            disk_dir=options.disk_dir, trace=recorder,
                            progress=bar("tiered cache"), total=total)
    if recorder is not None and options.trace is not None:
        _save_trace(recorder, options.trace)

    identical = reference = recompute = None
    if options.identity:
        roomy = Budgets(block_size=tight.block_size,
                        gpu_blocks=_roomy_gpu(main_run, tight.block_size),
                        host_blocks=0, reserved_host_blocks=0, disk_blocks=0)
        reference = run_workload(model, workload(), roomy, device=options.device,
                                 progress=bar("unlimited GPU"), total=total)
        identical = identical_outputs(main_run, reference)
        recompute = run_workload(model, workload(), roomy, device=options.device,
                                 salt_every_request=True, progress=bar("no reuse"),
                                 total=total)
    report(main_run, identical, reference, recompute, options)
    if identical is not None and identical[0] != identical[1]:
        return 1
    return 0


def _roomy_gpu(run: RunResult, block_size: int) -> int:
    """A GPU pool that holds every block the workload ever computes."""
    tokens = sum(r.prompt_tokens + len(r.output) for r in run.results)
    return tokens // block_size + len(run.results) + 16


def report(run: RunResult, identical: tuple[int, int] | None, reference: RunResult | None,
           recompute: RunResult | None, options: DemoOptions) -> None:
    stats = run.cache.cache
    prompt = sum(r.prompt_tokens for r in run.results)
    gpu = sum(r.gpu_tokens for r in run.results)
    host = sum(r.host_tokens for r in run.results)
    disk = sum(r.disk_tokens for r in run.results)
    computed = sum(r.recomputed_tokens for r in run.results)
    parked = sum(1 for r in run.results if r.parked_seconds > 0)
    p50, p99 = ttft_summary(run)

    def timed(name: str) -> str:
        return f"{name} {TIMING_MARK}"

    rows = [
        ("prompt tokens", f"{prompt}"),
        (timed("  served from GPU"), f"{gpu} ({gpu / prompt:.0%})"),
        (timed("  served from host"), f"{host} ({host / prompt:.0%})"),
        (timed("  served from disk"), f"{disk} ({disk / prompt:.0%})"),
        (timed("  computed"), f"{computed} ({computed / prompt:.0%})"),
        (timed("spills (host -> disk)"),
         f"{stats.spills_completed} ({stats.bytes_written / 2**20:.1f} MiB)"),
        (timed("onboards (disk -> GPU)"),
         f"{stats.onboards_completed} ({stats.bytes_read / 2**20:.1f} MiB)"),
        (timed("retained disk hits"),
         f"{stats.hit_blocks_disk_retained} blocks whose TTL kept them after they left GPU "
         "and host"),
        (timed("parked requests"), f"{parked} of {len(run.results)}"),
        (timed("TTFT p50 / p99"), f"{p50 * 1e3:.1f} ms / {p99 * 1e3:.1f} ms"),
        ("I/O errors", f"{stats.io_errors}"),
        (timed("wall time"), f"{run.seconds:.1f} s"),
    ]
    if identical is not None and reference is not None and recompute is not None:
        same, total = identical
        verdict = "PASS" if same == total else "FAIL"
        rows.append(("identity vs unlimited GPU", f"{verdict}: {same}/{total} requests "
                     "generated identical tokens"))
        rate = token_match_rate(run, recompute)
        rows.append((timed("token match vs no reuse"), f"{rate:.1%} of generated tokens"))
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"\n  {TIMING_MARK} depends on timing (arrivals are paced by the clock; disk reads, "
          "spills and thread\n    scheduling race the loop): it moves between runs with the "
          "same seed.  The other figures\n    are fixed by the seed and the sizes.")
    if options.trace is not None:
        print(f"\n  trace written to {options.trace} (statekv trace view {options.trace})")


def _recorder(path: Path | None) -> TraceRecorder | None:
    if path is None:
        return None
    from io_actors.tracing.recorder import TraceRecorder

    return TraceRecorder(capacity=1_000_000)


def _save_trace(recorder: TraceRecorder, path: Path) -> None:
    recorder.save_jsonl(path)


