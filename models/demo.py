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

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .chat_run import (
    Budgets,
    RunResult,
    build_model,
    identical_outputs,
    progress_bar,
    run_workload,
    token_match_rate,
    ttft_summary,
)
from .config import preset
from .workloads import ChatWorkload, ChatWorkloadConfig

if TYPE_CHECKING:
    from io_actors.tracing import TraceRecorder


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="statekv demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, 1b-class, 8b-class, 70b-class")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--arrival-rate", type=float, default=40.0, help="rounds per second")
    p.add_argument("--ttl", type=float, default=600.0, help="retention TTL of retained users")
    p.add_argument("--retained-fraction", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=40)
    p.add_argument("--host-blocks", type=int, default=8)
    p.add_argument("--reserved-host-blocks", type=int, default=8)
    p.add_argument("--disk-blocks", type=int, default=4096)
    p.add_argument("--disk-dir", type=Path, default=None,
                   help="where slot files go (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=None,
                   help="record every transition of the main run to this JSON Lines file")
    p.add_argument("--no-identity", action="store_true", help="skip the comparison runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    model_config = preset(args.model, num_layers=args.layers)
    model = build_model(model_config, args.device)

    def workload() -> ChatWorkload:
        return ChatWorkload(ChatWorkloadConfig(
            num_users=args.users, num_rounds=args.rounds,
            system_prompt_tokens=args.system_tokens, question_tokens=args.question_tokens,
            answer_tokens=args.answer_tokens, arrival_rate=args.arrival_rate,
            vocab_size=model_config.vocab_size, seed=args.seed, ttl_seconds=args.ttl,
            retained_fraction=args.retained_fraction,
        ))

    total = workload().total_requests
    tight = Budgets(
        block_size=args.block_size, gpu_blocks=args.gpu_blocks, host_blocks=args.host_blocks,
        reserved_host_blocks=args.reserved_host_blocks, disk_blocks=args.disk_blocks,
    )
    recorder = _recorder(args.trace)
    print(f"model {args.model} ({model_config.num_layers} layers, {model.device}), "
          f"{args.users} users x {args.rounds} rounds; GPU {tight.gpu_blocks} blocks, host "
          f"{tight.host_blocks}+{tight.reserved_host_blocks}, disk {tight.disk_blocks} "
          f"blocks of {tight.block_size} tokens", flush=True)
    main_run = run_workload(model, workload(), tight, device=args.device,
                            disk_dir=args.disk_dir, trace=recorder,
                            progress=progress_bar("tiered cache  "), total=total)
    if recorder is not None and args.trace is not None:
        _save_trace(recorder, args.trace)

    identical = reference = recompute = None
    if not args.no_identity:
        roomy = Budgets(block_size=args.block_size, gpu_blocks=_roomy_gpu(main_run, args),
                        host_blocks=0, reserved_host_blocks=0, disk_blocks=0)
        reference = run_workload(model, workload(), roomy, device=args.device,
                                 progress=progress_bar("unlimited GPU "), total=total)
        identical = identical_outputs(main_run, reference)
        recompute = run_workload(model, workload(), roomy, device=args.device,
                                 salt_every_request=True,
                                 progress=progress_bar("no reuse      "), total=total)
    report(main_run, identical, reference, recompute, args)
    if identical is not None and identical[0] != identical[1]:
        return 1
    return 0


def _roomy_gpu(run: RunResult, args: argparse.Namespace) -> int:
    """A GPU pool that holds every block the workload ever computes."""
    tokens = sum(r.prompt_tokens + len(r.output) for r in run.results)
    block_size: int = args.block_size
    return tokens // block_size + len(run.results) + 16


def report(run: RunResult, identical: tuple[int, int] | None, reference: RunResult | None,
           recompute: RunResult | None, args: argparse.Namespace) -> None:
    stats = run.cache.cache
    prompt = sum(r.prompt_tokens for r in run.results)
    gpu = sum(r.gpu_tokens for r in run.results)
    host = sum(r.host_tokens for r in run.results)
    disk = sum(r.disk_tokens for r in run.results)
    computed = sum(r.recomputed_tokens for r in run.results)
    parked = sum(1 for r in run.results if r.parked_seconds > 0)
    p50, p99 = ttft_summary(run)
    rows = [
        ("prompt tokens", f"{prompt}"),
        ("  served from GPU", f"{gpu} ({gpu / prompt:.0%})"),
        ("  served from host", f"{host} ({host / prompt:.0%})"),
        ("  served from disk", f"{disk} ({disk / prompt:.0%})"),
        ("  computed", f"{computed} ({computed / prompt:.0%})"),
        ("spills (host -> disk)", f"{stats.spills_completed} "
                                  f"({stats.bytes_written / 2**20:.1f} MiB)"),
        ("onboards (disk -> GPU)", f"{stats.onboards_completed} "
                                   f"({stats.bytes_read / 2**20:.1f} MiB)"),
        ("retained disk hits", f"{stats.hit_blocks_disk_retained} blocks whose TTL kept them "
                               f"after they left GPU and host"),
        ("parked requests", f"{parked} of {len(run.results)}"),
        ("TTFT p50 / p99", f"{p50 * 1e3:.1f} ms / {p99 * 1e3:.1f} ms"),
        ("I/O errors", f"{stats.io_errors}"),
        ("wall time", f"{run.seconds:.1f} s"),
    ]
    if identical is not None and reference is not None and recompute is not None:
        same, total = identical
        verdict = "PASS" if same == total else "FAIL"
        rows.append(("identity vs unlimited GPU", f"{verdict}: {same}/{total} requests "
                     "generated identical tokens"))
        rate = token_match_rate(run, recompute)
        rows.append(("token match vs no reuse", f"{rate:.1%} of generated tokens"))
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if args.trace is not None:
        print(f"\n  trace written to {args.trace} (statekv trace view {args.trace})")


def _recorder(path: Path | None) -> TraceRecorder | None:
    if path is None:
        return None
    from io_actors.tracing import TraceRecorder

    return TraceRecorder(capacity=1_000_000)


def _save_trace(recorder: TraceRecorder, path: Path) -> None:
    recorder.save_jsonl(path)


if __name__ == "__main__":
    raise SystemExit(main())
