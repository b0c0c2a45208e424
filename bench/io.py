"""statekv's transfer paths against the limits of the machine they run on, same run.

    python -m bench.io [--block-mib 2] [--threads 4] [--blocks 256] [--dir PATH] [--write]

Every figure is a ratio against a limit measured in this run with the same block size and
thread count (bench.disk_limits):

* spill          host -> disk through the cache (evictions -> writer pool -> slot store,
                 checksums and headers included) vs raw O_DIRECT sequential write;
* onboard        disk -> GPU through the cache (reader pool, staging, H2D, checksum,
                 publish) vs raw O_DIRECT read (and, with kvikio, vs kvikio's own rate);
* spill, twice   into fresh slots (a tier's first fill) vs raw O_DIRECT sequential write and
                 vs the raw *first* write of a just-preallocated file (filesystems convert
                 preallocated extents as they are first written); and into a data file
                 whose slots were all written before (a tier that has wrapped) vs the raw
                 write;
* store alone    the same host pages written by the slot store itself, from as many threads
                 in the same batches, to fresh slots (vs the raw first write), then over
                 them again in order and shuffled (vs the raw write), no cache, no actors:
                 where the spill's gap to the disk lies;
* recall         host -> GPU through the copy engine vs a plain pinned H2D copy;
* step latency   p50 / p99 of a serving loop's decode step while another tenant keeps the
                 disk saturated through the same cache, vs the same loop with no disk
                 traffic.

The spill and onboard phases isolate their direction: the cache uses the retained-only spill
mode and only the measured prompt carries a TTL, so evictions made to find pages for the
onboard drop content instead of writing it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import torch

from bench.disk_limits import (
    pinned_h2d_rate,
    raw_first_write_rate,
    raw_read_rate,
    raw_write_rate,
)
from bench.flags import (
    OneLineParser,
    device_name,
    existing_directory,
    int_at_least,
    positive_number,
    results_tag,
    shape_preset,
)
from bench.gc_pauses import collector_watched
from bench.results_files import source_commit, write_new_results
from bench.serving import FOREGROUND
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache, resolve_device
from io_actors.memory.page_copies import COMPUTE_WAITS
from io_actors.memory.pools import KVPools, TorchCopyEngine
from io_actors.storage.buffers import host_view, page_aligned_buffer, pinned_page_aligned_buffer
from io_actors.storage.interfaces import SlotIO, SlotStore
from io_actors.storage.open_store import open_slot_store
from io_actors.storage.slot_format import payload_checksum
from statekv.config import KVLayout
from statekv.errors import ConfigError, OutOfBlocks
from statekv.ids import BlockHash, PageId, SlotId


def layout_for(block_mib: float, block_size: int) -> KVLayout:
    """A Llama-8B-like layout (8 kv heads x 128, bf16) with as many layers as make a block
    of about `block_mib` MiB."""
    per_layer = 2 * block_size * 8 * 128 * 2
    layers = max(1, round(block_mib * 2**20 / per_layer))
    return KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def _wait(predicate: Any, timeout: float = 600.0) -> None:
    """Poll `predicate` every millisecond.  Not faster: a predicate over statistics() holds
    the GIL the pipeline measured needs (polled every 0.2 ms, statistics() was a fifth of
    the GIL-holding samples of a 256 KiB run on the CPU machine), and a phase lasts hundreds
    of milliseconds, so 1 ms of resolution costs under 1%."""
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError("benchmark phase did not finish")
        time.sleep(0.001)


def _fill(cache: BlockingCache, rid: str, first_token: int, blocks: int,
          ttl: float | None = None, *, write_bytes: bool = True) -> list[int]:
    """A request of `blocks` full blocks of fresh tokens: computed (with `write_bytes`, bytes
    written into its pages), committed and released, so its content is cached on GPU."""
    bs = cache.config.block_size
    tokens = [first_token + i for i in range(blocks * bs + 1)]
    cache.add_request(rid, tokens, ttl_seconds=ttl)
    cache.allocate_nowait(rid, len(tokens))
    if write_bytes:
        table = cache.block_table(rid)
        cache.order_forward_after_copies(table)  # GPU work on its pages, as a pass's
        for page in table:
            cache.kv_pool[page].fill_(float(page % 7) + 1.0)
    cache.commit(rid, len(tokens))
    cache.release(rid)
    return tokens


def _transfer_config(args: argparse.Namespace, directory: Path) -> StateKVConfig:
    n = args.blocks
    return StateKVConfig(
        layout=layout_for(args.block_mib, args.block_size), block_size=args.block_size,
        gpu=2 * n + 1, host=n, reserved_host=n, disk=2 * n, disk_dir=directory,
        writers=args.threads, readers=args.threads, write_queue_depth=max(64, n),
        device=args.device, spill_mode="retained_only", backend=args.backend,
        max_batch_blocks=args.batch_blocks, model_fingerprint="bench-io-transfer",
        compute_waits=args.compute_waits,
        # The spill path alone (host -> disk on eviction): req1's retained blocks must not
        # be written through at their release, before the timed phase.
        retention_write_through=False,
    )


def transfer_phases(args: argparse.Namespace, directory: Path) -> dict[str, float]:
    """Spill and onboard rates through the cache, in GB/s."""
    n = args.blocks
    config = _transfer_config(args, directory)
    block_bytes = config.block_bytes
    out: dict[str, float] = {}
    # The write-through (the default): a retained request's blocks written to disk from the
    # GPU (through staging host pages) at its release, from the release until every write
    # landed; the host tier holds every block, so staging never waits for a page.
    through = attrs.evolve(config, retention_write_through=True, disk_dir=directory / "wt",
                           host=n + 1)
    with BlockingCache(through) as cache:
        _fill(cache, "warm", 30_000_000, 1, ttl=3600.0)
        _wait(lambda: cache.statistics().cache.writes_in_flight == 0)
        bs = cache.config.block_size
        tokens = [40_000_000 + i for i in range(n * bs + 1)]
        cache.add_request("wt", tokens, ttl_seconds=3600.0)
        cache.allocate_nowait("wt", len(tokens))
        table = cache.block_table("wt")
        cache.order_forward_after_copies(table)
        for page in table:
            cache.kv_pool[page].fill_(float(page % 7) + 1.0)
        cache.commit("wt", len(tokens))
        before = cache.statistics().cache.spills_completed
        start = time.perf_counter()
        cache.release("wt")
        _wait(lambda: cache.statistics().cache.writes_in_flight == 0)
        through_s = time.perf_counter() - start
        stats = cache.statistics().cache
        assert stats.spills_completed - before == n and stats.write_throughs_skipped == 0, stats
        out["write_through_gb_per_s"] = n * block_bytes / through_s / 1e9
    with BlockingCache(config) as cache:
        spill = _timed_spill(cache, n)
        first = spill.first
        out["spill_gb_per_s"] = n * block_bytes / spill.seconds / 1e9
        # How much of the spill's span the writers spent in their jobs (fence, page views,
        # the store's writes): the rest they waited for the next job.
        out["spill_writers_busy_fraction"] = spill.writers_busy / (args.threads * spill.seconds)
        stats = cache.statistics().cache
        assert stats.disk_empty_slots == n, stats   # req1's slots were fresh ones

        start = time.perf_counter()
        match = cache.add_request("again", first)
        _wait(lambda: cache.is_ready("again"))
        onboard_s = time.perf_counter() - start
        assert match.disk_tokens == n * args.block_size, match
        out["onboard_gb_per_s"] = n * block_bytes / onboard_s / 1e9
        system = cache.statistics()
        stats = system.cache
        assert stats.io_errors == 0 and stats.writes_in_flight == 0, stats
        # Transfers the store could not hand to O_DIRECT as they were (a host page or
        # staging buffer off a page boundary): each went through its bounce buffer.
        out["bounced_transfers"] = float(system.store.bounced) if system.store else 0.0
        cache.release("again")
        if args.backend == "kvikio":
            out["kvikio_gb_per_s"] = kvikio_own_rate(config, n)
    # The spill again, into a data file whose every slot was written once before (the index
    # lists none of them): the steady state of a tier that has wrapped, which overwrites.
    steady = attrs.evolve(config, disk_dir=directory / "steady")
    _write_every_slot(steady)
    with BlockingCache(steady) as cache:
        assert cache.statistics().cache.disk_empty_slots == steady.core_config().disk_blocks
        spill = _timed_spill(cache, n)
        assert cache.statistics().cache.io_errors == 0
        out["spill_written_gb_per_s"] = n * block_bytes / spill.seconds / 1e9
        out["spill_written_writers_busy_fraction"] = (
            spill.writers_busy / (args.threads * spill.seconds))
    out["block_bytes"] = block_bytes
    return out


@attrs.frozen
class TimedSpill:
    first: list[int]
    """req1's tokens."""
    seconds: float
    """From req3's arrival until every spill landed."""
    writers_busy: float
    """The writer threads' seconds in their jobs over the same span, summed over threads."""


def _timed_spill(cache: BlockingCache, n: int) -> TimedSpill:
    """req1 (retained, `n` blocks) pushed to host by req2, then to disk by req3."""
    first = _fill(cache, "req1", 0, n, ttl=3600.0)
    _fill(cache, "req2", 10_000_000, 2 * n)
    writer = cache.statistics().writer
    assert writer is not None
    busy_before = writer.busy_seconds
    start = time.perf_counter()
    _fill(cache, "req3", 20_000_000, n, write_bytes=False)
    _wait(lambda: cache.statistics().cache.writes_in_flight == 0)
    spill_s = time.perf_counter() - start
    system = cache.statistics()
    assert system.cache.spills_completed >= n, system.cache
    assert system.writer is not None
    return TimedSpill(first, spill_s, system.writer.busy_seconds - busy_before)


def _write_every_slot(config: StateKVConfig) -> None:
    """Create `config`'s data file and write each of its slots once, with no restore
    metadata (so the index journal names none: the cache opens on an empty tier whose
    slots the filesystem has allocated)."""
    core = config.core_config()
    page = _host_pages(core.block_bytes, 1)[0]
    crc = payload_checksum(host_view(page))
    with _slot_store(config) as store:
        _timed_writes(store, list(range(core.disk_blocks)), [page] * core.disk_blocks,
                      [crc] * core.disk_blocks, batch=max(1, core.max_batch_blocks),
                      threads=max(1, config.writers))


def _host_pages(nbytes: int, count: int) -> list[torch.Tensor]:
    """`count` page-aligned host pages of `nbytes`, pinned where CUDA is (as the host pool)."""
    aligned = (pinned_page_aligned_buffer if torch.cuda.is_available()
               else page_aligned_buffer)
    pool = aligned(count * nbytes)
    return [pool[i * nbytes : (i + 1) * nbytes] for i in range(count)]


@contextlib.contextmanager
def _slot_store(config: StateKVConfig) -> Iterator[SlotStore]:
    """The slot store the cache of `config` would open, closed on exit."""
    directory = config.rank_directory()
    assert directory is not None
    store = open_slot_store(config.backend, directory, config.core_config(),
                            persist=config.persist)
    try:
        yield store
    finally:
        store.close()


def _timed_writes(store: SlotStore, slots: list[int], pages: list[torch.Tensor],
                  crcs: list[int], *, batch: int, threads: int) -> float:
    """Seconds for `threads` threads to write page i to slot slots[i], `batch` at a time."""
    jobs = [list(range(i, min(i + batch, len(pages)))) for i in range(0, len(pages), batch)]
    lock = threading.Lock()
    failures: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not jobs:
                    return
                job = jobs.pop()
            outcome = store.write_many([SlotIO(
                slot=SlotId(slots[i]), key=BlockHash(i.to_bytes(32, "little")),
                buffer=pages[i], crc=crcs[i]) for i in job])
            failures.extend(o for o in outcome if o is not None)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - start
    assert not failures, failures[:3]
    return elapsed


def store_write_rates(config: StateKVConfig, blocks: int) -> dict[str, float]:
    """The slot store alone, same run: `blocks` host pages written through the cache's store
    (its backend, headers, index journal) by `config.writers` threads, in batches of
    `config.max_batch_blocks`, payload checksums given (as the GPU copies supply them), no
    cache, no actors.  Once to fresh slots, then over the same slots again, in order and
    shuffled (as a churned free list hands them out).  Between the spill's rate and these
    lies what the pipeline above the store costs; between these and the raw write, what the
    store costs."""
    core = config.core_config()
    pages = _host_pages(core.block_bytes, blocks)
    for page in pages:
        page.random_(0, 256)
    crcs = [payload_checksum(host_view(page)) for page in pages]
    out: dict[str, float] = {}
    with _slot_store(config) as store:
        written = list(range(blocks))
        scattered = random.Random(0).sample(written, blocks)
        for name, slots in (("store_fresh", written), ("store_consecutive", written),
                            ("store_scattered", scattered)):
            elapsed = _timed_writes(store, slots, pages, crcs,
                                    batch=max(1, core.max_batch_blocks),
                                    threads=max(1, config.writers))
            out[f"{name}_gb_per_s"] = blocks * core.block_bytes / elapsed / 1e9
    return out


def kvikio_own_rate(config: StateKVConfig, blocks: int) -> float:
    """kvikio alone, same run: the payloads of `blocks` slots of the cache's data file read
    into GPU memory with every pread submitted at once, as many kvikio threads as the
    environment gives it (KVIKIO_NTHREADS); no headers, no checksums, no statekv.  The slots
    were last touched with O_DIRECT, so the page cache holds none of them."""
    import kvikio

    from io_actors.storage.posix_open import DATA_FILE
    from io_actors.storage.slot_format import HEADER_SIZE, slot_nbytes

    directory = config.rank_directory()
    assert directory is not None
    payload = config.block_bytes
    stride = slot_nbytes(payload)
    dst = torch.empty((blocks, payload), dtype=torch.uint8, device="cuda")
    handle = kvikio.CuFile(str(directory / DATA_FILE), "r")
    try:
        start = time.perf_counter()
        futures = [handle.pread(dst[i], payload, i * stride + HEADER_SIZE) for i in range(blocks)]
        for future in futures:
            future.get()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        handle.close()
    return blocks * payload / seconds / 1e9


def recall_rates(args: argparse.Namespace) -> dict[str, float]:
    """Host -> GPU page copies through the copy engine, GB/s (best of 10, after one pass).

    As the scheduler issues them: batches of `--batch-blocks` pages (one request's host hits),
    to GPU pages in a shuffled order, so that no two pages of a batch merge into one copy --
    the figure does not profit from runs of consecutive pages that real evictions rarely
    make.  "engine": the engine's own choice per batch; where it can run its gather kernel,
    also "dma" (one DMA per page), "kernel" (one gather kernel per batch) and, where the
    driver has it, "batched_dma" (one call of its batched memcpy per batch), on the same
    pools."""
    from statekv.config import CacheConfig

    n = args.blocks
    layout = layout_for(args.block_mib, args.block_size)
    pools = KVPools(CacheConfig(block_size=args.block_size, gpu_blocks=n, host_blocks=n,
                                layout=layout), resolve_device(args.device))
    engines = {"engine": TorchCopyEngine(pools)}
    if engines["engine"].gather_kernel_available:
        engines["dma"] = TorchCopyEngine(pools, gather_kernel=False)
        engines["kernel"] = TorchCopyEngine(pools, gather_kernel=True)
        try:
            engines["batched_dma"] = TorchCopyEngine(pools, gather_kernel=True,
                                                     batch_dma=True)
        except ConfigError as exc:
            print(f"no batched DMA way: {exc}")
    targets = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    pairs = [(PageId(page), PageId(target)) for page, target in enumerate(targets)]
    size = args.batch_blocks
    rates: dict[str, float] = {}
    for way, engine in engines.items():
        best = float("inf")
        # The first pass is not timed (it compiles the gather kernel), and a pass is only
        # 10-20 ms: in one H200 run with five timed passes and none untimed, the engine's
        # choice, measured first, came out at 0.51x of pinned H2D where the same kernel
        # forced, measured after it, reached 0.83x (a compile or the device's clocks inside
        # the timed passes are the suspects, not measured).
        for repeat in range(11):
            start = time.perf_counter()
            for first in range(0, n, size):
                engine.copy_pages(pairs[first : first + size], to_gpu=True)
            engine.fence().wait()
            if repeat:
                best = min(best, time.perf_counter() - start)
        rates[way] = n * pools.block_nbytes / best / 1e9
    return rates


def host_to_device_limit(nbytes: int, device: torch.device) -> float:
    """The same-run limit for recall: one large pinned (CUDA) or plain (CPU) copy, GB/s."""
    rate = pinned_h2d_rate(nbytes)
    if rate is not None:
        return rate
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


STEP_PARTS = (  # (results key, printed name): the parts of a step that step_latency times
    ("cache_calls", "of which the loop's cache calls"),
    ("forward_launch", "of which launching the forward pass"),
    ("readback_and_loop", "of which the token readback, the rest"),
)
"""The parts of a serving step that :func:`step_latency` times apart."""


def step_latency(args: argparse.Namespace, directory: Path) -> dict[str, float]:
    """Decode-step latency of a serving loop, with no disk traffic vs with the disk kept
    busy by the same cache.

    The disk traffic comes from a tenant whose cache calls run on the loop's own thread,
    between steps, as a serving loop's own requests would: it keeps reads of disk-resident
    prefixes in flight and releases content whose eviction spills.  Its requests never
    enter the forward pass, so both runs do the same model work; each timed iteration
    covers the tenant's calls and the step.
    """
    from models.config import preset
    from models.model import PagedDecoder
    from models.serving_loop import ServingLoop

    device = resolve_device(args.device)
    model_config = preset(args.model, num_layers=args.model_layers or None)
    model = PagedDecoder(model_config, device=device,
                         cuda_graphs=args.cuda_graphs)
    bs = args.block_size
    result: dict[str, float] = {}
    # A first run warms up kernels, allocators and page caches; it is not reported.
    for phase in ("warmup", "idle", "saturated"):
        config = StateKVConfig(
            layout=model_config.kv_layout(), block_size=bs, gpu=args.loop_gpu_blocks,
            host=args.loop_gpu_blocks // 4, reserved_host=64, disk=8 * args.loop_gpu_blocks,
            disk_dir=directory / phase, writers=args.threads, readers=args.threads,
            device=args.device, model_fingerprint=model_config.fingerprint(),
            backend=args.backend, max_batch_blocks=args.batch_blocks,
            compute_waits=args.compute_waits,
        )
        with BlockingCache(config) as cache:
            if args.cuda_graphs:
                # The same decodes once, untimed, on this cache's pool: the model captures a
                # graph per pool and batch shape on first use (a device sync and a capture),
                # which is start-up cost, not a step's.
                warm = ServingLoop(model, cache, max_step_tokens=4096, prefill_chunk=512,
                                   max_running=args.decoders)
                _submit_decoders(warm, args, "w")
                while not warm.idle:
                    warm.step()
            tenant = (_DiskTenant(cache, blocks=args.tenant_blocks,
                                  in_flight=args.tenant_in_flight)
                      if phase == "saturated" else None)
            if tenant is not None:
                # Three GPU pools' worth of content, so that most of it sits on disk.
                tenant.prepare(rounds=max(1, 3 * args.loop_gpu_blocks // args.tenant_blocks))
            # The loop's cache calls and its forward pass are timed where the loop makes
            # them, so that a slower busy step says which part of it grew.
            lock: _TimedLock | None = None
            if args.time_lock:
                # Installed before the timed steps: the lock is free between calls here.
                scheduler = cache._scheduler
                lock = _TimedLock(scheduler._lock)
                scheduler._lock = lock  # type: ignore[assignment]
            timed_cache = _TimedCalls(cache)
            timed_model = _TimedCalls(model)
            loop = ServingLoop(cast(PagedDecoder, timed_model), cast(BlockingCache, timed_cache),
                               max_step_tokens=4096, prefill_chunk=512,
                               max_running=args.decoders,
                               hold_foreground=FOREGROUND[args.foreground])
            _submit_decoders(loop, args, "d")
            while loop.statistics().decode_tokens == 0:  # prefill is not what we time
                loop.step()
            graphs_before = model.decode_graph_statistics()
            before_all = cache.statistics()
            before = before_all.cache
            iterations: list[float] = []
            steps: list[float] = []
            parts: dict[str, list[float]] = {"cache_calls": [], "forward_launch": []}
            lock_waits: list[float] = []
            clock = time.perf_counter
            if lock is not None:
                lock.reset()
            with collector_watched(freeze=args.gc_freeze) as pauses:
                while not loop.idle:
                    start = clock()
                    if tenant is not None:
                        tenant.step()
                    middle = clock()
                    timed_cache.seconds = timed_model.seconds = 0.0
                    waited_before = lock.waited(_SERVING_THREAD) if lock is not None else 0.0
                    loop.step()
                    end = clock()
                    iterations.append(end - start)
                    steps.append(end - middle)
                    parts["cache_calls"].append(timed_cache.seconds)
                    parts["forward_launch"].append(timed_model.seconds)
                    if lock is not None:
                        lock_waits.append(lock.waited(_SERVING_THREAD) - waited_before)
            # Every cyclic collection stops every Python thread, the serving thread's step
            # included: how many ran in the timed steps, and how long the full ones took.
            result[f"{phase}_gc_collections"] = pauses.collections
            result[f"{phase}_gc_full_collections"] = len(pauses.full)
            result[f"{phase}_gc_pause_ms"] = pauses.total * 1e3
            result[f"{phase}_gc_full_pause_max_ms"] = max(pauses.full, default=0.0) * 1e3
            if lock is not None:
                # The serving thread's waits for the scheduler's lock inside its steps, and
                # how long the cache's trio thread held it each time (its completions and
                # dispatch run under it).
                result[f"{phase}_lock_wait_per_step_p50_ms"] = statistics.median(lock_waits) * 1e3
                result[f"{phase}_lock_wait_per_step_p99_ms"] = _percentile(lock_waits, 99) * 1e3
                holds = lock.holds(_TRIO_THREAD) or [0.0]
                result[f"{phase}_trio_lock_hold_p50_ms"] = statistics.median(holds) * 1e3
                result[f"{phase}_trio_lock_hold_p99_ms"] = _percentile(holds, 99) * 1e3
                result[f"{phase}_trio_lock_hold_max_ms"] = max(holds) * 1e3
                result[f"{phase}_trio_lock_held_share"] = sum(holds) / sum(iterations)
            after_all = cache.statistics()
            after = after_all.cache
            fg_before, fg_after = before_all.foreground, after_all.foreground
            if fg_before is not None and fg_after is not None:
                # How often the cache's threads waited for the serving thread to let go of
                # the foreground, and how many of those waits ran out.
                result[f"{phase}_foreground_holds"] = fg_after.holds - fg_before.holds
                result[f"{phase}_foreground_yields"] = fg_after.yields - fg_before.yields
                result[f"{phase}_foreground_timeouts"] = fg_after.timeouts - fg_before.timeouts
            graphs_after = model.decode_graph_statistics()
            if graphs_before is not None and graphs_after is not None:
                # How the timed steps ran: replays of graphs captured before them, or not.
                result[f"{phase}_graph_replays"] = graphs_after.replayed - graphs_before.replayed
                result[f"{phase}_graph_captures"] = graphs_after.captured - graphs_before.captured
                result[f"{phase}_eager_decode_steps"] = graphs_after.eager - graphs_before.eager
            moved = (after.bytes_read + after.bytes_written
                     - before.bytes_read - before.bytes_written)
            # The step alone: what the loop's own requests wait for.  With the tenant's
            # calls: what a loop pays when those requests are its own.
            result[f"{phase}_p50_ms"] = statistics.median(steps) * 1e3
            result[f"{phase}_p99_ms"] = _percentile(steps, 99) * 1e3
            result[f"{phase}_with_tenant_p50_ms"] = statistics.median(iterations) * 1e3
            result[f"{phase}_with_tenant_p99_ms"] = _percentile(iterations, 99) * 1e3
            result[f"{phase}_disk_gb_per_s"] = moved / sum(iterations) / 1e9
            # The rest of a step: the token readback (it waits for the GPU to finish the
            # pass) and the loop's own Python.
            parts["readback_and_loop"] = [
                step - calls - launch for step, calls, launch
                in zip(steps, parts["cache_calls"], parts["forward_launch"], strict=True)]
            for part, values in parts.items():
                result[f"{phase}_{part}_p50_ms"] = statistics.median(values) * 1e3
                result[f"{phase}_{part}_p99_ms"] = _percentile(values, 99) * 1e3
    return result


_SERVING_THREAD = "MainThread"
_TRIO_THREAD = "statekv-trio"


class _TimedLock:
    """A lock that times, per thread, each wait to take it and each hold of it."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._taken_at = 0.0
        self._waits: dict[str, float] = {}
        self._holds: dict[str, list[float]] = {}

    def reset(self) -> None:
        self._waits.clear()
        self._holds.clear()

    def waited(self, thread: str) -> float:
        """Seconds `thread` has waited for the lock since the last reset."""
        return self._waits.get(thread, 0.0)

    def holds(self, thread: str) -> list[float]:
        return list(self._holds.get(thread, ()))

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        start = time.perf_counter()
        got = bool(self._lock.acquire(blocking, timeout))
        if got:
            self._taken_at = time.perf_counter()
            name = threading.current_thread().name
            self._waits[name] = self._waits.get(name, 0.0) + self._taken_at - start
        return got

    def release(self) -> None:
        held = time.perf_counter() - self._taken_at
        self._holds.setdefault(threading.current_thread().name, []).append(held)
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _submit_decoders(loop: Any, args: argparse.Namespace, prefix: str) -> None:
    from models.serving_loop import ServeRequest

    for i in range(args.decoders):
        loop.submit(ServeRequest(request_id=f"{prefix}{i}", prompt=tuple(range(i, i + 64)),
                                 max_new_tokens=args.decode_steps))


class _TimedCalls:
    """Forwards every method call to `target`, adding the wall time spent in it to
    `seconds` (attributes that are not methods pass through untouched)."""

    def __init__(self, target: object) -> None:
        self._target = target
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return value(*args, **kwargs)
            finally:
                self.seconds += clock() - start
        return timed


class _DiskTenant:
    """Keeps `in_flight` onboards of `blocks`-block prefixes going, and feeds spills."""

    def __init__(self, cache: BlockingCache, *, blocks: int, in_flight: int) -> None:
        self._cache = cache
        self._blocks = blocks
        self._in_flight = in_flight
        self._on_disk: list[list[int]] = []
        self._reading: list[tuple[str, list[int]]] = []
        self._next = 0

    def _fresh(self) -> list[int]:
        self._next += 1
        bs = self._cache.config.block_size
        return [200_000_000 + self._next * 100_000 + i for i in range(self._blocks * bs + 1)]

    def _content(self) -> list[int]:
        """Cache a fresh prompt's blocks (no model: its bytes do not matter here)."""
        tokens = self._fresh()
        rid = f"fill{self._next}"
        cache = self._cache
        cache.add_request(rid, tokens)
        cache.allocate_nowait(rid, len(tokens))
        cache.commit(rid, len(tokens))
        cache.release(rid)
        return tokens

    def prepare(self, rounds: int) -> None:
        """Push enough content through the tiers that plenty of it sits on disk."""
        for _ in range(rounds):
            self._on_disk.append(self._content())
        _wait(lambda: self._cache.statistics().cache.writes_in_flight == 0)

    def step(self) -> None:
        cache = self._cache
        still: list[tuple[str, list[int]]] = []
        for rid, tokens in self._reading:
            if cache.is_ready(rid):
                cache.release(rid)          # its blocks go back down the tiers: spills
                self._on_disk.append(tokens)
                self._on_disk.append(self._content())
            else:
                still.append((rid, tokens))
        self._reading = still
        while len(self._reading) < self._in_flight and self._on_disk:
            tokens = self._on_disk.pop(0)
            self._next += 1
            rid = f"read{self._next}"
            try:
                cache.add_request(rid, tokens)
            except OutOfBlocks:
                self._on_disk.insert(0, tokens)
                return
            self._reading.append((rid, tokens))


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


Row = tuple[str, str, float, float, str]
"""(results key, printed name, GB/s, same-run limit, the limit's name)"""


def transfer_rows(args: argparse.Namespace, directory: Path, block_bytes: int
                  ) -> tuple[list[Row], dict[str, float]]:
    """Every transfer phase against its limit, measured in this run, and the counts that go
    with them (whether the raw limits ran O_DIRECT, transfers through a bounce buffer, how
    busy the spill kept its writer threads)."""
    total = args.blocks * block_bytes
    raw_write = raw_write_rate(directory, block_bytes=block_bytes, threads=args.threads,
                               total_bytes=total)
    raw_first = raw_first_write_rate(directory, block_bytes=block_bytes,
                                     threads=args.threads, total_bytes=total)
    raw_read = raw_read_rate(directory, block_bytes=block_bytes, threads=args.threads,
                             total_bytes=total)
    phases = transfer_phases(args, directory / "cache")
    store = store_write_rates(_transfer_config(args, directory / "store"), args.blocks)
    recall_ways = recall_rates(args)
    recall = recall_ways.pop("engine")
    h2d = host_to_device_limit(total, resolve_device(args.device))
    h2d_name = "pinned H2D copy" if torch.cuda.is_available() else "host memcpy"
    rows: list[Row] = [
        ("spill_host_to_disk", "spill host->disk", phases["spill_gb_per_s"], raw_write.gb_per_s,
         "raw O_DIRECT write"),
        ("write_through_gpu_to_disk", "write-through", phases["write_through_gb_per_s"],
         raw_write.gb_per_s, "raw O_DIRECT write"),
        ("store_write_consecutive_slots", "store alone, consec.",
         store["store_consecutive_gb_per_s"], raw_write.gb_per_s, "raw O_DIRECT write"),
        ("store_write_scattered_slots", "store alone, scatt.",
         store["store_scattered_gb_per_s"], raw_write.gb_per_s, "raw O_DIRECT write"),
        ("spill_fresh_vs_first_write", "spill, fresh slots", phases["spill_gb_per_s"],
         raw_first.gb_per_s, "raw first write"),
        ("store_write_fresh_slots", "store alone, fresh", store["store_fresh_gb_per_s"],
         raw_first.gb_per_s, "raw first write"),
        ("spill_over_written_slots", "spill, written slots", phases["spill_written_gb_per_s"],
         raw_write.gb_per_s, "raw O_DIRECT write"),
        ("onboard_disk_to_gpu", "onboard disk->GPU", phases["onboard_gb_per_s"],
         raw_read.gb_per_s, "raw O_DIRECT read"),
        ("recall_host_to_gpu", "recall host->GPU", recall, h2d, h2d_name),
    ]
    for way, rate in recall_ways.items():
        rows.append((f"recall_host_to_gpu_{way}", f"recall, {way} only", rate, h2d, h2d_name))
    if "kvikio_gb_per_s" in phases:
        rows.append(("onboard_vs_kvikio_alone", "onboard vs kvikio", phases["onboard_gb_per_s"],
                     phases["kvikio_gb_per_s"], "kvikio's own read"))
    return rows, {"direct": int(raw_write.direct),
                  "bounced_transfers": int(phases["bounced_transfers"]),
                  "spill_writers_busy_fraction": phases["spill_writers_busy_fraction"],
                  "spill_written_writers_busy_fraction":
                      phases["spill_written_writers_busy_fraction"]}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.io", description=__doc__.split("\n\n")[0])
    n0, n1 = int_at_least(0), int_at_least(1)
    parser.add_argument("--block-mib", type=positive_number, default=2.0)
    parser.add_argument("--block-size", type=n1, default=16)
    parser.add_argument("--threads", type=n1, default=4)
    parser.add_argument("--blocks", type=n1, default=256)
    parser.add_argument("--dir", type=existing_directory, default=None,
                        help="where the scratch directory goes (it must exist)")
    parser.add_argument("--device", type=device_name, default="auto")
    parser.add_argument("--model", type=shape_preset, default="tiny")
    parser.add_argument("--model-layers", type=n0, default=0)
    parser.add_argument("--decoders", type=n1, default=8)
    parser.add_argument("--decode-steps", type=n1, default=200)
    parser.add_argument("--loop-gpu-blocks", type=n1, default=512)
    parser.add_argument("--tenant-blocks", type=n1, default=8,
                        help="blocks of each prefix the disk tenant reads back (latency phase)")
    parser.add_argument("--tenant-in-flight", type=n1, default=4,
                        help="the disk tenant's reads in flight at once (latency phase): "
                             "raise both for more disk traffic")
    parser.add_argument("--backend", default="posix", choices=("posix", "kvikio"))
    parser.add_argument("--batch-blocks", type=n1, default=16,
                        help="max_batch_blocks: blocks per disk batch (1: one at a time)")
    parser.add_argument("--machine", default="cpu", help="cpu, h200 or h200x2 (file name)")
    phases_given = parser.add_mutually_exclusive_group()
    phases_given.add_argument("--skip-latency", action="store_true")
    phases_given.add_argument("--latency-only", action="store_true",
                              help="only the step-latency phase (for a profile of it)")
    parser.add_argument("--switch-interval-ms", type=positive_number, default=None,
                        help="the interpreter's thread switch interval for the whole run "
                             "(sys.setswitchinterval; Python's own is 5 ms)")
    parser.add_argument("--foreground", choices=tuple(FOREGROUND), default="auto",
                        help="latency phase: whether the serving loop holds the cache's "
                             "foreground while it works (auto: on a GPU); for an A/B")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the model replays decode-only steps from CUDA graphs "
                             "(PagedDecoder(cuda_graphs=True); CUDA only)")
    parser.add_argument("--compute-waits", choices=COMPUTE_WAITS, default="all",
                        help="StateKVConfig.compute_waits: a step waits for every copy "
                             "(all) or only its own pages' (pages); for an A/B")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="freeze the collector's generations after each latency phase's "
                        "set-up, as a server does once started (gc.freeze())")
    parser.add_argument("--time-lock", action="store_true",
                        help="latency phase: time the serving thread's waits for the "
                             "scheduler's lock and the cache thread's holds of it")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--tag", type=results_tag, default=None,
                        help="suffix of the results file name (several runs a day)")
    args = parser.parse_args(argv)

    if args.gc_freeze and args.skip_latency:
        parser.error("--gc-freeze: it applies to the latency phases, which --skip-latency "
                     "leaves out")
    if args.cuda_graphs and not args.skip_latency and resolve_device(args.device).type != "cuda":
        parser.error(f"--cuda-graphs: CUDA graphs need a CUDA device, not {args.device!r}")
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(prefix="statekv-bench-io-", dir=base) as tmp:
        directory = Path(tmp)
        layout = layout_for(args.block_mib, args.block_size)
        block_bytes = layout.block_bytes(args.block_size)
        rows, counts = ([], {}) if args.latency_only else transfer_rows(args, directory,
                                                                          block_bytes)
        latency = {} if args.skip_latency else step_latency(args, directory / "loop")

    print(f"machine: {args.machine} ({platform.node()}), device {resolve_device(args.device)}")
    print(f"block {block_bytes / 2**20:.2f} MiB, {args.threads} threads, {args.blocks} blocks, "
          f"backend {args.backend}, batches of {args.batch_blocks}")
    for _key, name, value, limit, limit_name in rows:
        print(f"{name:<20}{value:8.2f} GB/s  vs {limit:8.2f} GB/s {limit_name:<20} "
              f"= {value / limit:5.2f}x")
    if counts:
        print(f"raw limits with O_DIRECT: {bool(counts['direct'])}")
        bounced = counts["bounced_transfers"]
        print(f"transfers through the store's bounce buffer (spill and onboard): {bounced}"
              + (" -- buffers off a page boundary" if bounced else ""))
        print("writer threads busy during the spill (their seconds in jobs / threads x "
              f"the spill's seconds): fresh slots {counts['spill_writers_busy_fraction']:.2f}, "
              f"written slots {counts['spill_written_writers_busy_fraction']:.2f}")
    if latency:
        print(f"step p50 idle {latency['idle_p50_ms']:.2f} ms, saturated "
              f"{latency['saturated_p50_ms']:.2f} ms; p99 idle {latency['idle_p99_ms']:.2f} ms, "
              f"saturated {latency['saturated_p99_ms']:.2f} ms "
              f"(disk traffic while saturated: {latency['saturated_disk_gb_per_s']:.2f} GB/s)")
        print(f"step + the tenant's cache calls: p50 {latency['saturated_with_tenant_p50_ms']:.2f}"
              f" ms, p99 {latency['saturated_with_tenant_p99_ms']:.2f} ms")
        for part, name in STEP_PARTS:
            print(f"  {name:<36} p50 idle {latency[f'idle_{part}_p50_ms']:6.2f} ms, saturated "
                  f"{latency[f'saturated_{part}_p50_ms']:6.2f} ms; p99 idle "
                  f"{latency[f'idle_{part}_p99_ms']:6.2f} ms, saturated "
                  f"{latency[f'saturated_{part}_p99_ms']:6.2f} ms")
        if "idle_lock_wait_per_step_p50_ms" in latency:
            for phase in ("idle", "saturated"):
                print(f"  scheduler lock, {phase}: the serving thread waited p50 "
                      f"{latency[f'{phase}_lock_wait_per_step_p50_ms']:.3f} / p99 "
                      f"{latency[f'{phase}_lock_wait_per_step_p99_ms']:.3f} ms a step; the "
                      f"cache thread held it p50 {latency[f'{phase}_trio_lock_hold_p50_ms']:.3f}"
                      f" / p99 {latency[f'{phase}_trio_lock_hold_p99_ms']:.3f} / max "
                      f"{latency[f'{phase}_trio_lock_hold_max_ms']:.3f} ms a time, "
                      f"{latency[f'{phase}_trio_lock_held_share']:.1%} of the run")
        for phase in ("idle", "saturated"):
            print(f"  garbage collector, {phase}: {latency[f'{phase}_gc_collections']:.0f} "
                  f"collections, {latency[f'{phase}_gc_pause_ms']:.1f} ms in all; "
                  f"{latency[f'{phase}_gc_full_collections']:.0f} full, the longest "
                  f"{latency[f'{phase}_gc_full_pause_max_ms']:.1f} ms"
                  + (" (generations frozen after set-up)" if args.gc_freeze else ""))
        if latency.get("saturated_foreground_holds"):
            print(f"foreground held {latency['saturated_foreground_holds']:.0f} times while "
                  f"saturated; the cache's threads waited their turn "
                  f"{latency['saturated_foreground_yields']:.0f} times, "
                  f"{latency['saturated_foreground_timeouts']:.0f} of them for the whole bound")
        if "idle_graph_replays" in latency:
            print("decode steps timed as graph replays: " + ", ".join(
                f"{phase} {latency[f'{phase}_graph_replays']:.0f} "
                f"({latency[f'{phase}_graph_captures']:.0f} captured while timed, "
                f"{latency[f'{phase}_eager_decode_steps']:.0f} eager)"
                for phase in ("idle", "saturated")))

    if args.write:
        figures: dict[str, dict[str, object]] = {}
        for key, _name, value, limit, limit_name in rows:
            figures[key] = {"value": round(value, 3), "unit": "GB/s", "limit": round(limit, 3),
                            "limit_name": f"{limit_name}, same run", "ratio":
                            round(value / limit, 3)}
        if latency:
            for pct in ("p50", "p99"):
                ratio = latency[f"saturated_{pct}_ms"] / latency[f"idle_{pct}_ms"]
                with_tenant = latency[f"saturated_with_tenant_{pct}_ms"] / latency[f"idle_{pct}_ms"]
                figures[f"step_plus_tenant_calls_{pct}_saturated_vs_idle"] = {
                    "value": round(with_tenant, 3), "unit": "x", "ratio": round(with_tenant, 3),
                }
                for part, _name in STEP_PARTS:
                    figures[f"step_{part}_{pct}_saturated_vs_idle"] = {
                        "value": round(latency[f"saturated_{part}_{pct}_ms"], 3), "unit": "ms",
                        "idle_ms": round(latency[f"idle_{part}_{pct}_ms"], 3),
                    }
                figures[f"step_latency_{pct}_saturated_vs_idle"] = {
                    "value": round(ratio, 3), "unit": "x", "ratio": round(ratio, 3),
                    "idle_ms": round(latency[f"idle_{pct}_ms"], 3),
                    "saturated_ms": round(latency[f"saturated_{pct}_ms"], 3),
                    "disk_gb_per_s_while_saturated": round(
                        latency["saturated_disk_gb_per_s"], 3),
                }
            if "idle_lock_wait_per_step_p50_ms" in latency:
                figures["scheduler_lock"] = {
                    "value": round(latency["saturated_lock_wait_per_step_p99_ms"], 4),
                    "unit": "ms",
                    **{key: round(value, 4) for key, value in latency.items() if "lock" in key},
                }
            figures["garbage_collector"] = {
                "value": round(latency["saturated_gc_pause_ms"], 3), "unit": "ms",
                **{key: round(value, 3) for key, value in latency.items() if "_gc_" in key},
            }
            if "saturated_foreground_holds" in latency:
                figures["foreground"] = {
                    "value": int(latency["saturated_foreground_yields"]), "unit": "waits",
                    **{key: int(value) for key, value in latency.items() if "foreground" in key},
                }
            if "idle_graph_replays" in latency:
                figures["decode_graph_steps"] = {
                    "value": latency["saturated_graph_replays"], "unit": "steps",
                    **{f"{phase}_{what}": int(latency[f"{phase}_{what}"])
                       for phase in ("idle", "saturated")
                       for what in ("graph_replays", "graph_captures", "eager_decode_steps")},
                }
        commit = source_commit()
        today = dt.date.today()
        out = write_new_results("io", args.machine, today, {
            "bench": "io", "machine": args.machine, "date": today.isoformat(),
            "commit": commit, "command": "python -m bench.io " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if k not in ("write", "dir", "skip_latency", "latency_only", "tag")
                and v is not None) + (" --latency-only" if args.latency_only else ""),
            "figures": figures,
            # A count, not a figure: transfers of the spill and onboard phases that went
            # through the store's bounce buffer (0 when every buffer was page aligned).
            **({"bounced_transfers": counts["bounced_transfers"]} if counts else {}),
            # Fractions, not figures: the writer threads' seconds in their jobs over the
            # spill's span, per thread (1.0: never waiting for the next job).
            **({key: round(counts[key], 3) for key in (
                "spill_writers_busy_fraction", "spill_written_writers_busy_fraction")}
               if counts else {}),
        }, tag=args.tag)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
