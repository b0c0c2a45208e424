"""Run a workload through the serving loop over a statekv cache, and compare runs.

Shared by the demo, the identity tests and the end-to-end benchmark: one function drives a
:class:`~models.workloads.Workload` through a :class:`~models.serving_loop.ServingLoop` on a
cache built from explicit budgets, and returns every request's result.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from io_actors.actors.scheduler import SystemStatistics
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from statekv.errors import UsageError
from statekv.trace import TraceSink

from .config import ModelConfig
from .model import PagedDecoder
from .serving_loop import LoopStatistics, RequestResult, ServeRequest, ServingLoop
from .workloads import Workload


@attrs.frozen(kw_only=True)
class Budgets:
    """Cache sizes, in blocks, and the disk tier's policies."""

    block_size: int = 16
    gpu_blocks: int = 64
    host_blocks: int = 16
    reserved_host_blocks: int = 8
    disk_blocks: int = 4096
    writers: int = 2
    readers: int = 2
    spill_mode: str = "all"
    protect_unexpired: bool = False


@attrs.frozen(kw_only=True)
class RunResult:
    results: tuple[RequestResult, ...]
    cache: SystemStatistics
    loop: LoopStatistics
    seconds: float
    unfinished: tuple[RequestResult, ...] = ()
    """Requests that had arrived but not finished when the run was stopped (`stop_at`)."""

    def by_id(self) -> dict[str, RequestResult]:
        return {r.request_id: r for r in self.results}


def run_workload(
    model: PagedDecoder,
    workload: Workload,
    budgets: Budgets,
    *,
    device: str = "auto",
    disk_dir: Path | None = None,
    batch_invariant: bool = True,
    salt_every_request: bool = False,
    synchronous_io: bool = False,
    max_step_tokens: int = 512,
    prefill_chunk: int = 256,
    max_running: int = 64,
    prefetch_ahead: int = 0,
    cost_aware_onboarding: bool = True,
    reclaim_prefetched_first: bool = True,
    trace: TraceSink | None = None,
    progress: Callable[[int, int], None] | None = None,
    total: int | None = None,
    stop_at: float | None = None,
    keep_disk_dir: bool = False,
    after_step: Callable[[BlockingCache], None] | None = None,
    hold_foreground: bool | None = None,
    compute_waits: str = "all",
    copy_kernel: str = "auto",
) -> RunResult:
    """Serve every request of `workload`; closed-loop workloads get their answers back.

    `salt_every_request` gives each request its own cache salt: nothing is ever reused, the
    no-cache baseline the identity check compares with.  `prefetch_ahead` queued requests
    prefetch their disk blocks while they wait; `cost_aware_onboarding` lets the cache
    recompute disk hits that are slower to read than to prefill;
    `reclaim_prefetched_first` is StateKVConfig's (which pages host pressure takes first).
    `stop_at` (seconds from the start): stop serving then, even with requests in flight or
    still to arrive; those that had arrived are returned as `unfinished`.
    `keep_disk_dir`: `disk_dir` is the disk tier's own directory, restored at open where it
    holds a persisted tier and left in place afterwards (else a fresh directory inside it,
    removed after the run).
    `after_step` is called with the cache after every serving step: a test that checks
    what the tiers hold (not how the loop races them) lets transfers land there first.
    `hold_foreground` is the serving loop's (None: on a GPU); `compute_waits` is
    StateKVConfig's (what a step waits for on the copy stream), and so is `copy_kernel`
    (whether page copies run as kernels or DMAs).
    """
    if disk_dir is not None:
        disk_dir.mkdir(parents=True, exist_ok=True)
    # A fresh directory per run, removed afterwards: slot files are preallocated, and runs
    # one after the other must not add up on the disk.
    if keep_disk_dir and disk_dir is None:
        raise UsageError("keep_disk_dir", "needs a disk_dir")
    with (contextlib.nullcontext(str(disk_dir)) if keep_disk_dir
          else tempfile.TemporaryDirectory(prefix="statekv-run-", dir=disk_dir)) as tmp:
        directory = Path(tmp)
        config = StateKVConfig(
            layout=model.config.kv_layout(), block_size=budgets.block_size,
            gpu=budgets.gpu_blocks, host=budgets.host_blocks,
            reserved_host=budgets.reserved_host_blocks if budgets.disk_blocks else 0,
            disk=budgets.disk_blocks, disk_dir=directory, writers=budgets.writers,
            readers=budgets.readers, device=device, spill_mode=budgets.spill_mode,
            protect_unexpired=budgets.protect_unexpired,
            model_fingerprint=model.config.fingerprint(),
            cost_aware_onboarding=cost_aware_onboarding,
            reclaim_prefetched_first=reclaim_prefetched_first,
            compute_waits=compute_waits, copy_kernel=copy_kernel,
        )
        done: list[RequestResult] = []
        unfinished: list[RequestResult] = []
        with BlockingCache(config, trace=trace, synchronous_io=synchronous_io) as cache:
            loop = ServingLoop(model, cache, max_step_tokens=max_step_tokens,
                               prefill_chunk=prefill_chunk, max_running=max_running,
                               batch_invariant=batch_invariant, prefetch_ahead=prefetch_ahead,
                               hold_foreground=hold_foreground)
            started = time.perf_counter()
            while not (workload.done() and loop.idle):
                if stop_at is not None and loop.now() >= stop_at:
                    unfinished = loop.abandon()
                    break
                for req in workload.poll(loop.now()):
                    salt = f"{req.request_id}" if salt_every_request else req.cache_salt
                    loop.submit(ServeRequest(
                        request_id=req.request_id, prompt=req.prompt,
                        max_new_tokens=req.max_new_tokens, arrival=req.arrival,
                        ttl_seconds=req.ttl_seconds, priority=req.priority, cache_salt=salt,
                    ))
                finished = loop.step()
                if after_step is not None:
                    after_step(cache)
                for result in finished:
                    done.append(result)
                    workload.complete(result.request_id, result.output, now=loop.now())
                    if progress is not None:
                        progress(len(done), total or 0)
                if not finished and loop.idle:
                    upcoming = workload.next_arrival()
                    if upcoming is not None:
                        time.sleep(max(0.0, min(0.01, upcoming - loop.now())))
                elif not finished and not loop.any_runnable():
                    # Everything admitted is parked on reads (or nothing could be admitted):
                    # yield the processor to the readers and the cache's thread instead of
                    # spinning on the scheduler's lock.
                    time.sleep(0.0005)
            seconds = time.perf_counter() - started
            cache_stats = cache.statistics()
            cache.check_invariants()
            loop_stats = loop.statistics()
    return RunResult(results=tuple(done), cache=cache_stats, loop=loop_stats, seconds=seconds,
                     unfinished=tuple(unfinished))


def identical_outputs(a: RunResult, b: RunResult) -> tuple[int, int]:
    """(requests whose generated tokens are identical, requests compared)."""
    left, right = a.by_id(), b.by_id()
    same = sum(1 for rid, r in left.items() if rid in right and right[rid].output == r.output)
    return same, len(left)


def token_match_rate(a: RunResult, b: RunResult) -> float:
    """Fraction of generated tokens equal position by position."""
    left, right = a.by_id(), b.by_id()
    equal = total = 0
    for rid, r in left.items():
        other = right.get(rid)
        if other is None:
            continue
        for x, y in zip(r.output, other.output, strict=False):
            equal += x == y
        total += max(len(r.output), len(other.output))
    return equal / total if total else 1.0


def percentile(values: Sequence[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[k]


def ttft_summary(run: RunResult) -> tuple[float, float]:
    """TTFT p50 and p99 in seconds."""
    ttfts = [r.ttft for r in run.results if r.ttft is not None]
    return (statistics.median(ttfts) if ttfts else float("nan"), percentile(ttfts, 99))


def build_model(config: ModelConfig, device: str) -> PagedDecoder:
    from io_actors.embed import resolve_device

    return PagedDecoder(config, device=resolve_device(device))


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
