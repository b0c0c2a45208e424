"""One serving replica of bench.replicas, run as a process of its own.

A replica is what one machine of a deployment runs: a model, a statekv cache with its own
GPU, host and disk tiers (plus the shared tier when its run names a Redis Cluster), and a
continuous-batching serving loop.  The router (bench/replicas.py) talks to it through one
duplex pipe, with the messages below, all plain data:

    router -> replica: StartRun, Submit..., EndRun, ..., Shutdown
    replica -> router: Ready (once, with its prefill rate), Finished per request,
                       RunDone per run, Failed (then it exits)

The model is built once per process; each run opens a fresh cache (a fresh disk directory
and, when shared, a fresh key namespace in the cluster), so no run sees another's blocks.

Times.  The router stamps each request with its arrival in seconds since the run's epoch
(a ``time.perf_counter()`` value: CLOCK_MONOTONIC on Linux, one clock for every process of
the machine).  The loop counts from its own start, so arrivals are shifted by the
difference; TTFT (first token minus arrival) then includes the hop through the router.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs

from models.serving_loop import RequestResult

# ---------------------------------------------------------------------- messages

BENCH_REMOTE_SECRET = b"statekv-bench-replicas-shared-secret"
"""Signs the shared tier's values in the replicas benchmark (every replica holds it)."""


@attrs.frozen(kw_only=True)
class ReplicaSpec:
    """What a replica process is built from (fixed for its life)."""

    index: int
    model: str
    layers: int
    vocab: int
    dtype: str
    device: str
    threads: int
    block_size: int
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int
    readers: int
    writers: int
    prefill_chunk: int
    max_step_tokens: int
    max_running: int
    prefetch_ahead: int
    cost_aware: bool
    calibration_context: int
    """Context length (tokens) at which the prefill rate is measured."""
    disk_dir: Path


@attrs.frozen(kw_only=True)
class Ready:
    index: int
    prefill_tok_per_s: float
    kv_bytes_per_token: int


@attrs.frozen(kw_only=True)
class StartRun:
    name: str
    epoch: float
    """perf_counter() value the router's arrival times count from."""
    remote_url: str | None
    remote_namespace: str
    remote_timeout_s: float


@attrs.frozen(kw_only=True)
class Submit:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: float
    """Seconds since the run's epoch."""
    ttl_seconds: float | None
    priority: int
    cache_salt: str | None


@attrs.frozen(kw_only=True)
class EndRun:
    """No more Submit in this run: finish what is queued, report, close the cache."""


@attrs.frozen(kw_only=True)
class Shutdown:
    """Leave the process."""


@attrs.frozen(kw_only=True)
class Finished:
    index: int
    result: RequestResult


@attrs.frozen(kw_only=True)
class RunDone:
    index: int
    counters: dict[str, int]
    """The cache's shared-tier and error counters for the run (see run_counters)."""


@attrs.frozen(kw_only=True)
class Failed:
    index: int
    error: str
    """The exception's last line: what the router prints."""
    detail: str
    """The whole traceback (written to the results folder's log)."""


# ---------------------------------------------------------------------- the process


def run_counters(stats: Any) -> dict[str, int]:
    """The SystemStatistics counters a run reports: fetches, publishes, errors."""
    c = stats.cache
    out = {
        "fetches": c.fetches, "fetches_completed": c.fetches_completed,
        "fetch_failures": c.fetch_failures, "bytes_fetched": c.bytes_fetched,
        "fetches_skipped_as_too_slow": c.fetches_skipped_as_too_slow,
        "publishes_offered": c.publishes_offered, "io_errors": c.io_errors,
    }
    if stats.publisher is not None:
        out["published"] = stats.publisher.published
        out["publish_failures"] = stats.publisher.failed
    return out


def replica_main(spec: ReplicaSpec, conn: Connection) -> None:
    """The process's entry point: serve runs until Shutdown (or the pipe closes)."""
    try:
        _serve(spec, conn)
    except (EOFError, KeyboardInterrupt):
        pass  # the router went away or was interrupted: it cleans up
    except BaseException as exc:
        lines = traceback.format_exception_only(type(exc), exc)
        with contextlib.suppress(OSError):
            conn.send(Failed(index=spec.index, error=lines[-1].strip(),
                             detail=traceback.format_exc()))
    finally:
        conn.close()


def _serve(spec: ReplicaSpec, conn: Connection) -> None:
    import torch

    from bench.serving import prefill_rate
    from models.config import preset
    from models.model import PagedDecoder

    # One machine of the deployment each: a replica does not borrow the other's cores.
    torch.set_num_threads(spec.threads)
    device = spec.device
    if device in ("auto", "cuda") and torch.cuda.device_count() > 1:
        device = f"cuda:{spec.index % torch.cuda.device_count()}"
    from io_actors.embed import resolve_device

    model = PagedDecoder(preset(spec.model, num_layers=spec.layers, dtype=spec.dtype,
                                vocab_size=spec.vocab), device=resolve_device(device))
    rate = prefill_rate(model, spec.block_size, spec.prefill_chunk, spec.calibration_context)
    conn.send(Ready(index=spec.index, prefill_tok_per_s=rate,
                    kv_bytes_per_token=model.config.kv_bytes_per_token()))
    while True:
        msg = conn.recv()
        if isinstance(msg, Shutdown):
            return
        if not isinstance(msg, StartRun):
            raise RuntimeError(f"replica {spec.index}: expected StartRun, got {msg!r}")
        _one_run(spec, model, device, msg, conn)


def _one_run(spec: ReplicaSpec, model: Any, device: str, run: StartRun,
             conn: Connection) -> None:
    from io_actors.config import StateKVConfig
    from io_actors.embed import BlockingCache
    from models.serving_loop import ServeRequest, ServingLoop

    spec.disk_dir.mkdir(parents=True, exist_ok=True)
    # A fresh directory per run, removed afterwards: slot files are preallocated, and the
    # local tiers must start empty in every run, as the shared tier's namespace does.
    with tempfile.TemporaryDirectory(prefix=f"replica{spec.index}-",
                                     dir=spec.disk_dir) as tmp:
        config = StateKVConfig(
            layout=model.config.kv_layout(), block_size=spec.block_size,
            gpu=spec.gpu_blocks, host=spec.host_blocks,
            reserved_host=min(64, spec.host_blocks) if spec.disk_blocks else 0,
            disk=spec.disk_blocks, disk_dir=Path(tmp), persist=False,
            writers=spec.writers, readers=spec.readers, device=device,
            model_fingerprint=model.config.fingerprint(),
            cost_aware_onboarding=spec.cost_aware,
            remote_url=run.remote_url, remote_namespace=run.remote_namespace,
            remote_timeout_s=run.remote_timeout_s,
            remote_secret=BENCH_REMOTE_SECRET if run.remote_url is not None else None,
        )
        with BlockingCache(config) as cache:
            loop = ServingLoop(model, cache, max_step_tokens=spec.max_step_tokens,
                               prefill_chunk=spec.prefill_chunk, max_running=spec.max_running,
                               prefetch_ahead=spec.prefetch_ahead)
            # Router time -> loop time: the loop counts from its own start.
            shift = run.epoch - (time.perf_counter() - loop.now())
            ending = False
            while not (ending and loop.idle):
                # Take every message waiting; when there is nothing to step, wait for one.
                wait = 0.0 if not loop.idle else 0.01
                while conn.poll(wait):
                    msg = conn.recv()
                    wait = 0.0
                    if isinstance(msg, Submit):
                        loop.submit(ServeRequest(
                            request_id=msg.request_id, prompt=msg.prompt,
                            max_new_tokens=msg.max_new_tokens, arrival=msg.arrival + shift,
                            ttl_seconds=msg.ttl_seconds, priority=msg.priority,
                            cache_salt=msg.cache_salt))
                    elif isinstance(msg, EndRun):
                        ending = True
                    else:
                        raise RuntimeError(f"replica {spec.index}: unexpected {msg!r} in a run")
                if loop.idle:
                    continue
                finished = loop.step()
                for result in finished:
                    conn.send(Finished(index=spec.index, result=result))
                if not finished and not loop.any_runnable():
                    time.sleep(0.0005)  # every request parked on a fetch or a disk read
            counters = run_counters(cache.statistics())
            cache.check_invariants()
        conn.send(RunDone(index=spec.index, counters=counters))
