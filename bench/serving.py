"""What the serving benchmarks (bench/e2e.py, bench/sweep.py) share.

The five cache configurations and the pool budgets each gets, the same-run calibration of the
model's prefill rate and of the capacity it implies, the run of one configuration through
models.chat_run, the per-run summary, the flags both take (validated at parse time, errors on
one line), and the results file's header fields.  One owner for each, so the load sweep and the
single-load comparison measure the same thing the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.flags import device_name, int_at_least, positive_number
from io_actors.memory.page_copies import COMPUTE_WAITS
from io_actors.memory.pools import COPY_KERNEL
from models.chat_run import Budgets, RunResult, percentile, run_workload, ttft_summary
from models.config import ModelConfig
from models.model import Chunk, PagedDecoder
from models.serving_loop import RequestResult, TTFTBreakdown
from models.workloads import ChatWorkload, ChatWorkloadConfig, OpenChatWorkload

CONFIGS = ("a", "b", "c", "d", "e")
NAMES = {
    "a": "no reuse",
    "b": "GPU-only prefix cache",
    "c": "GPU + host",
    "d": "GPU + host + disk (statekv)",
    "e": "GPU + host + disk, sync I/O",
}
SYNCHRONOUS_IO = "e"
"""The configurations whose disk reads and writes run inside the cache calls."""
FOREGROUND: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""--foreground: ServingLoop's hold_foreground."""
RESERVED_HOST_BLOCKS = 64
"""Host pages kept free for disk reads in (d) and (e)."""


# ---------------------------------------------------------------------- flags


def config_letters(text: str) -> str:
    """A selection of configurations such as `abcde` or `cd`: known letters, each once."""
    unknown = sorted(set(text) - set(CONFIGS))
    if not text or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {''.join(unknown) or text!r} (use letters of "
            f"{''.join(CONFIGS)})")
    if len(set(text)) != len(text):
        raise argparse.ArgumentTypeError(f"a configuration is named twice in {text!r}")
    return "".join(k for k in CONFIGS if k in text)


def add_run_flags(p: argparse.ArgumentParser, *, layers: int) -> None:
    """The workload, pool and I/O flags of the serving benchmarks."""
    n0, n1, pos = int_at_least(0), int_at_least(1), positive_number
    p.add_argument("--layers", type=n1, default=layers, help="decoder layers of the shape")
    p.add_argument("--device", type=device_name, default="auto")
    p.add_argument("--users", type=n1, default=64)
    p.add_argument("--rounds", type=n1, default=4)
    p.add_argument("--system-tokens", type=n0, default=1024)
    p.add_argument("--question-tokens", type=n1, default=256)
    p.add_argument("--answer-tokens", type=n1, default=32)
    p.add_argument("--block-size", type=n1, default=32, help="tokens per KV block")
    p.add_argument("--gpu-gib", type=pos, default=2.0)
    p.add_argument("--host-gib", type=pos, default=2.0)
    p.add_argument("--disk-gib", type=pos, default=32.0)
    p.add_argument("--readers", type=n1, default=8)
    p.add_argument("--writers", type=n1, default=4)
    p.add_argument("--configs", type=config_letters, default="".join(CONFIGS))
    p.add_argument("--prefetch-ahead", type=n0, default=8,
                   help="queued requests that prefetch their disk blocks in (d) and (e); 0: off")
    p.add_argument("--reclaim-prefetched", choices=("first", "last"), default="last",
                   help="host pressure takes prefetched pages before host content (first) or "
                        "only when evicting host content yields no page (last)")
    p.add_argument("--no-cost-aware", action="store_true",
                   help="always read disk hits back, even where recomputing is faster")
    p.add_argument("--seed", type=n0, default=0)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode-only steps from CUDA graphs (PagedDecoder(cuda_graphs="
                        "True); CUDA only): the serving loop's steps that carry no prefill")
    p.add_argument("--foreground", choices=tuple(FOREGROUND), default="auto",
                   help="whether the serving thread holds the cache's foreground while it "
                        "works, so that the cache's threads run their Python while it waits "
                        "for the pass (ServingLoop's hold_foreground; auto: on a GPU); for "
                        "an A/B")
    p.add_argument("--compute-waits", choices=COMPUTE_WAITS, default="all",
                   help="what a step waits for on the cache's copy stream: every copy (all) "
                        "or only its own pages' (pages); StateKVConfig.compute_waits, for "
                        "an A/B")
    p.add_argument("--copy-kernel", choices=COPY_KERNEL, default="auto",
                   help="whether the cache's page copies run as kernels (on), as DMAs (off) "
                        "or as it chooses by page size (auto); StateKVConfig.copy_kernel, "
                        "for an A/B")
    p.add_argument("--dir", type=Path, default=None, help="disk tier directory")
    p.add_argument("--machine", default=None,
                   help="machine name in the results file (default: h100 or h200 from the "
                        "GPU found, else cpu)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")


# ---------------------------------------------------------------------- calibration


def prefill_rate(model: PagedDecoder, block_size: int, chunk: int, context: int) -> float:
    """Tokens/s of prefilling `chunk` new tokens after `context` cached ones (same run)."""
    blocks = (context + chunk) // block_size + 1
    pool = model.new_pool(blocks, block_size)
    table = list(range(blocks))
    tokens = [7] * chunk
    model.forward(pool, [Chunk(token_ids=tokens, start=context, block_table=table)])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    repeats = 3
    for _ in range(repeats):
        model.forward(pool, [Chunk(token_ids=tokens, start=context, block_table=table)])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return repeats * chunk / (time.perf_counter() - start)


def chat_config(args: argparse.Namespace, vocab: int, rate: float, *,
                history_tokens: int) -> ChatWorkloadConfig:
    return ChatWorkloadConfig(
        num_users=args.users, num_rounds=args.rounds, system_prompt_tokens=args.system_tokens,
        user_history_tokens=history_tokens, question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens, arrival_rate=rate, vocab_size=vocab, seed=args.seed,
    )


def full_reuse_capacity(config: ChatWorkloadConfig, prefill_tok_per_s: float) -> float:
    """Requests/s the model could serve if every earlier prompt were reused from the cache.

    A user's first round computes its history and question; a later round only the previous
    answer and the new question.  Decoding is counted as 4 prefill tokens per output token (a
    decode step moves a whole batch but pays the step's fixed costs).  The capacity of a
    configuration that recomputes more is lower: that is what the sweep shows.
    """
    c = config
    first = c.user_history_tokens + c.question_tokens
    later = c.question_tokens + c.answer_tokens
    mean_new = (first + (c.num_rounds - 1) * later) / c.num_rounds
    return prefill_tok_per_s / (mean_new + 4 * c.answer_tokens)


def recompute_capacity(config: ChatWorkloadConfig, prefill_tok_per_s: float) -> float:
    """Requests/s the model could serve recomputing every prompt in full (configuration
    (a)'s ceiling; decoding priced as in full_reuse_capacity).  Every configuration that
    reuses saturates above it, so the sweep's rates are multiples of it."""
    return prefill_tok_per_s / (mean_prompt_tokens(config) + 4 * config.answer_tokens)


def mean_prompt_tokens(config: ChatWorkloadConfig) -> float:
    """Mean prompt length over a conversation's rounds (round r repeats rounds 0..r-1)."""
    c = config
    base = c.system_prompt_tokens + c.user_history_tokens
    rounds = range(c.num_rounds)
    return sum(base + (r + 1) * c.question_tokens + r * c.answer_tokens
               for r in rounds) / c.num_rounds


# ---------------------------------------------------------------------- one run


def pool_blocks(model_config: ModelConfig, block_size: int, gpu_gib: float, host_gib: float,
                disk_gib: float) -> tuple[int, int, int]:
    """(GPU, host, disk) blocks of `block_size` tokens in the given GiB."""
    block_bytes = model_config.kv_bytes_per_token() * block_size
    return (int(gpu_gib * 2**30 // block_bytes), int(host_gib * 2**30 // block_bytes),
            int(disk_gib * 2**30 // block_bytes))


def budgets_for(key: str, args: argparse.Namespace, blocks: tuple[int, int, int]) -> Budgets:
    """Configuration `key`'s tiers: every configuration has the same GPU pool."""
    gpu, host, disk = blocks
    return Budgets(
        block_size=args.block_size, gpu_blocks=gpu,
        host_blocks=host if key in "cde" else 0,
        reserved_host_blocks=RESERVED_HOST_BLOCKS if key in "de" else 0,
        disk_blocks=disk if key in "de" else 0,
        writers=args.writers, readers=args.readers,
    )


def run_config(model: PagedDecoder, key: str,
               workload: ChatWorkloadConfig | OpenChatWorkload, budgets: Budgets, *,
               device: str, disk_dir: Path, args: argparse.Namespace,
               progress: Callable[[int, int], None] | None = None,
               stop_at: float | None = None, tier_dir: Path | None = None) -> RunResult:
    """Serve `workload` under configuration `key` (the disk tier's policies from `args`): a
    config is served as the closed-loop ChatWorkload, an OpenChatWorkload as it is.
    `tier_dir`: the disk tier's own directory, opened as it is (a persisted tier is restored)
    and kept; without it, a fresh one under `disk_dir`, removed afterwards."""
    chat = ChatWorkload(workload) if isinstance(workload, ChatWorkloadConfig) else workload
    return run_workload(
        model, chat, budgets, device=device,
        disk_dir=tier_dir if tier_dir is not None else disk_dir / key,
        keep_disk_dir=tier_dir is not None,
        batch_invariant=False, salt_every_request=key == "a",
        synchronous_io=key in SYNCHRONOUS_IO,
        max_step_tokens=8192, prefill_chunk=2048, max_running=128,
        prefetch_ahead=args.prefetch_ahead if key in "de" else 0,
        cost_aware_onboarding=not args.no_cost_aware,
        reclaim_prefetched_first=args.reclaim_prefetched == "first",
        progress=progress, total=chat.total_requests, stop_at=stop_at,
        hold_foreground=FOREGROUND[args.foreground],
        compute_waits=args.compute_waits, copy_kernel=args.copy_kernel,
    )


def itl_p50(run: RunResult) -> float:
    """Median over requests of each request's mean gap between output tokens (vLLM's TPOT).

    The serving loop records when a request's first and last tokens came, not every token, so
    the gaps are averaged within a request; NaN when no request produced two tokens.
    """
    gaps = [(r.finished - r.first_token) / (len(r.output) - 1) for r in run.results
            if r.finished is not None and r.first_token is not None and len(r.output) > 1]
    return statistics.median(gaps) if gaps else float("nan")


def breakdown_summary(results: Iterable[RequestResult]) -> dict[str, float]:
    """Where the requests' time to first token went (RequestResult.breakdown), aggregated.

    For each part ``P`` of :class:`~models.serving_loop.TTFTBreakdown` (queue, prefetch,
    parked, prefill, ready_wait) and for the TTFT itself: ``breakdown_P_mean``, ``_p50``
    and ``_p99`` in seconds, over the requests that got a first token (others have no
    breakdown).  Means add up: the parts' means sum to the mean TTFT
    (``breakdown_parts_sum_s_mean``, equal to ``breakdown_ttft_s_mean`` up to rounding);
    percentiles do not, each is its own part's.  ``breakdown_P_share`` is the part's mean
    over the mean TTFT.  ``breakdown_requests``: how many requests were broken down;
    ``breakdown_parked_requests`` / ``breakdown_prefetched_requests``: how many of them spent
    any time parked / prefetching.  An empty selection gives NaN figures and 0 requests.
    """
    rows = [b for b in (r.breakdown() for r in results) if b is not None]
    nan = float("nan")
    out: dict[str, float] = {"breakdown_requests": len(rows)}
    for name in ("ttft_s", *TTFTBreakdown.PARTS):
        out.update(_mean_p50_p99(f"breakdown_{name}", [getattr(b, name) for b in rows]))
    mean_ttft = out["breakdown_ttft_s_mean"]
    out["breakdown_parts_sum_s_mean"] = (
        sum(out[f"breakdown_{name}_mean"] for name in TTFTBreakdown.PARTS) if rows else nan)
    for name in TTFTBreakdown.PARTS:
        out[f"breakdown_{name}_share"] = (out[f"breakdown_{name}_mean"] / mean_ttft
                                          if rows and mean_ttft > 0 else nan)
    out["breakdown_parked_requests"] = sum(1 for b in rows if b.parked_s > 0)
    out["breakdown_prefetched_requests"] = sum(1 for b in rows if b.prefetch_s > 0)
    return out


def residency_summary(results: Iterable[RequestResult], start: float, end: float
                      ) -> dict[str, float]:
    """How long requests held their GPU pages, and how many held them at once.

    A request holds its pages from admission to its release (its last token): the loop
    admits only what the GPU pool can hold whole, so when the pool bounds admission, the
    rate a configuration sustains is the requests it holds at once over the time each holds
    them (Little's law).  ``residency_resident_s_*``: admission -> last token, and
    ``residency_answer_s_*``: first -> last token (the decode part), mean / p50 / p99 over
    the requests that arrived in [start, end) and finished (NaN without any);
    ``residency_held_mean``: the requests admitted and not finished, averaged over the time
    from `start` to `end` -- every admitted one counts, measured or warm-up, a request still
    running at the end until `end`; ``residency_requests``: how many were finished.
    """
    resident: list[float] = []
    answer: list[float] = []
    held = 0.0
    for r in results:
        if r.admitted is None:
            continue
        left = r.finished if r.finished is not None else end
        held += max(0.0, min(left, end) - max(r.admitted, start))
        if r.first_token is not None and r.finished is not None and start <= r.arrival < end:
            resident.append(r.finished - r.admitted)
            answer.append(r.finished - r.first_token)
    out: dict[str, float] = {"residency_requests": len(resident),
                             **_mean_p50_p99("residency_resident_s", resident),
                             **_mean_p50_p99("residency_answer_s", answer)}
    out["residency_held_mean"] = held / (end - start) if end > start else float("nan")
    return out


def _mean_p50_p99(prefix: str, values: list[float]) -> dict[str, float]:
    """``prefix_mean``, ``_p50`` and ``_p99`` of `values` (NaN without any)."""
    nan = float("nan")
    return {f"{prefix}_mean": statistics.fmean(values) if values else nan,
            f"{prefix}_p50": statistics.median(values) if values else nan,
            f"{prefix}_p99": percentile(values, 99)}


def residency_line(summary: dict[str, float]) -> str:
    """One line of a residency_summary for the printed table (with
    ``residency_pool_requests``, what the pool holds at once, where the summary has it)."""
    pool = summary.get("residency_pool_requests")
    of_pool = "" if pool is None else f" of the pool's {pool:.1f}"
    return (f"GPU pages held from admission to the last token: mean "
            f"{summary['residency_resident_s_mean']:.3f} s (p99 "
            f"{summary['residency_resident_s_p99']:.3f}), of it first -> last token "
            f"{summary['residency_answer_s_mean']:.3f} s; "
            f"{summary['residency_held_mean']:.2f}{of_pool} requests held at once on "
            f"average [{summary['residency_requests']:.0f} requests]")


def breakdown_line(summary: dict[str, float]) -> str:
    """One line of a breakdown_summary for the printed table: the parts' means against the
    mean TTFT, then each part's p99."""
    short = {"queue_s": "queue", "prefetch_s": "prefetch", "parked_s": "parked",
             "prefill_s": "prefill", "ready_wait_s": "ready-wait"}
    means = " + ".join(f"{short[name]} {summary[f'breakdown_{name}_mean']:.3f}"
                       for name in TTFTBreakdown.PARTS)
    p99s = ", ".join(f"{short[name]} {summary[f'breakdown_{name}_p99']:.3f}"
                     for name in TTFTBreakdown.PARTS)
    return (f"TTFT mean {summary['breakdown_ttft_s_mean']:.3f} s = {means} "
            f"(sum {summary['breakdown_parts_sum_s_mean']:.3f}); p99 {p99s} "
            f"[{summary['breakdown_requests']:.0f} requests, "
            f"{summary['breakdown_parked_requests']:.0f} parked, "
            f"{summary['breakdown_prefetched_requests']:.0f} prefetched]")


def summarize(run: RunResult, offered_input_tps: float) -> dict[str, float]:
    results = run.results
    prompt = sum(r.prompt_tokens for r in results)
    output = sum(len(r.output) for r in results)
    p50, p99 = ttft_summary(run)
    return {
        "ttft_p50_s": p50, "ttft_p99_s": p99, "itl_p50_s": itl_p50(run),
        "output_tok_per_s": output / run.seconds,
        "input_tok_per_s": prompt / run.seconds,
        "offered_input_tok_per_s": offered_input_tps,
        "sustained_vs_offered": prompt / run.seconds / offered_input_tps,
        "tokens_gpu": sum(r.gpu_tokens for r in results),
        "tokens_host": sum(r.host_tokens for r in results),
        "tokens_disk": sum(r.disk_tokens for r in results),
        "tokens_computed": sum(r.recomputed_tokens for r in results),
        "requests": len(results),
        "seconds": run.seconds,
        "io_errors": run.cache.cache.io_errors,
        "bounced_transfers": bounced_transfers(run),
        "queued_on_disk_s": run.loop.queued_on_disk_seconds,
        "queued_on_disk_reading_s": run.loop.queued_on_disk_reading_seconds,
        **step_parts_summary(run),
        **breakdown_summary(results),
    }


def step_parts_summary(run: RunResult, prefix: str = "") -> dict[str, float]:
    """Where the run's steps went (models.serving_loop.StepParts), warm-up included: for
    steps with a prompt chunk (``prefill``) and decode-only steps (``decode``), how many
    ran (``steps_K``) and each part's mean in ms (``step_K_P_ms``, P: prepare, launch,
    readback, advance), each key after `prefix`.  A configuration's step time beyond its
    prefill's compute shows here: launch and the cache calls around the pass are the CPU's
    time, readback the GPU's."""
    out: dict[str, float] = {}
    for kind, parts in (("prefill", run.loop.prefill_steps), ("decode", run.loop.decode_steps)):
        out[f"{prefix}steps_{kind}"] = parts.steps
        for name, ms in parts.mean_ms().items():
            out[f"{prefix}step_{kind}_{name}_ms"] = ms
    return out


def step_parts_line(summary: dict[str, Any], prefix: str = "") -> str:
    """One printed line of a step_parts_summary."""
    def kind(name: str) -> str:
        parts = " + ".join(f"{part} {summary[f'{prefix}step_{name}_{part}_ms']:.2f}"
                           for part in ("prepare", "launch", "readback", "advance"))
        return f"{summary[f'{prefix}steps_{name}']:.0f} {name} steps, mean ms {parts}"
    return f"steps of the run: {kind('prefill')}; {kind('decode')}"


def window_ttfts(run: RunResult, start: float) -> list[float]:
    """TTFTs, ascending, of the requests that arrived at or after `start`: one that had no
    first token when the run stopped counts with the time it had waited (a lower bound)."""
    return sorted(r.ttft if r.ttft is not None else run.seconds - r.arrival
                  for r in [*run.results, *run.unfinished] if r.arrival >= start)


def steady_summary(run: RunResult, arrival_times: tuple[float, ...], warmup: int
                   ) -> dict[str, float | int | bool]:
    """An open-loop run's figures over its steady-state window.

    The window runs from the arrival of request `warmup` (the first measured one; earlier ones
    warm the cache up) to the last arrival, or to the end of the run if it was stopped before.
    Latencies are over the requests that arrived in the window; one that had no first token
    when the run stopped counts with the time it had waited (a lower bound, flagged).
    Throughputs count what the server did inside the window: requests finished, prompt
    tokens of requests whose first token came, output tokens of requests finished.
    ``sustained_vs_offered`` is requests finished in the window over requests that arrived
    in it: about 1.0 when the server keeps up, below when it falls behind.  The TTFT
    breakdown (breakdown_summary) is over the measured requests that got a first token.
    """
    if not 0 <= warmup < len(arrival_times) - 1:
        raise ValueError(f"warmup {warmup} leaves no window in {len(arrival_times)} arrivals")
    stop = run.seconds
    start, end = arrival_times[warmup], min(arrival_times[-1], stop)
    span = end - start
    everyone = [*run.results, *run.unfinished]
    measured = [r for r in everyone if r.arrival >= start]
    ttfts = window_ttfts(run, start)
    censored = sum(1 for r in measured if r.ttft is None)
    inside = [r for r in run.results if r.finished is not None and start <= r.finished < end]
    arrived = sum(1 for t in arrival_times if start <= t < end)
    prefilled = sum(r.prompt_tokens for r in everyone
                    if r.first_token is not None and start <= r.first_token < end)
    offered = sum(r.prompt_tokens for r in everyone if start <= r.arrival < end)
    finished = [r for r in measured if r.finished is not None]
    gaps = [(r.finished - r.first_token) / (len(r.output) - 1) for r in finished
            if r.first_token is not None and r.finished is not None and len(r.output) > 1]
    nan = float("nan")
    return {
        "ttft_p50_s": statistics.median(ttfts) if ttfts else nan,
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_p99_lower_bound": censored > 0,
        "itl_p50_s": statistics.median(gaps) if gaps else nan,
        "window_s": span,
        "arrived_requests_per_s": arrived / span if span > 0 else nan,
        "sustained_requests_per_s": len(inside) / span if span > 0 else nan,
        "sustained_vs_offered": len(inside) / arrived if arrived else nan,
        "input_tok_per_s": prefilled / span if span > 0 else nan,
        "offered_input_tok_per_s": offered / span if span > 0 else nan,
        "output_tok_per_s": sum(len(r.output) for r in inside) / span if span > 0 else nan,
        "tokens_gpu": sum(r.gpu_tokens for r in measured),
        "tokens_host": sum(r.host_tokens for r in measured),
        "tokens_disk": sum(r.disk_tokens for r in measured),
        "tokens_computed": sum(r.recomputed_tokens for r in measured),
        "requests": len(everyone),
        "warmup_requests": warmup,
        "measured_requests": len(measured),
        "unfinished": len(run.unfinished),
        "no_first_token": censored,
        "seconds": run.seconds,
        "io_errors": run.cache.cache.io_errors,
        "bounced_transfers": bounced_transfers(run),
        # Whether prefetch kept the disk busy while requests waited on it -- over the whole
        # run, warm-up included (the loop samples it once a step, not per window).
        "run_queued_on_disk_s": run.loop.queued_on_disk_seconds,
        "run_queued_on_disk_reading_s": run.loop.queued_on_disk_reading_seconds,
        **step_parts_summary(run, "run_"),
        **breakdown_summary(measured),
        **residency_summary(everyone, start, end),
    }


def bounced_transfers(run: RunResult) -> int:
    """Disk transfers of the run that went through the store's bounce buffer (a host page
    or staging buffer off a page boundary, which O_DIRECT cannot use); 0 without a disk
    tier, which moves none."""
    store = run.cache.store
    return 0 if store is None else store.bounced


# ---------------------------------------------------------------------- results files


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on a file backend, or None where matplotlib is not installed (the
    GPU machine: plots are drawn from the results file elsewhere)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
