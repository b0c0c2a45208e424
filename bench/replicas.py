"""Goodput of two serving replicas sharing a KV tier on Redis Cluster, against two without it.

    python -m bench.replicas [--rates 0.25,0.5,1,2] [--move-probability 0.8]
                             [--repeats 3] [--warmup-requests N]
                             [--slo-ttft-p99 2] [--model 1b-class --layers 1] ...

The deployment issue 15 is about: replicas behind a router, and users whose conversations
move between them.  Each replica is a process of its own (bench/replica_process.py): the
paged-attention model of models/, a statekv cache with its own GPU, host and disk tiers, and
the continuous-batching serving loop.  The router (this process) drives one seeded
multi-round chat (models/workloads.py, the requests of bench.sweep) and sends each request
to a replica: a user's first round to a seeded replica, each later round to another replica
with probability ``--move-probability`` (default 0.8: most rounds land on a replica other
than the previous round's), else to the same one.  The rule is a function of (seed, user,
round) only, so both configurations see the same placement:

* **shared**: every replica's cache has ``remote_url`` set to one Redis Cluster (three
  masters on loopback, started here by bench/redis_cluster.py and stopped at the end, also
  on Ctrl-C or an error).  A block a replica evicts from its GPU is published; a replica
  that meets a user's earlier rounds fetches them instead of recomputing.
* **local**: the same replicas, the same tiers, no shared tier: a user who moved recomputes
  the history the other replica holds.

Each run uses fresh local tiers and a fresh key namespace in the cluster.  Rates are
multiples of the deployment's *capacity*, calibrated in the same run: each replica measures
its model's prefill rate at the workload's mean prompt length (bench.serving.prefill_rate),
and capacity is the replicas' summed full-reuse capacity (bench.serving.full_reuse_capacity:
requests/s if every earlier round were reused).  Per configuration and rate: TTFT p50 / p99,
input tokens/s sustained against offered, prompt tokens by the tier they came from (GPU,
host, disk, shared tier, computed), how many rounds moved, and the shared tier's fetches and
publishes.

**Populations.**  TTFT p50 / p99, and so goodput, are computed over three sets of requests:
``moved``, the rounds sent to another replica than their user's previous round (the only
requests whose work differs between the configurations: the shared tier can serve their
history, local recomputes it); ``window``, every request after the warm-up; ``all``.  The
warm-up is the first ``--warmup-requests`` arrivals (default one per user: the chat's
schedule issues every user's first round first, and a first round computes its history on
either configuration), as in bench.sweep.  ``moved`` (after the warm-up) is the headline:
with a few dozen requests per run, the p99 over every request is one or two first rounds
queued behind each other, the same work in both configurations, and decides nothing about
the tier.

**Repeats.**  A p99 of a few dozen requests varies from run to run, so every configuration
and rate is served on ``--repeats`` seeded workloads (seed, seed + 1, ...: arrivals, prompts
and placement all follow the seed; the same for both configurations).  Goodput is
bench.sweep's, the highest offered rate at and below which TTFT p99 met ``--slo-ttft-p99``,
per repeat; the summary gives each configuration's median and min-max, the shared / local
ratio's median and min-max (over the repeats that pin it) and in how many repeats shared was
higher, tied or lower on the rate grid.  The file keeps every repeat's runs and every
request's first token.

After the runs, on the same cluster, the shared tier's fetch rate for one block of this
model is measured against ``redis-benchmark``'s GET rate for the same value size (the method
of bench/remote.py), so the results say how fast the tier was in this very run.

The results file (shared/BENCH_FORMAT.md) is ``replicas-<machine>-<date>.json`` in
``--out``, rewritten after every run so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import multiprocessing
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Final

import attrs
from tqdm import tqdm

from bench.flags import (
    OneLineParser,
    comma_list,
    device_name,
    int_at_least,
    positive_number,
    results_tag,
    shape_preset,
)
from bench.redis_cluster import LocalRedisCluster, find_redis_tools, running_cluster
from bench.replica_process import (
    EndRun,
    Failed,
    Finished,
    Ready,
    ReplicaSpec,
    RunDone,
    Shutdown,
    StartRun,
    Submit,
    replica_main,
)
from bench.results_files import source_commit
from bench.serving import (
    chat_config,
    full_reuse_capacity,
    mean_prompt_tokens,
)
from bench.sweep import goodput, goodput_row
from models.chat_run import percentile
from models.serving_loop import RequestResult
from models.workloads import ChatWorkload

MODES: Final = ("shared", "local")
"""The two configurations: one shared tier for every replica, or none."""
STARTUP_TIMEOUT_S: Final = 600.0
"""Building a replica's model and measuring its prefill rate."""
REPORT_TIMEOUT_S: Final = 120.0
"""A replica's last report of a run, after it finished every request."""
POPULATIONS: Final = {
    "moved": "rounds that moved to another replica than their user's previous round, "
             "after the warm-up",
    "window": "every request after the warm-up",
    "all": "every request, the warm-up included",
}
"""The requests each TTFT p50 / p99 (and so each goodput) is over."""
HEADLINE: Final = "moved"
"""The goodput the comparison leads with: TTFT over the moved rounds, the only requests
whose work differs between the configurations (a first round computes its history on
either; a round that stayed finds its KV on its own replica on either)."""


class ReplicasError(Exception):
    """What stops the benchmark, said on one line (a flag, a replica that failed)."""


# ---------------------------------------------------------------------- routing


def route(seed: int, user: int, round_: int, previous: int | None, replicas: int,
          move_probability: float) -> int:
    """The replica that serves round `round_` of `user`.

    Round 0 goes to a seeded replica; a later round moves to another replica (seeded, never
    the previous one) with probability `move_probability`, else stays.  A function of its
    arguments only: both configurations, and every rate, place every request alike.
    """
    rng = random.Random(f"route:{seed}:{user}:{round_}")  # str seeds hash the same everywhere
    if previous is None:
        return rng.randrange(replicas)
    if rng.random() < move_probability:
        other = rng.randrange(replicas - 1)
        return other + (other >= previous)
    return previous


@attrs.define
class Routing:
    """The router's memory: where each user's previous round went."""

    seed: int
    replicas: int
    move_probability: float
    last: dict[int, int] = attrs.field(factory=dict)
    moved: set[tuple[int, int]] = attrs.field(factory=set)
    """(user, round) of the rounds sent to a replica other than their user's previous
    round's: the rounds only a shared tier can serve from an earlier round's KV."""

    @property
    def moves(self) -> int:
        return len(self.moved)

    def place(self, user: int, round_: int) -> int:
        previous = self.last.get(user)
        target = route(self.seed, user, round_, previous, self.replicas, self.move_probability)
        if previous is not None and target != previous:
            self.moved.add((user, round_))
        self.last[user] = target
        return target


# ---------------------------------------------------------------------- flags


def _rates(text: str) -> list[float]:
    return sorted(comma_list(positive_number)(text))


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    n0, n1, pos = int_at_least(0), int_at_least(1), positive_number
    p = OneLineParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int_at_least(2), default=2,
                   help="serving replicas, one process each")
    p.add_argument("--move-probability", type=_probability, default=0.8,
                   help="chance that a user's next round goes to another replica")
    p.add_argument("--rates", type=_rates, default=[0.25, 0.5, 1.0, 2.0],
                   help="offered rates as multiples of the calibrated capacity, comma-separated")
    p.add_argument("--slo-ttft-p99", type=pos, default=2.0,
                   help="goodput's SLO: TTFT p99 in seconds")
    p.add_argument("--modes", choices=("both", *MODES), default="both",
                   help="run both configurations (the comparison) or one")
    # The model: a real layer width, shallow, with a small vocabulary (the embedding of a
    # 128k vocabulary is most of a one-layer model's weights and none of its attention).
    p.add_argument("--model", type=shape_preset, default="1b-class",
                   help="layer shape (models/config.py presets)")
    p.add_argument("--layers", type=n1, default=1)
    p.add_argument("--vocab", type=int_at_least(2), default=1024)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--device", type=device_name, default="auto")
    p.add_argument("--threads", type=n1, default=1, help="torch threads per replica")
    # The workload (models/workloads.py's chat).
    p.add_argument("--users", type=n1, default=12)
    p.add_argument("--rounds", type=n1, default=3)
    p.add_argument("--system-tokens", type=n0, default=256)
    p.add_argument("--history-tokens", type=n0, default=512,
                   help="per-user history before the first question")
    p.add_argument("--question-tokens", type=n1, default=64)
    p.add_argument("--answer-tokens", type=n1, default=8)
    p.add_argument("--seed", type=n0, default=0,
                   help="the first repeat's seed (workload and placement); repeat k uses "
                        "seed + k")
    p.add_argument("--repeats", type=n1, default=3,
                   help="seeded workloads each configuration and rate is served on")
    p.add_argument("--warmup-requests", type=n0, default=None,
                   help="first arrivals left out of the TTFT window (default: one per user, "
                        "the users' first rounds)")
    # Each replica's tiers, in blocks.
    p.add_argument("--block-size", type=n1, default=16, help="tokens per KV block")
    p.add_argument("--gpu-blocks", type=n1, default=128)
    p.add_argument("--host-blocks", type=n1, default=128)
    p.add_argument("--disk-blocks", type=n0, default=2048)
    p.add_argument("--readers", type=n1, default=2)
    p.add_argument("--writers", type=n1, default=2)
    p.add_argument("--prefill-chunk", type=n1, default=512)
    p.add_argument("--max-step-tokens", type=n1, default=1024)
    p.add_argument("--max-running", type=n1, default=64)
    p.add_argument("--prefetch-ahead", type=n0, default=8,
                   help="queued requests that prefetch their disk blocks; 0: off")
    p.add_argument("--no-cost-aware", action="store_true",
                   help="always fetch / read hits back, even where recomputing is faster")
    p.add_argument("--remote-timeout", type=pos, default=1.0,
                   help="the shared tier's bound on each network wait, seconds")
    p.add_argument("--redis-maxmemory", default="512mb",
                   help="each master's maxmemory (allkeys-lru evicts past it)")
    # The fetch-rate measurement after the runs.
    p.add_argument("--fetch-seconds", type=pos, default=3.0,
                   help="length of the shared tier's fetch-rate measurement")
    p.add_argument("--skip-fetch-probe", action="store_true",
                   help="do not measure the fetch rate against redis-benchmark")
    p.add_argument("--run-timeout", type=pos, default=900.0,
                   help="seconds a run may take before the benchmark gives up")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bars (auto: when stderr is a terminal)")
    p.add_argument("--machine", default=None,
                   help="machine name in the results file (default: h200 with CUDA, else cpu)")
    p.add_argument("--tag", type=results_tag, default=None,
                   help="appended to the results file's name (runs of one day apart)")
    p.add_argument("--dir", type=Path, default=None, help="where the replicas' disk tiers go")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p


def check_args(args: argparse.Namespace) -> None:
    """What the flags cannot say alone, checked before anything starts."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,32}", args.machine or "cpu"):
        raise ReplicasError(f"argument --machine: must be 1 to 32 letters, digits, '.', '_' "
                            f"or '-', got {args.machine!r}")
    if not re.fullmatch(r"[0-9]+(kb|mb|gb)", args.redis_maxmemory.lower()):
        raise ReplicasError(f"argument --redis-maxmemory: must be a size such as 512mb, got "
                            f"{args.redis_maxmemory!r}")
    last_round = args.system_tokens + args.history_tokens + args.rounds * (
        args.question_tokens + args.answer_tokens)
    warmup = args.users if args.warmup_requests is None else args.warmup_requests
    if warmup >= args.users * args.rounds:
        raise ReplicasError(f"argument --warmup-requests: must be below the "
                            f"{args.users * args.rounds} requests of a run, got {warmup}")
    needed = -(-last_round // args.block_size)
    if needed > args.gpu_blocks:
        raise ReplicasError(f"argument --gpu-blocks: the last round needs {needed} blocks of "
                            f"{args.block_size} tokens; --gpu-blocks is {args.gpu_blocks}")
    if args.host_blocks < 1 and args.modes != "local":
        raise ReplicasError("argument --host-blocks: the shared tier publishes from host "
                            "pages, so it needs at least one")
    if find_redis_tools() is None and args.modes != "local":
        raise ReplicasError("redis-server / redis-cli not found: apt-get install -y "
                            "redis-server (or --modes local)")


# ---------------------------------------------------------------------- replicas


@attrs.define
class ReplicaHandle:
    process: BaseProcess
    conn: Connection
    ready: Ready | None = None


@contextlib.contextmanager
def started_replicas(specs: Sequence[ReplicaSpec]) -> Iterator[list[ReplicaHandle]]:
    """One process per spec, each Ready (model built, prefill rate measured); shut down and
    joined on the way out, whatever happened."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    handles: list[ReplicaHandle] = []
    try:
        for spec in specs:
            ours, theirs = ctx.Pipe(duplex=True)
            process = ctx.Process(target=replica_main, args=(spec, theirs),
                                  name=f"replica-{spec.index}", daemon=True)
            process.start()
            theirs.close()
            handles.append(ReplicaHandle(process=process, conn=ours))
        for handle in handles:
            msg = _receive(handles, handle, STARTUP_TIMEOUT_S)
            if not isinstance(msg, Ready):
                raise ReplicasError(f"replica {handle.process.name}: expected Ready, got {msg!r}")
            handle.ready = msg
        yield handles
    finally:
        for handle in handles:
            with contextlib.suppress(OSError, ValueError):
                handle.conn.send(Shutdown())
        for handle in handles:
            handle.process.join(timeout=10)
            if handle.process.is_alive():
                handle.process.terminate()
                handle.process.join(timeout=10)
            handle.conn.close()


def _failure(handle: ReplicaHandle, msg: object) -> ReplicasError:
    if isinstance(msg, Failed):
        return ReplicasError(f"replica {msg.index} failed: {msg.error}")
    return ReplicasError(f"replica {handle.process.name} sent {msg!r}")


def _receive(handles: Sequence[ReplicaHandle], handle: ReplicaHandle, timeout: float) -> object:
    """The next message of `handle`; a replica that fails or dies meanwhile is an error."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReplicasError(f"replica {handle.process.name} did not answer in {timeout:g} s")
        if handle.conn.poll(min(left, 0.5)):
            try:
                msg = handle.conn.recv()
            except EOFError:
                raise _died(handle) from None
            if isinstance(msg, Failed):
                raise _failure(handle, msg)
            return msg
        for other in handles:
            if not other.process.is_alive() and not other.conn.poll():
                raise _died(other)


def _died(handle: ReplicaHandle) -> ReplicasError:
    handle.process.join(timeout=5)
    return ReplicasError(f"replica {handle.process.name} exited (code "
                         f"{handle.process.exitcode})")


# ---------------------------------------------------------------------- one run


@attrs.frozen(kw_only=True)
class RunOutcome:
    results: tuple[tuple[int, RequestResult], ...]
    """(replica, result) of every request, in finishing order."""
    seconds: float
    """From the run's start to the last answer reaching the router."""
    counters: tuple[dict[str, int], ...]
    """Each replica's shared-tier and error counters."""
    moves: int
    order: tuple[str, ...] = ()
    """Request ids in arrival order (the order the router sent them)."""
    moved: frozenset[str] = frozenset()
    """Ids of the requests that moved to another replica than their user's previous round."""


def serve_run(handles: Sequence[ReplicaHandle], workload: ChatWorkload, routing: Routing, *,
              remote_url: str | None, namespace: str, remote_timeout_s: float,
              timeout_s: float, tick: Callable[[int], None]) -> RunOutcome:
    """Drive `workload` through the replicas: route each request, feed answers back."""
    epoch = time.perf_counter()
    for handle in handles:
        handle.conn.send(StartRun(name=namespace, epoch=epoch, remote_url=remote_url,
                                  remote_namespace=namespace,
                                  remote_timeout_s=remote_timeout_s))
    done: list[tuple[int, RequestResult]] = []
    total = workload.total_requests
    conns = {h.conn: h for h in handles}
    sentinels = {h.process.sentinel: h for h in handles}
    last = 0.0
    order: list[str] = []
    moved: set[str] = set()
    while len(done) < total:
        now = time.perf_counter() - epoch
        if now > timeout_s:
            raise ReplicasError(f"a run took over --run-timeout {timeout_s:g} s "
                                f"({len(done)} of {total} requests answered)")
        for req in workload.poll(now):
            assert req.user is not None and req.round is not None  # a chat request
            target = routing.place(req.user, req.round)
            order.append(req.request_id)
            if (req.user, req.round) in routing.moved:
                moved.add(req.request_id)
            handles[target].conn.send(Submit(
                request_id=req.request_id, prompt=req.prompt,
                max_new_tokens=req.max_new_tokens, arrival=req.arrival,
                ttl_seconds=req.ttl_seconds, priority=req.priority, cache_salt=req.cache_salt))
        upcoming = workload.next_arrival()
        timeout = 0.05 if upcoming is None else min(0.05, max(0.0, upcoming - now))
        for ready in wait([*conns, *sentinels], timeout):
            if ready in sentinels and not sentinels[ready].conn.poll():
                raise _died(sentinels[ready])
            handle = conns.get(ready)  # type: ignore[call-overload]
            if handle is None:
                continue
            while handle.conn.poll():
                try:
                    msg = handle.conn.recv()
                except EOFError:
                    raise _died(handle) from None
                if not isinstance(msg, Finished):
                    raise _failure(handle, msg)
                last = time.perf_counter() - epoch
                workload.complete(msg.result.request_id, msg.result.output, now=last)
                done.append((msg.index, msg.result))
                tick(len(done))
    counters: list[dict[str, int]] = []
    for handle in handles:
        handle.conn.send(EndRun())
    for handle in handles:
        msg = _receive(handles, handle, REPORT_TIMEOUT_S)
        if not isinstance(msg, RunDone):
            raise _failure(handle, msg)
        counters.append(msg.counters)
    return RunOutcome(results=tuple(done), seconds=last, counters=tuple(counters),
                      moves=routing.moves, order=tuple(order), moved=frozenset(moved))


def populations(outcome: RunOutcome, warmup: int) -> dict[str, list[str]]:
    """The request ids each TTFT figure is over (POPULATIONS says what each one is)."""
    window = list(outcome.order[warmup:])
    return {"moved": [rid for rid in window if rid in outcome.moved],
            "window": window, "all": list(outcome.order)}


def ttft_stats(ttfts: Sequence[float | None]) -> dict[str, Any]:
    """p50 / p99 of the first tokens of some requests; one that never came is a miss."""
    got = [t for t in ttfts if t is not None]
    missing = len(ttfts) - len(got)
    # A request without a first token counts as the slowest (it failed every SLO).
    pool = got + [math.inf] * missing
    return {"count": len(ttfts), "p50_s": statistics.median(pool) if pool else None,
            "p99_s": percentile(pool, 99) if pool else None}


def summarize(outcome: RunOutcome, *, offered_rps: float, offered_input_tps: float,
              warmup: int = 0) -> dict[str, Any]:
    """One run's row: latency, throughput, where prompt tokens came from, the tier's work."""
    results = [r for _i, r in outcome.results]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    by_id = {r.request_id: (i, r) for i, r in outcome.results}
    prompt = sum(r.prompt_tokens for r in results)
    seconds = outcome.seconds
    row: dict[str, Any] = {
        "requests_per_s": offered_rps,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "input_tok_per_s": prompt / seconds if seconds else None,
        "offered_input_tok_per_s": offered_input_tps,
        "sustained_vs_offered": prompt / seconds / offered_input_tps if seconds else None,
        "output_tok_per_s": sum(len(r.output) for r in results) / seconds if seconds else None,
        "tokens_prompt": prompt,
        "tokens_gpu": sum(r.gpu_tokens for r in results),
        "tokens_host": sum(r.host_tokens for r in results),
        "tokens_disk": sum(r.disk_tokens for r in results),
        "tokens_remote": sum(r.remote_tokens for r in results),
        "tokens_computed": sum(r.recomputed_tokens for r in results),
        "requests": len(results),
        "requests_per_replica": [sum(1 for i, _r in outcome.results if i == n)
                                 for n in range(len(outcome.counters))],
        "moved_rounds": outcome.moves,
        "fell_back": sum(r.fell_back for r in results),
        "seconds": seconds,
        # TTFT over each population (POPULATIONS); goodput is computed on each.
        "ttft": {name: ttft_stats([by_id[rid][1].ttft for rid in ids])
                 for name, ids in populations(outcome, warmup).items()},
        # Every request's first token, in arrival order, so the figures can be recomputed
        # (or pooled across repeats) from the file: [id, replica, moved, ttft seconds].
        "requests_ttft": [[rid, by_id[rid][0], rid in outcome.moved, by_id[rid][1].ttft]
                          for rid in outcome.order],
    }
    # What the slowest first tokens waited on: p99 of a few dozen requests is one or two of
    # them, so the file says which, and where their prompts came from.
    slowest = sorted(outcome.results, key=lambda ir: -(ir[1].ttft or 0.0))[:3]
    row["slowest"] = [{
        "request_id": r.request_id, "replica": i, "ttft_s": r.ttft,
        "parked_s": r.parked_seconds, "queued_s": (r.admitted or r.arrival) - r.arrival,
        "prompt": r.prompt_tokens, "gpu": r.gpu_tokens, "host": r.host_tokens,
        "disk": r.disk_tokens, "remote": r.remote_tokens, "computed": r.recomputed_tokens,
    } for i, r in slowest]
    for key in outcome.counters[0] if outcome.counters else ():
        row[key] = sum(c.get(key, 0) for c in outcome.counters)
    return row


# ---------------------------------------------------------------------- the fetch probe


def fetch_probe(cluster: LocalRedisCluster, spec: ReplicaSpec, kv_bytes_per_token: int, *,
                seconds: float) -> dict[str, Any] | None:
    """The shared tier's verified fetch rate for this model's blocks, and redis-benchmark's
    GET rate for values of the same size, on the same cluster (bench/remote.py's method).
    None where redis-benchmark is not installed."""
    tool = shutil.which("redis-benchmark")
    if tool is None:
        return None
    import torch

    from bench.remote import MASTERS, benchmark_get_rate, fetch_rate
    from io_actors.storage.redis_store import RedisClusterStore, RemoteIO
    from io_actors.storage.slot_format import HEADER_SIZE
    from models.config import preset
    from statekv.config import CacheConfig
    from statekv.hashing import chain_key, root_key, token_bytes
    from statekv.ids import BlockHash

    model_config = preset(spec.model, num_layers=spec.layers, dtype=spec.dtype,
                          vocab_size=spec.vocab)
    config = CacheConfig(block_size=spec.block_size, gpu_blocks=8,
                         model_fingerprint=model_config.fingerprint(),
                         layout=model_config.kv_layout())
    assert config.block_bytes == kv_bytes_per_token * spec.block_size
    value_bytes = HEADER_SIZE + config.block_bytes
    batch, threads, blocks = 16, 2, 256
    with RedisClusterStore(cluster.url, config, namespace=f"probe-{uuid.uuid4().hex[:8]}",
                           timeout_s=5.0) as store:
        keys: list[BlockHash] = []
        parent = root_key(config.model_fingerprint, None, None)
        for i in range(blocks):
            parent = chain_key(parent, token_bytes(range(i * spec.block_size,
                                                         (i + 1) * spec.block_size)))
            keys.append(parent)
        g = torch.Generator().manual_seed(0)
        for first in range(0, blocks, 32):
            items = [RemoteIO(k, torch.randint(0, 256, (config.block_bytes,),
                                               dtype=torch.uint8, generator=g))
                     for k in keys[first:first + 32]]
            if any(o is not None for o in store.publish_many(items)):
                raise ReplicasError("the fetch probe could not publish its blocks")
        fetch_rate(store, keys, batch=batch, threads=threads, seconds=min(0.5, seconds))
        values_per_s, _count = fetch_rate(store, keys, batch=batch, threads=threads,
                                          seconds=seconds)
    pipeline = max(1, batch // MASTERS)
    get_per_s = benchmark_get_rate(
        str(Path(tool).parent), cluster.nodes[0].port, value_bytes=value_bytes,
        connections=threads * MASTERS, pipeline=pipeline,
        requests=max(10_000, int(3 * values_per_s * seconds)))
    return {"value_bytes": value_bytes, "fetch_values_per_s": values_per_s,
            "fetch_gb_per_s": values_per_s * value_bytes / 1e9,
            "redis_benchmark_get_per_s": get_per_s,
            "redis_benchmark_gb_per_s": get_per_s * value_bytes / 1e9,
            "redis_benchmark_flags": f"-d {value_bytes} -c {threads * MASTERS} -P {pipeline}",
            "kv_tokens_per_s": values_per_s * spec.block_size}


# ---------------------------------------------------------------------- results


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def goodput_rows(doc: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
                 population: str) -> dict[str, dict[str, Any]]:
    """Goodput of each configuration of one repeat, TTFT p99 over `population`."""
    rates = doc["rates"]
    table: dict[str, dict[str, Any]] = {}
    for mode, rows in runs.items():
        if not rows or len(rows) < len(rates):
            continue  # cut short: this configuration's sweep is incomplete
        g = goodput([r["requests_per_s"] for r in rates],
                    [r["ttft"][population]["p99_s"] for r in rows], doc["slo_ttft_p99_s"])
        table[mode] = goodput_row(g, rates, "rate_index")
    return table


def compare(shared: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
    """Shared against local goodput in one repeat: which is higher on the rate grid, and the
    ratio where the grid pins it (both met the SLO somewhere, local's knee inside the grid;
    a shared goodput that met it at every rate makes the ratio a lower bound)."""
    # "Never met" ranks below the lowest rate.
    s_index = -1 if shared["rate_index"] is None else shared["rate_index"]
    l_index = -1 if local["rate_index"] is None else local["rate_index"]
    out: dict[str, Any] = {
        "order": "shared" if s_index > l_index else "local" if l_index > s_index else "tie",
        "ratio": None, "lower_bound": False}
    if shared["requests_per_s"] and local["requests_per_s"] and local["status"] == "below_next":
        out["ratio"] = shared["requests_per_s"] / local["requests_per_s"]
        out["lower_bound"] = shared["status"] == "every_rate"
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median and min-max of per-repeat values (None where there are none)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Across the repeats: per rate, the median and range of each TTFT figure; per
    population, each configuration's goodput and the shared/local ratio, median and range."""
    repeats = doc["repeats"]
    per_rate: list[dict[str, Any]] = []
    for k, rate in enumerate(doc["rates"]):
        entry: dict[str, Any] = {"capacity_multiple": rate["capacity_multiple"],
                                 "requests_per_s": rate["requests_per_s"]}
        for mode in doc["modes"]:
            rows = [rep["runs"][mode][k] for rep in repeats if len(rep["runs"][mode]) > k]
            entry[mode] = {
                pop: {"p50_s": spread([r["ttft"][pop]["p50_s"] for r in rows]),
                      "p99_s": spread([r["ttft"][pop]["p99_s"] for r in rows])}
                for pop in POPULATIONS}
            entry[mode]["tokens_computed"] = spread([r["tokens_computed"] for r in rows])
            entry[mode]["tokens_remote"] = spread([r["tokens_remote"] for r in rows])
        per_rate.append(entry)
    good: dict[str, Any] = {}
    for pop in POPULATIONS:
        tables = [rep["goodput"][pop] for rep in repeats if rep.get("goodput")]
        g: dict[str, Any] = {
            mode: {"requests_per_s": spread([t[mode]["requests_per_s"] or 0.0 for t in tables
                                              if mode in t]),
                   "never_met": sum(1 for t in tables
                                    if mode in t and t[mode]["requests_per_s"] is None)}
            for mode in doc["modes"]}
        pairs = [compare(t["shared"], t["local"]) for t in tables
                 if "shared" in t and "local" in t]
        if pairs:
            g["shared_vs_local"] = {
                "ratio": spread([c["ratio"] for c in pairs if c["ratio"] is not None]),
                "ratio_lower_bounds": sum(1 for c in pairs if c["lower_bound"]),
                "repeats": len(pairs),
                "shared_higher": sum(1 for c in pairs if c["order"] == "shared"),
                "tied": sum(1 for c in pairs if c["order"] == "tie"),
                "local_higher": sum(1 for c in pairs if c["order"] == "local")}
        good[pop] = g
    return {"per_rate": per_rate, "goodput": good}


def figures(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """BENCH_FORMAT figures: goodput against the same-run capacity (median of the repeats,
    with their range), shared against local per population, and the tier's fetch rate
    against redis-benchmark's."""
    out: dict[str, dict[str, Any]] = {
        "prefill_rate_per_replica": {"value": round(doc["prefill_tok_per_s"], 1),
                                     "unit": "tok/s"},
    }
    capacity = doc["capacity_requests_per_s"]

    def rounded(s: dict[str, Any], digits: int) -> dict[str, Any]:
        return {"min": round(s["min"], digits), "max": round(s["max"], digits),
                "repeats": s["n"]}

    for pop, g in doc["summary"]["goodput"].items():
        prefix = "goodput" if pop == HEADLINE else f"goodput_{pop}"
        for mode in doc["modes"]:
            rps = g[mode]["requests_per_s"]
            if rps["median"] is None or g[mode]["never_met"] * 2 >= rps["n"]:
                continue  # the median repeat never met the SLO: not measured, so absent
            out[f"{prefix}_{mode}"] = {
                "value": round(rps["median"], 4), "unit": "requests/s",
                "limit": round(capacity, 4),
                "limit_name": f"{doc['replicas']} replicas' full-reuse capacity from the "
                              "prefill rate, same run",
                "ratio": round(rps["median"] / capacity, 3), **rounded(rps, 4),
                "ttft_over": POPULATIONS[pop]}
        vs = g.get("shared_vs_local")
        # A ratio only where most repeats pin it: the median of one repeat in three is not
        # the run-to-run figure (the counts say what the others did).
        if vs and vs["ratio"]["median"] is not None and vs["ratio"]["n"] * 2 > vs["repeats"]:
            ratio = vs["ratio"]
            out[f"{prefix}_shared_vs_local"] = {
                "value": round(ratio["median"], 3), "unit": "x",
                "ratio": round(ratio["median"], 3), **rounded(ratio, 3),
                "lower_bounds": vs["ratio_lower_bounds"],
                "shared_higher": vs["shared_higher"], "tied": vs["tied"],
                "local_higher": vs["local_higher"], "ttft_over": POPULATIONS[pop]}
    probe = doc.get("fetch_probe")
    if probe:
        out["fetch_from_cluster"] = {
            "value": round(probe["fetch_gb_per_s"], 4), "unit": "GB/s",
            "limit": round(probe["redis_benchmark_gb_per_s"], 4),
            "limit_name": f"redis-benchmark --cluster GET, {probe['redis_benchmark_flags']}, "
                          "same run",
            "ratio": round(probe["fetch_gb_per_s"] / probe["redis_benchmark_gb_per_s"], 3)}
        # KV a fetch brings per second, in tokens, against the tokens prefill computes.
        out["fetch_vs_prefill_tokens"] = {
            "value": round(probe["kv_tokens_per_s"], 1), "unit": "tok/s",
            "limit": round(doc["prefill_tok_per_s"], 1),
            "limit_name": "one replica's prefill rate, same run",
            "ratio": round(probe["kv_tokens_per_s"] / doc["prefill_tok_per_s"], 2)}
    return out


def write_results(path: Path, doc: dict[str, Any]) -> None:
    for rep in doc["repeats"]:
        rep["goodput"] = {pop: goodput_rows(doc, rep["runs"], pop) for pop in POPULATIONS}
    doc["summary"] = summary(doc)
    doc["figures"] = figures(doc)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(doc), indent=2) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------- the benchmark


def run_benchmark(args: argparse.Namespace, argv: Sequence[str],
                  cluster: LocalRedisCluster | None) -> Path:
    """Every run of the comparison on `cluster` (None: local runs only); the results file."""
    import torch

    machine = args.machine or ("h200" if torch.cuda.is_available() else "cpu")
    modes = MODES if args.modes == "both" else (args.modes,)
    if "shared" in modes and cluster is None:
        raise ReplicasError("the shared configuration needs a cluster")
    today = dt.date.today()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path: Path = args.out / f"replicas-{machine}-{today:%Y%m%d}{tag}.json"
    disable = {"auto": None, "always": False, "never": True}[args.progress]

    def say(text: str) -> None:
        tqdm.write(text, file=sys.stderr if disable is not True else sys.stdout)

    vocab = args.vocab
    warmup = args.users if args.warmup_requests is None else args.warmup_requests
    shape = chat_config(args, vocab, 1.0, history_tokens=args.history_tokens)
    mean_prompt = mean_prompt_tokens(shape)
    disk_root = args.dir or Path(tempfile.gettempdir()) / "statekv-replicas"
    specs = [ReplicaSpec(
        index=i, model=args.model, layers=args.layers, vocab=vocab, dtype=args.dtype,
        device=args.device, threads=args.threads, block_size=args.block_size,
        gpu_blocks=args.gpu_blocks, host_blocks=args.host_blocks,
        disk_blocks=args.disk_blocks, readers=args.readers, writers=args.writers,
        prefill_chunk=args.prefill_chunk, max_step_tokens=args.max_step_tokens,
        max_running=args.max_running, prefetch_ahead=args.prefetch_ahead,
        cost_aware=not args.no_cost_aware,
        calibration_context=max(args.block_size, int(mean_prompt) // args.block_size
                                * args.block_size),
        disk_dir=disk_root) for i in range(args.replicas)]
    say(f"starting {args.replicas} replicas ({args.model} x{args.layers}, {args.dtype}, "
        f"{args.threads} thread(s) each) and measuring their prefill rate ...")
    with started_replicas(specs) as handles:
        readies = [h.ready for h in handles if h.ready is not None]
        prefill = statistics.fmean(r.prefill_tok_per_s for r in readies)
        capacity = args.replicas * full_reuse_capacity(shape, prefill)
        doc: dict[str, Any] = {
            "bench": "replicas", "machine": machine, "date": today.isoformat(),
            "commit": source_commit(), "command": "python -m bench.replicas " + " ".join(argv),
            "replicas": args.replicas, "move_probability": args.move_probability,
            "model": f"{args.model}-x{args.layers}-{args.dtype}-v{vocab}",
            "kv_bytes_per_token": readies[0].kv_bytes_per_token,
            "prefill_tok_per_s": prefill,
            "prefill_tok_per_s_by_replica": [r.prefill_tok_per_s for r in readies],
            "prefill_context_tokens": specs[0].calibration_context,
            "capacity_requests_per_s": capacity,
            "mean_prompt_tokens": mean_prompt,
            "slo_ttft_p99_s": args.slo_ttft_p99,
            "rates": [{"capacity_multiple": m, "requests_per_s": m * capacity,
                       "input_tok_per_s": m * capacity * mean_prompt} for m in args.rates],
            "modes": list(modes), "warmup_requests": warmup,
            "populations": dict(POPULATIONS), "headline": HEADLINE,
            "repeats": [],
        }
        requests = shape.num_users * shape.num_rounds
        say(f"prefill {prefill:,.0f} tok/s per replica at context "
            f"{specs[0].calibration_context}; capacity {capacity:.2f} requests/s "
            f"({args.replicas} replicas, full reuse); {requests} requests per run, "
            f"mean prompt {mean_prompt:.0f} tokens, the first {warmup} left out of the "
            f"window; {args.repeats} repeat(s)")
        bar = tqdm(total=args.repeats * len(args.rates) * len(modes), desc="runs",
                   unit="run", disable=disable, position=0)
        # Repeats outer, then rates ascending, then the configurations: a run cut short
        # keeps whole repeats, and compares both configurations at every rate it reached.
        for k in range(args.repeats):
            seed = args.seed + k
            # Each repeat its own workload (arrivals, prompts, placement), the same for both
            # configurations and every rate.
            seeded = argparse.Namespace(**{**vars(args), "seed": seed})
            repeat: dict[str, Any] = {"seed": seed, "runs": {mode: [] for mode in modes}}
            doc["repeats"].append(repeat)
            for rate in doc["rates"]:
                for mode in modes:
                    bar.set_description(f"seed {seed} {mode} x{rate['capacity_multiple']:g}")
                    inner = tqdm(total=requests, desc="requests", unit="req", leave=False,
                                 disable=disable, position=1)

                    def tick(n: int, inner: tqdm[Any] = inner) -> None:
                        inner.update(n - inner.n)

                    workload = ChatWorkload(chat_config(seeded, vocab, rate["requests_per_s"],
                                                        history_tokens=args.history_tokens))
                    routing = Routing(seed=seed, replicas=args.replicas,
                                      move_probability=args.move_probability)
                    namespace = f"replicas-{uuid.uuid4().hex[:12]}"
                    outcome = serve_run(
                        handles, workload, routing,
                        remote_url=cluster.url if mode == "shared" and cluster else None,
                        namespace=namespace, remote_timeout_s=args.remote_timeout,
                        timeout_s=args.run_timeout, tick=tick)
                    inner.close()
                    row = summarize(outcome, offered_rps=rate["requests_per_s"],
                                    offered_input_tps=rate["input_tok_per_s"], warmup=warmup)
                    row["capacity_multiple"] = rate["capacity_multiple"]
                    repeat["runs"][mode].append(row)
                    write_results(path, doc)
                    bar.update()
                    say(run_line(mode, seed, row))
        bar.close()
        if cluster is not None and not args.skip_fetch_probe:
            say("measuring the shared tier's fetch rate against redis-benchmark ...")
            doc["fetch_probe"] = fetch_probe(cluster, specs[0], readies[0].kv_bytes_per_token,
                                             seconds=args.fetch_seconds)
            write_results(path, doc)
    say(goodput_text(doc))
    return path


def _secs(value: float | None) -> str:
    return "    n/a" if value is None else f"{value:7.3f}"


def run_line(mode: str, seed: int, row: dict[str, Any]) -> str:
    t = row["ttft"]
    return (f"  seed {seed} x{row['capacity_multiple']:<5g} {mode:<6} TTFT p50/p99 moved "
            f"{_secs(t['moved']['p50_s'])}/{_secs(t['moved']['p99_s'])} s, all "
            f"{_secs(t['all']['p50_s'])}/{_secs(t['all']['p99_s'])} s  in "
            f"{row['input_tok_per_s'] or 0:8,.0f} tok/s ({row['sustained_vs_offered'] or 0:.2f}x "
            f"offered)  gpu/host/disk/remote/computed {row['tokens_gpu']}/{row['tokens_host']}/"
            f"{row['tokens_disk']}/{row['tokens_remote']}/{row['tokens_computed']}  moved "
            f"{row['moved_rounds']}  [{row['seconds']:.1f} s]")


def goodput_text(doc: dict[str, Any]) -> str:
    lines = [f"goodput (TTFT p99 <= {doc['slo_ttft_p99_s']:g} s; capacity "
             f"{doc['capacity_requests_per_s']:.2f} requests/s), median [min-max] over "
             f"{len(doc['repeats'])} repeat(s):"]
    for pop, g in doc["summary"]["goodput"].items():
        head = " (headline)" if pop == HEADLINE else ""
        lines.append(f" TTFT over {pop}{head}: {POPULATIONS[pop]}")
        for mode in doc["modes"]:
            rps = g[mode]["requests_per_s"]
            if rps["median"] is None:
                continue
            lines.append(f"  {mode:<6} {rps['median']:.2f} [{rps['min']:.2f}-{rps['max']:.2f}] "
                         f"requests/s (never met in {g[mode]['never_met']} of {rps['n']})")
        vs = g.get("shared_vs_local")
        if vs:
            r = vs["ratio"]
            ratio = ("no repeat pins a ratio" if r["median"] is None else
                     f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] over {r['n']} "
                     f"({vs['ratio_lower_bounds']} lower bounds)")
            lines.append(f"  shared/local {ratio}; shared higher in {vs['shared_higher']}, "
                         f"tied in {vs['tied']}, lower in {vs['local_higher']} of "
                         f"{vs['repeats']}")
    probe = doc.get("fetch_probe")
    if probe:
        lines.append(f"shared tier fetch {probe['fetch_gb_per_s']:.3f} GB/s vs redis-benchmark "
                     f"GET {probe['redis_benchmark_gb_per_s']:.3f} GB/s "
                     f"({probe['value_bytes']} byte values)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    try:
        check_args(args)
        with contextlib.ExitStack() as stack:
            cluster = None
            if args.modes != "local":
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="statekv-redis-"))
                print("starting a three-master Redis Cluster on loopback ...", file=sys.stderr)
                try:
                    cluster = stack.enter_context(running_cluster(
                        Path(tmp), maxmemory=args.redis_maxmemory))
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
                    raise ReplicasError(f"the Redis Cluster did not start: {first[0]}") from None
            path = run_benchmark(args, argv, cluster)
    except ReplicasError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")
    except KeyboardInterrupt:
        p.exit(130, f"{p.prog}: interrupted; the cluster and the replicas were stopped\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
