"""Cost of the pure core's operations, per block, and of is_ready as the cache grows.

    python -m bench.core [--blocks-per-request 64] [--requests 400] [--write]

Phases (each timed over every block it touches, best of --repeat runs):

* miss+allocate  add_request of never-seen tokens (hash and look up every full block) and
                 allocate_nowait for the whole prompt from empty pages;
* commit         commit of every token (full blocks enter the prefix index);
* release        release (blocks become cached and evictable, tail first);
* match          add_request of the same prompts again (every block a GPU hit);
* evict          allocation when the GPU is full of cached content (each page evicts one
                 block; no host tier, so the victim is dropped);
* offload        the same with a host tier with room (each GPU victim is copied to host:
                 one CopyGpuToHost command per block);
* spill          allocation when GPU and host are full of cached content and a disk tier has
                 room: each GPU victim goes to host and pushes a host victim to disk (one
                 WriteSlot per block, in batches);
* spill landed   the writers' reports of those writes handled (BatchFinished of SlotWritten:
                 what the cache's trio thread does per spilled block);
* onboard        add_request of prompts whose every block is on disk only (hash, match, a
                 GPU page evicted for each, one ReadSlot per block);
* read landed    the readers' reports of those reads handled (BatchFinished of SlotRead).

The limit each per-block figure is compared with is the 2 us target of the core issue; the
same run also measures one blake2b block key (the floor of any chained-hash lookup).
is_ready is timed with 1k, 100k and 1M blocks held and no read in flight; the figure is its
cost at 1M over its cost at 1k (flat = 1.0).
"""

from __future__ import annotations

import datetime as dt
import gc
import platform
import time
from collections.abc import Callable

from bench.flags import OneLineParser, int_at_least
from bench.results_files import source_commit, write_new_results
from statekv import CacheConfig, KVCacheManager
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.messages import BatchFinished, ReadSlots, SlotRead, SlotWritten, WriteSlots

TARGET_US = 2.0
BLOCK_SIZE = 16


def _timed(fn: Callable[[], None]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def _prompts(first: int, count: int, blocks: int) -> list[list[int]]:
    # Each prompt: `blocks` full blocks plus one token (the last token is always computed).
    n = blocks * BLOCK_SIZE + 1
    return [[(first + r) * 100_003 % 50_000 + i for i in range(n)] for r in range(count)]


def per_block_phases(blocks_per_request: int, requests: int, repeat: int) -> dict[str, float]:
    """Microseconds per block for each phase (best of `repeat`)."""
    total_blocks = blocks_per_request * requests
    best: dict[str, float] = {}
    for _ in range(repeat):
        timings = _one_run(blocks_per_request, requests)
        for phase, (seconds, blocks) in _disk_phases(blocks_per_request, requests).items():
            timings[phase] = seconds * total_blocks / blocks  # per block it moved
        for phase, seconds in timings.items():
            us = seconds / total_blocks * 1e6
            best[phase] = min(best.get(phase, float("inf")), us)
    return best


def _one_run(blocks_per_request: int, requests: int) -> dict[str, float]:
    """Seconds spent in each phase over all blocks of one run."""
    gpu = (blocks_per_request + 1) * requests
    cache = KVCacheManager(CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=gpu))
    prompts = _prompts(0, requests, blocks_per_request)
    rids = [f"r{i}" for i in range(requests)]
    now = 1.0

    def miss_allocate() -> None:
        for rid, prompt in zip(rids, prompts, strict=True):
            cache.add_request(rid, prompt, now=now)
            cache.allocate_nowait(rid, len(prompt), now=now)

    def commit() -> None:
        for rid, prompt in zip(rids, prompts, strict=True):
            cache.commit(rid, len(prompt), now=now)

    def release() -> None:
        for rid in rids:
            cache.release(rid, now=now)

    again = [f"again{i}" for i in range(requests)]

    def match() -> None:
        for rid, prompt in zip(again, prompts, strict=True):
            cache.add_request(rid, prompt, now=now)

    timings = {
        "miss+allocate": _timed(miss_allocate),
        "commit": _timed(commit),
        "release": _timed(release),
        "match": _timed(match),
    }
    for rid in again:
        cache.release(rid, now=now)
    cache.take_commands()

    # Evict: a full GPU of cached content; fresh prompts need pages.
    fresh = _prompts(requests, requests, blocks_per_request)
    fresh_ids = [f"f{i}" for i in range(requests)]
    # Make every page cached content: free pages are used first, so fill them.
    filler = cache.statistics().gpu_free_pages
    if filler:
        cache.add_request("filler", list(range(filler * BLOCK_SIZE)), now=now)
        cache.allocate_nowait("filler", filler * BLOCK_SIZE, now=now)
        cache.commit("filler", filler * BLOCK_SIZE, now=now)
        cache.release("filler", now=now)

    for rid, prompt in zip(fresh_ids, fresh, strict=True):
        cache.add_request(rid, prompt, now=now)

    def evict() -> None:
        for rid, prompt in zip(fresh_ids, fresh, strict=True):
            cache.allocate_nowait(rid, len(prompt), now=now)

    timings["evict"] = _timed(evict)

    host_cache = KVCacheManager(
        CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=gpu, host_blocks=gpu)
    )
    host_cache.add_request("filler", list(range(gpu * BLOCK_SIZE)), now=now)
    host_cache.allocate_nowait("filler", gpu * BLOCK_SIZE, now=now)
    host_cache.commit("filler", gpu * BLOCK_SIZE, now=now)
    host_cache.release("filler", now=now)
    for rid, prompt in zip(fresh_ids, fresh, strict=True):
        host_cache.add_request(rid, prompt, now=now)

    def offload() -> None:
        for rid, prompt in zip(fresh_ids, fresh, strict=True):
            host_cache.allocate_nowait(rid, len(prompt), now=now)

    timings["offload"] = _timed(offload)
    host_cache.take_commands()
    return timings


def _disk_phases(blocks_per_request: int, requests: int) -> dict[str, tuple[float, int]]:
    """Seconds of the disk tier's phases (spill, spill landed, onboard, read landed) and the
    blocks each moved to or from disk."""
    gpu = (blocks_per_request + 1) * requests
    cache = KVCacheManager(CacheConfig(
        block_size=BLOCK_SIZE, gpu_blocks=gpu, host_blocks=gpu, reserved_host_blocks=64,
        disk_blocks=4 * gpu, max_batch_blocks=16))
    now = 1.0

    def cached(first: int, rid: str) -> list[list[int]]:
        prompts = _prompts(first, requests, blocks_per_request)
        for n, prompt in enumerate(prompts):
            cache.add_request(f"{rid}{n}", prompt, now=now)
            cache.allocate_nowait(f"{rid}{n}", len(prompt), now=now)
            cache.commit(f"{rid}{n}", len(prompt), now=now)
            cache.release(f"{rid}{n}", now=now)
        return prompts

    on_disk = cached(2 * requests, "old")  # fills the GPU
    cached(3 * requests, "mid")            # pushes it to host
    cache.take_commands()
    fresh = _prompts(4 * requests, requests, blocks_per_request)
    for n, prompt in enumerate(fresh):
        cache.add_request(f"new{n}", prompt, now=now)

    def spill() -> None:
        for n, prompt in enumerate(fresh):
            cache.allocate_nowait(f"new{n}", len(prompt), now=now)

    spill_s = _timed(spill)
    writes = [cmd for cmd in cache.take_commands() if isinstance(cmd, WriteSlots)]
    landed = [BatchFinished(outcomes=tuple(SlotWritten(transfer=w.transfer)
                                           for w in cmd.writes)) for cmd in writes]

    def spill_landed() -> None:
        for report in landed:
            cache.handle(report, now=now)

    spill_landed_s = _timed(spill_landed)
    for n in range(requests):
        cache.release(f"new{n}", now=now)  # uncommitted: their pages come back empty
    cache.take_commands()

    def onboard() -> None:
        for n, prompt in enumerate(on_disk):
            cache.add_request(f"back{n}", prompt, now=now)

    onboard_s = _timed(onboard)
    reads = [cmd for cmd in cache.take_commands() if isinstance(cmd, ReadSlots)]
    read = [BatchFinished(outcomes=tuple(SlotRead(transfer=r.transfer) for r in cmd.reads))
            for cmd in reads]

    def read_landed() -> None:
        for report in read:
            cache.handle(report, now=now)

    read_landed_s = _timed(read_landed)
    spilled = sum(len(cmd.writes) for cmd in writes)
    onboarded = sum(len(cmd.reads) for cmd in reads)
    if not spilled or not onboarded:
        raise RuntimeError(f"the disk phases moved {spilled} and {onboarded} blocks")
    return {"spill": (spill_s, spilled), "spill landed": (spill_landed_s, spilled),
            "onboard": (onboard_s, onboarded), "read landed": (read_landed_s, onboarded)}


def key_floor_us(samples: int = 200_000) -> float:
    """One chained blake2b key of a 16-token block: the floor under match and commit."""
    root = root_key("", None, None)
    data = token_bytes(list(range(BLOCK_SIZE)))
    start = time.perf_counter()
    key = root
    for _ in range(samples):
        key = chain_key(root, data)
    del key
    return (time.perf_counter() - start) / samples * 1e6


def is_ready_us(blocks_held: int, calls: int = 200_000) -> float:
    """Cost of one is_ready call with `blocks_held` blocks held and no read in flight."""
    per_request = 1000 if blocks_held >= 1000 else blocks_held
    requests = blocks_held // per_request
    cache = KVCacheManager(CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=blocks_held))
    for r in range(requests):
        n = per_request * BLOCK_SIZE
        rid = f"r{r}"
        cache.add_request(rid, [r] * n, now=0.0)
        cache.allocate_nowait(rid, n, now=0.0)
    probe = f"r{requests // 2}"
    is_ready = cache.is_ready
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            is_ready(probe)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.core", description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks-per-request", type=int_at_least(1), default=64)
    parser.add_argument("--requests", type=int_at_least(1), default=400)
    parser.add_argument("--repeat", type=int_at_least(1), default=3)
    parser.add_argument("--write", action="store_true",
                        help="write bench/results/core-cpu-<date>.json")
    args = parser.parse_args(argv)

    phases = per_block_phases(args.blocks_per_request, args.requests, args.repeat)
    floor = key_floor_us()
    ready = {n: is_ready_us(n) for n in (1_000, 100_000, 1_000_000)}

    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
          f"python {platform.python_version()}")
    print(f"{'phase':<16}{'us/block':>10}{'vs 2us target':>16}")
    for phase, us in phases.items():
        print(f"{phase:<16}{us:>10.3f}{us / TARGET_US:>15.2f}x")
    print(f"{'blake2b key':<16}{floor:>10.3f}   (floor of match/commit)")
    for n, us in ready.items():
        print(f"is_ready, {n:>9,} blocks held: {us * 1000:8.1f} ns")
    flat = ready[1_000_000] / ready[1_000]
    print(f"is_ready 1M / 1k: {flat:.2f}x")

    if args.write:
        commit = source_commit()
        today = dt.date.today()
        figures: dict[str, dict[str, object]] = {}
        for phase, us in phases.items():
            figures[f"{phase.replace('+', '_')}_per_block"] = {
                "value": round(us, 3), "unit": "us", "limit": TARGET_US,
                "limit_name": "2 us per block-operation target", "ratio": round(us / TARGET_US, 3),
            }
        figures["blake2b_key_per_block"] = {"value": round(floor, 3), "unit": "us"}
        for n, us in ready.items():
            figures[f"is_ready_{n}_blocks"] = {"value": round(us * 1000, 1), "unit": "ns"}
        figures["is_ready_1M_vs_1k"] = {"value": round(flat, 3), "unit": "x",
                                        "ratio": round(flat, 3)}
        result = {
            "bench": "core", "machine": "cpu", "date": today.isoformat(), "commit": commit,
            "command": "python -m bench.core "
                       f"--blocks-per-request {args.blocks_per_request} "
                       f"--requests {args.requests} --repeat {args.repeat} --write",
            "figures": figures,
        }
        out = write_new_results("core", "cpu", today, result)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
