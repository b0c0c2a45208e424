"""The serving-loop side of the system harnesses, and the checks they share.

A :class:`Driver` opens a :class:`~io_actors.embed.BlockingCache` over a real slot store in a
fresh temporary directory (wrapped in :class:`fuzz.store.FuzzStore`), spies on its core, and
plays a serving loop: it adds requests, computes them (allocates pages, writes each block's
KV -- a payload derived from a counter, see :mod:`fuzz.payloads` -- and commits), decodes,
releases and cancels them.  :meth:`Driver.check` verifies everything the issue lists, under
the scheduler's lock so that no completion is applied while it looks:

1. the reference model, fed the exact calls the core executed (:mod:`fuzz.spy`), succeeded
   and failed alike, issued the same commands, and agrees on every counter of
   ``statistics()`` and on every cached block (tier, holders, reuse count, retention stamp);
2. the command contract (:mod:`fuzz.contract`): one transfer per slot -- no spill claims a
   slot with a pending read --, a read names its slot's content, no copy or second read
   touches a GPU page a read is filling;
3. the core's ``check_invariants()``: no page or slot owned twice, no GPU page with a read in
   flight on a free list, the deadline set is exactly the unexpired disk blocks...;
4. readiness: a request is ready only if none of its pages has a read in flight; the count of
   retained disk blocks equals the disk blocks whose TTL is running;
5. bytes: every block of every ready request, and every cached block on GPU or host, holds
   exactly the payload written for its prefix; every read that passed the store returned
   exactly the bytes written for its key, and no flipped slot ever read back.

:meth:`Driver.check_nothing_leaks` is the quiescent end: every request released, nothing in
flight, every page and slot free or cached, the cache closes drained, no thread left, no
descriptor left open on the slot files, no file created or removed, GPU memory back where it
started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import hypothesis.strategies as st
import torch

from fuzz.contract import CommandContract
from fuzz.memory_probe import MemoryProbe, cuda_memory_probe, tensor_holders
from fuzz.payloads import Payloads
from fuzz.spy import CoreSpy, ModelFollower
from fuzz.store import FuzzStore, RandomFaults
from fuzz.tracefile import new_sink
from io_actors.actors.gate import CompletionGate
from io_actors.actors.scheduler import CloseReport
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.storage.interfaces import SlotStore
from io_actors.storage.open_store import open_slot_store
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.slot_format import payload_checksum_torch
from io_actors.tracing.recorder import TraceRecorder
from specs.reference_model import ReferenceCache, observed
from statekv.arith import blocks_for_tokens, is_live
from statekv.config import KVLayout, SpillMode
from statekv.errors import OutOfBlocks, UsageError
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.ids import BlockHash, PageId
from statekv.lifecycle import BlockState
from statekv.manager import KVCacheManager
from statekv.messages import Command

log = logging.getLogger(__name__)

API_CALL_LIMIT = 10.0
"""Seconds a serving-loop call may be blocked before the watchdog calls it a wait on disk I/O
(calls take microseconds; the margin is for a loaded shared host)."""
CLOSE_TIMEOUT = 10.0
"""Seconds closing a cache may take before the harness calls it a hang (it takes
milliseconds)."""
BLOCK_BYTES = 8192
"""Two 4 KiB pages of payload per block: torn writes have pages to tear, copies stay cheap."""



def layout_for(block_size: int) -> KVLayout:
    """A float32 layout of BLOCK_BYTES per block: 2 layers x K,V x tokens x 1 head x dim."""
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=BLOCK_BYTES // (16 * block_size),
                    dtype="float32")


FUZZ_FINGERPRINT = "fuzz-system"
"""The weights the machines' caches serve (a persistent disk tier needs one): part of every
key the oracle derives."""


@attrs.frozen(kw_only=True)
class SystemSpec:
    """Sizes, policies and thread counts of one cache under test."""

    block_size: int
    gpu: int
    host: int
    reserved_host: int
    disk: int
    spill_mode: SpillMode
    spill_min_reuse: int
    protect_unexpired: bool
    drop_on_pressure: bool
    write_queue_depth: int
    priority_levels: int
    writers: int
    readers: int
    direct_io: bool
    max_batch_blocks: int = 16
    reclaim_prefetched_first: bool = True
    retention_write_through: bool = True

    def config(self, directory: Path, device: str, backend: str) -> StateKVConfig:
        return StateKVConfig(
            layout=layout_for(self.block_size), block_size=self.block_size, gpu=self.gpu,
            host=self.host, reserved_host=self.reserved_host, disk=self.disk,
            disk_dir=directory, backend=backend, device=device, writers=self.writers,
            readers=self.readers, write_queue_depth=self.write_queue_depth,
            spill_mode=self.spill_mode, spill_min_reuse=self.spill_min_reuse,
            protect_unexpired=self.protect_unexpired, drop_on_pressure=self.drop_on_pressure,
            priority_levels=self.priority_levels, max_batch_blocks=self.max_batch_blocks,
            reclaim_prefetched_first=self.reclaim_prefetched_first,
            retention_write_through=self.retention_write_through,
            model_fingerprint=FUZZ_FINGERPRINT,
        )


@st.composite
def system_specs(draw: st.DrawFn, max_threads: int = 2) -> SystemSpec:
    return SystemSpec(
        block_size=draw(st.sampled_from([2, 2, 4])),
        gpu=draw(st.integers(4, 8)),
        # Up to host + reserved spills are in flight at once: enough to fill a writer queue
        # of any drawn depth behind a stalled write.
        host=draw(st.integers(1, 6)),
        reserved_host=draw(st.integers(0, 3)),
        disk=draw(st.integers(1, 8)),
        spill_mode=draw(st.sampled_from([SpillMode.ALL, SpillMode.ALL, SpillMode.RETAINED_ONLY,
                                         SpillMode.REUSED])),
        spill_min_reuse=draw(st.integers(1, 2)),
        protect_unexpired=draw(st.booleans()),
        drop_on_pressure=draw(st.booleans()),
        write_queue_depth=draw(st.integers(1, 3)),
        priority_levels=draw(st.integers(1, 3)),
        writers=draw(st.integers(1, max_threads)),
        readers=draw(st.integers(1, max_threads)),
        direct_io=draw(st.booleans()),
        # Lone transfers, small batches that a burst splits, and batches of everything.
        max_batch_blocks=draw(st.sampled_from([1, 2, 16])),
        reclaim_prefetched_first=draw(st.booleans()),
        retention_write_through=draw(st.booleans()),
    )


@attrs.define
class LiveRequest:
    """The harness's view of one request: its tokens and what its blocks must hold."""

    rid: str
    tokens: list[int]
    salt: str | None
    keys: list[BlockHash] = attrs.field(factory=list)
    serials: list[int] = attrs.field(factory=list)
    """Payload serial of each block the request has content for (matched or computed)."""


class Driver:
    """One cache under test, and a serving loop driving it."""

    def __init__(
        self,
        spec: SystemSpec,
        *,
        device: str,
        backend: str,
        gate: CompletionGate | None = None,
        random_faults: RandomFaults | None = None,
        on_commands: Callable[[list[Command]], None] = lambda _cmds: None,
        notify: Callable[[], None] = lambda: None,
        rescue: Callable[[], None] | None = None,
        memory_probe: MemoryProbe | None = None,
        warm: bool = True,
        memory_baseline: int | None = None,
    ) -> None:
        """`rescue` unblocks whatever a blocked serving-loop call may wait for (the store is
        unstalled in any case); see :class:`Watchdog`.  `memory_probe` measures the device
        memory the leak check compares (default: the CUDA allocator's on "cuda", nothing
        elsewhere); with `warm`, the process-lifetime caches exist before its baseline is
        taken (:mod:`fuzz.memory_probe`).  `memory_baseline` is the baseline of an earlier
        cache of the same example that closed (the system machine reopens after a close):
        every cache of an example must give back what it took, so the first one's baseline
        holds for all of them, and it is measured once (a measurement collects garbage, a
        tenth of a second on a GPU process, and examples reopen dozens of times)."""
        if memory_probe is None and device == "cuda":
            memory_probe = cuda_memory_probe
        self.memory_probe = memory_probe
        if memory_probe is not None and warm:
            warm_up(spec, device, backend)
        self.spec = spec
        self.device = device
        self.now = 0.0
        self.tmp = Path(tempfile.mkdtemp(prefix="statekv-fuzz-"))
        # Threads of an earlier cache that hung (already reported as a failure) must not
        # fail this one's leak check too, or shrinking would chase a different error.
        self.threads_before = {t.ident for t in threading.enumerate()}
        self.cache: BlockingCache | None = None
        self.store: FuzzStore | None = None
        try:
            config = spec.config(self.tmp, device, backend)
            core_config = config.core_config()
            self.block_size = core_config.block_size
            self.payloads = Payloads(core_config.block_bytes)
            self.store = FuzzStore(self._open_store(config, backend), expected=self.expected,
                                   notify=notify, random_faults=random_faults)
            self.trace: TraceRecorder = new_sink()
            if memory_baseline is not None:
                self.gpu_memory_at_start = memory_baseline
            else:
                self.gpu_memory_at_start = 0 if memory_probe is None else memory_probe()
            self.gate = gate
            self.cache = BlockingCache(config, store=self.store, gate=gate, clock=self.clock,
                                       recorder=self.trace)
        except BaseException:
            self.clean_up()
            raise
        self.core: KVCacheManager = self.cache._scheduler._core
        self.lock = self.cache._scheduler._lock
        self.pools: tuple[torch.Tensor, torch.Tensor] | None = (
            self.cache.kv_pool, self.cache._pools.host)
        """The cache's GPU and host pools, held for the byte checks: a close gives the
        cache's own references back, and a check after a close still reads what the pages
        held (this harness's references keep them until clean_up or the leak check)."""
        self.contract = CommandContract(core_config.max_batch_blocks)
        self.spy = CoreSpy(self.core, on_commands=on_commands, notify=notify)
        self.follower = ModelFollower(ReferenceCache(core_config), self.contract)
        self.live: dict[str, LiveRequest] = {}
        self.queued: dict[str, tuple[list[int], str | None]] = {}
        """Requests waiting for admission that prefetch: their prompt and salt."""
        self.next_id = 0
        self.next_token = 0
        self.served: list[tuple[list[int], str | None]] = []
        self.watchdog = Watchdog(API_CALL_LIMIT, self._rescuer(rescue))
        self.files_at_open = self._files()

    def _open_store(self, config: StateKVConfig, backend: str) -> SlotStore:
        directory = config.rank_directory()
        assert directory is not None
        core = config.core_config()
        if backend == "posix":
            return PosixSlotStore(directory, core, direct_io=self.spec.direct_io)
        return open_slot_store(backend, directory, core)

    def clock(self) -> float:
        return self.now

    def _rescuer(self, rescue: Callable[[], None] | None) -> Callable[[], None]:
        def unblock() -> None:
            self.fuzz_store.unstall()
            if rescue is not None:
                rescue()
        return unblock

    def expected(self, key: BlockHash) -> torch.Tensor | None:
        """The payload written for `key`, if any request ever computed it."""
        serial = self.payloads.known(key)
        return None if serial is None else self.payloads.bytes_of(serial)

    @property
    def api(self) -> BlockingCache:
        assert self.cache is not None
        return self.cache

    @property
    def fuzz_store(self) -> FuzzStore:
        assert self.store is not None
        return self.store

    def raise_if_crashed(self) -> None:
        cache = self.api
        if not cache._thread.is_alive():
            cache.close()  # re-raises what stopped the trio loop
            raise AssertionError("the cache's trio loop stopped")

    # -------------------------------------------------------------- the serving loop

    def keys_of(self, req: LiveRequest, upto: int) -> list[BlockHash]:
        """The chained keys of the request's first `upto` full blocks."""
        bs = self.block_size
        keys = req.keys
        parent = keys[-1] if keys else root_key(FUZZ_FINGERPRINT, req.salt, None)
        while len(keys) < upto:
            i = len(keys)
            parent = chain_key(parent, token_bytes(req.tokens[i * bs:(i + 1) * bs]))
            keys.append(parent)
        return keys[:upto]

    def prefetch(self, prompt: list[int], salt: str | None, rid: str | None = None
                 ) -> str | None:
        """A request joins the queue and prefetches (again, when `rid` is queued already)."""
        if rid is None:
            rid = f"r{self.next_id}"
            self.next_id += 1
        try:
            with self.watchdog.call("prefetch"):
                self.api.prefetch(rid, prompt, cache_salt=salt)
        except UsageError:
            return None
        self.queued[rid] = (list(prompt), salt)
        return rid

    def admit(self, rid: str) -> LiveRequest | None:
        """The queued request `rid` is admitted (it stays queued if it does not fit)."""
        prompt, salt = self.queued[rid]
        req = self.add(prompt, None, 0, salt, rid=rid)
        if req is not None:
            del self.queued[rid]
        return req

    def leave(self, rid: str) -> None:
        """The queued request `rid` leaves the queue before admission."""
        del self.queued[rid]
        with self.watchdog.call("release"):
            self.api.release(rid)

    def add(self, prompt: list[int], ttl: float | None, priority: int,
            salt: str | None, rid: str | None = None) -> LiveRequest | None:
        if rid is None:
            rid = f"r{self.next_id}"
            self.next_id += 1
        priority = min(priority, self.spec.priority_levels - 1)
        try:
            with self.watchdog.call("add_request"):
                match = self.api.add_request(rid, prompt, ttl_seconds=ttl, priority=priority,
                                             cache_salt=salt)
        except (OutOfBlocks, UsageError):
            return None
        req = LiveRequest(rid, list(prompt), salt)
        matched = match.matched_tokens // self.block_size
        for key in self.keys_of(req, matched):
            serial = self.payloads.known(key)
            assert serial is not None, f"{rid} matched content that nobody wrote"
            req.serials.append(serial)
        self.live[rid] = req
        return req

    def compute(self, req: LiveRequest, extra: int) -> None:
        """A forward pass: pages for 1 + `extra` more tokens, their KV written, committed."""
        api = self.api
        status = api.request_status(req.rid)
        target = min(status.num_tokens, status.num_computed_tokens + 1 + extra)
        try:
            with self.watchdog.call("allocate_nowait"):
                api.allocate_nowait(req.rid, target)
        except OutOfBlocks:
            return
        if not api.is_ready(req.rid):
            return
        bs = self.block_size
        table = api.block_table(req.rid)
        if (api.request_status(req.rid).num_computed_tokens != status.num_computed_tokens
                or len(table) < blocks_for_tokens(target, bs)):
            # A read failed after the allocation (real threads apply completions at any
            # time): the request fell back to recompute from an earlier block, dropping the
            # pages it had; the next step starts over from there.
            return
        keys = self.keys_of(req, target // bs)
        first = status.num_computed_tokens // bs
        del req.serials[first:]
        for i in range(first, blocks_for_tokens(target, bs)):
            end = min((i + 1) * bs, target)
            content: object = keys[i] if end == (i + 1) * bs else ("partial", req.rid, i, end)
            serial = self.payloads.serial(content)
            self.page(table[i]).copy_(self.payloads.bytes_of(serial))
            req.serials.append(serial)
        with self.watchdog.call("commit"):
            api.commit(req.rid, target)

    def page(self, page: PageId) -> torch.Tensor:
        assert self.pools is not None
        return self.pools[0][page].view(-1).view(torch.uint8)

    def host_page(self, page: PageId) -> torch.Tensor:
        assert self.pools is not None
        return self.pools[1][page].reshape(-1).view(torch.uint8)

    def decode(self, req: LiveRequest, token: int) -> None:
        try:
            with self.watchdog.call("append_tokens"):
                self.api.append_tokens(req.rid, [token])
        except UsageError:
            return
        req.tokens.append(token)

    def release(self, rid: str) -> None:
        del self.live[rid]
        with self.watchdog.call("release"):
            self.api.release(rid)

    def serve(self, prompt: list[int], ttl: float | None, priority: int,
              salt: str | None = None) -> None:
        """Add, compute and release one request (released unserved if it is parked)."""
        req = self.add(prompt, ttl, priority, salt)
        if req is None:
            return
        self.served.append((prompt, salt))
        if self.api.is_ready(req.rid):
            self.compute(req, 1 << 20)
        self.release(req.rid)

    def fresh_prompt(self, blocks: int | None) -> list[int]:
        """Never-seen tokens: `blocks` full blocks and one more token (None: the whole GPU)."""
        self.next_token += 1
        full = self.spec.gpu * self.block_size - 1
        size = full if blocks is None else min(blocks * self.block_size + 1, full)
        return [100 + self.next_token * 64 + i for i in range(size)]

    # -------------------------------------------------------------- checks

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Hold the scheduler's lock: no call or completion reaches the core meanwhile."""
        with self.lock:
            yield

    def check(self) -> None:
        """Every invariant of the module docstring (call while no serving call runs)."""
        with self.frozen():
            self._check_locked()

    def _check_locked(self) -> None:
        core = self.core
        self.follower.follow(self.spy.log)
        core.check_invariants()
        cache = self.cache
        assert cache is not None, "checked after the cache was cleaned up"
        # Looked up through the cache: the driver keeps no reference of its own to the
        # scheduler (it holds the pools, which the leak check must see go at close).
        cache._scheduler.check_own_invariants_locked()
        model = self.follower.model
        stats = core.statistics()
        assert stats == model.statistics(), "statistics() differ from the model's"
        cached = core.cached_blocks()
        real_cached = observed(cached)
        assert real_cached == model.cached(), "cached blocks differ from the model's"
        reading = self.contract.read_pages
        for rid in self.live:
            ready = core.is_ready(rid)
            assert ready == model.is_ready(rid), f"{rid}: readiness differs from the model's"
            if ready and reading:
                pending = [p for p in core.block_table(rid) if p in reading]
                assert not pending, f"{rid} is ready while reads fill its pages {pending}"
        # Disk content, and the disk copies of blocks on GPU or host, whose deadline runs.
        live_on_disk = sum(1 for b in cached
                           if (b.state is BlockState.ON_DISK or b.has_disk_copy)
                           and is_live(b.expiry, model.now))
        assert stats.disk_retained_blocks == live_on_disk, "deadline set != retained blocks"
        self._check_bytes_locked()
        violations = self.fuzz_store.violations
        assert not violations, violations

    def _check_bytes_locked(self) -> None:
        """Ready requests' blocks and cached blocks at rest hold the payloads written."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        core, payloads, bs = self.core, self.payloads, self.block_size
        for rid, req in self.live.items():
            if not core.is_ready(rid):
                continue
            status = core.request_status(rid)
            table = core.block_table(rid)
            for i in range(blocks_for_tokens(status.num_computed_tokens, bs)):
                expected = payloads.bytes_of(req.serials[i])
                assert torch.equal(self.page(table[i]).cpu(), expected), (
                    f"{rid}: block {i} (page {table[i]}) holds bytes other than its KV"
                )
        for block in core._index.blocks.values():
            key = block.key
            assert key is not None
            serial = payloads.known(key)
            assert serial is not None, f"{block!r} is cached content nobody wrote"
            if block.state in (BlockState.ON_GPU, BlockState.RELEASED):
                assert block.gpu_page is not None
                got = self.page(block.gpu_page).cpu()
            elif block.state in (BlockState.ON_HOST, BlockState.SPILLING,
                                 BlockState.PREFETCHED):
                # A prefetched block's page holds what its read landed: the content's bytes.
                assert block.host_page is not None
                got = self.host_page(block.host_page)
            else:
                continue
            assert torch.equal(got, payloads.bytes_of(serial)), (
                f"{block!r} ({block.state.name}) holds bytes other than its content's"
            )

    def check_errors_counted(self, held_failed_writes: int, held_failed_reads: int) -> None:
        """Every store call that failed is a failed completion, counted or still held."""
        stats = self.core.statistics()
        store = self.fuzz_store
        assert store.write_errors == stats.spill_failures + held_failed_writes, (
            f"{store.write_errors} writes failed at the store, {stats.spill_failures} counted, "
            f"{held_failed_writes} held: {store.injected}"
        )
        failed_reads = stats.onboard_failures + stats.prefetch_failures
        assert store.read_errors == failed_reads + held_failed_reads, (
            f"{store.read_errors} reads failed at the store, {failed_reads} counted, "
            f"{held_failed_reads} held: {store.injected}"
        )

    def check_nothing_leaks(self) -> None:
        """With every request released and nothing in flight: nothing is left anywhere, and
        the cache closes drained, leaving no thread, descriptor, file or GPU memory behind."""
        self.check()
        self.check_errors_counted(0, 0)
        spec = self.spec
        stats = self.core.statistics()
        states = dict(stats.blocks_by_state)
        assert stats.writes_in_flight == stats.reads_in_flight == stats.parked_requests == 0
        assert stats.prefetch_reads_in_flight == stats.prefetching_requests == 0
        for state in ("ON_GPU", "SPILLING", "ONBOARDING", "ERROR", "PREFETCHING",
                      "PREFETCHED"):
            assert states[state] == 0, f"{states[state]} blocks {state} with nothing running"
        assert stats.gpu_free_pages + stats.gpu_evictable_blocks == spec.gpu
        assert (stats.host_free_pages + stats.host_reserved_pages + stats.host_cached_blocks
                == spec.host + spec.reserved_host)
        assert (stats.disk_empty_slots + stats.disk_cached_blocks + stats.disk_copy_blocks
                == spec.disk)
        # A clean close writes down released content whose TTL runs (on GPU or host only):
        # its writes must flow, whatever the machine held back.
        opener = getattr(self.gate, "open", None)   # FuzzGate: let held completions go
        if opener is not None:
            opener()
        report = self.close_within(self.api, CLOSE_TIMEOUT, drain=True)
        # Nothing was in flight: nothing to drop; only the close's own writes of retained
        # content finish during it, and every promise is kept.
        assert report is not None and report.drained, report
        assert (report.writes_dropped, report.reads_dropped,
                report.reads_finished_during_close) == (0, 0, 0), report
        assert report.writes_finished_during_close <= report.retained_written, report
        # What the report says was left unwritten is exactly what is: released content
        # under a running TTL, on GPU or host with no disk copy.
        now = self.clock()
        unwritten = sum(1 for b in self.core.cached_blocks()
                        if b.state.name in ("RELEASED", "ON_HOST") and not b.has_disk_copy
                        and b.expiry is not None and b.expiry > now)
        assert report.retained_not_written == unwritten, (report, unwritten)
        stats = self.core.statistics()   # the close's writes are counted by the core too
        after = self.api.statistics()
        for pool in (after.writer, after.reader):
            assert pool is not None
            assert pool.queued == pool.in_flight == pool.dropped_at_close == 0, pool
        assert after.spill_backlog == 0, after
        assert after.slots_discarded == self.fuzz_store.discards, (
            f"{after.slots_discarded} slots discarded, the store saw "
            f"{self.fuzz_store.discards}")
        assert after.writer is not None and after.reader is not None
        assert (after.writer.completed, after.writer.failed, after.reader.completed,
                after.reader.failed) == (
            stats.spills_completed, stats.spill_failures,
            stats.onboards_completed + stats.prefetches_completed,
            stats.onboard_failures + stats.prefetch_failures), (
            f"pools {after.writer} {after.reader} vs the core's {stats}")
        threads = self.new_threads()
        assert not threads, f"threads left running: {threads}"
        self.fuzz_store.close()
        opened = [path for path in _descriptors() if path.startswith(str(self.tmp))]
        assert not opened, f"descriptors left open: {opened}"
        assert self._files() == self.files_at_open, "files appeared or vanished"
        if self.memory_probe is not None:
            # The baseline was taken after the process-lifetime caches were warmed (the device
            # checksum's CRC tables, torch's per-thread handles and workspaces: see
            # fuzz.memory_probe): what is held now beyond it, this cache kept after closing.
            self.cache = None
            self.pools = None
            held = self.memory_probe()  # it collects garbage first
            if held != self.gpu_memory_at_start:
                holders = tensor_holders() if self.device == "cuda" else ""
                raise AssertionError(
                    f"GPU memory leaked: {held - self.gpu_memory_at_start} bytes more held "
                    f"after the cache closed than before it opened "
                    f"({self.gpu_memory_at_start} bytes, measured after warming the "
                    f"process-lifetime caches); {holders}")

    def new_threads(self) -> list[str]:
        """statekv threads started since this driver was made and still running."""
        return [t.name for t in threading.enumerate()
                if t.name.startswith("statekv-") and t.ident not in self.threads_before]

    def clean_up(self) -> None:
        """Close whatever is still open and remove the directory (failures are not checked:
        this runs after a failed step too)."""
        if hasattr(self, "watchdog"):
            self.watchdog.stop()
        cache, self.cache = self.cache, None
        self.pools = None
        if self.store is not None:
            self.store.unstall()
        # The failed step's own error is what gets reported, not these.
        if cache is not None:
            with contextlib.suppress(Exception):
                self.close_within(cache, CLOSE_TIMEOUT, drain=False)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close_within(
        self, cache: BlockingCache, seconds: float, *, drain: bool
    ) -> CloseReport | None:
        """Close `cache`; a close that hangs is a failure, reported with what the pools
        still count, instead of a run that never ends."""
        return self.start_close(cache, drain=drain).wait(seconds)

    def start_close(self, cache: BlockingCache, *, drain: bool) -> Closer:
        """Start closing `cache` on a thread of its own (see :class:`Closer`)."""
        return Closer(cache, self.fuzz_store, drain=drain)

    def _files(self) -> set[str]:
        return {str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*")}


def _descriptors() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return out


class Closer:
    """Closes a cache on a thread of its own, so that the harness can act meanwhile (let a
    stalled disk go on) and can tell a close that hangs from one that finishes."""

    def __init__(self, cache: BlockingCache, store: FuzzStore, *, drain: bool) -> None:
        self.cache = cache
        self.store = store
        self.outcome: list[CloseReport | None] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._close, args=(drain,),
                                       name="fuzz-closer", daemon=True)
        self.thread.start()

    def _close(self, drain: bool) -> None:
        try:
            self.outcome.append(self.cache.close(drain=drain))
        except BaseException as exc:
            self.errors.append(exc)

    def wait_until_closing(self, seconds: float) -> None:
        """Until the scheduler refuses new calls: it is then dropping or draining."""
        deadline = time.monotonic() + seconds
        while not self.cache._scheduler._closed and self.thread.is_alive():
            if time.monotonic() > deadline:
                raise AssertionError(f"the cache did not start closing in {seconds}s")
            time.sleep(0.0005)

    def wait(self, seconds: float) -> CloseReport | None:
        self.thread.join(seconds)
        if self.thread.is_alive():
            scheduler = self.cache._scheduler
            writer, reader = scheduler._writer, scheduler._reader
            raise AssertionError(
                f"closing the cache hung for {seconds}s: writer "
                f"{writer.statistics() if writer else None}, reader "
                f"{reader.statistics() if reader else None}, backlog "
                f"{len(scheduler._spill_backlog)}, store stalled {self.store.stalled}, "
                f"threads {[t.name for t in threading.enumerate()]}"
            )
        if self.errors:
            raise self.errors[0]
        return self.outcome[0]


class Watchdog:
    """Notices a serving-loop call blocked for longer than `limit` seconds.

    A call that waits on disk I/O would wait forever on a stalled disk (the harness unstalls
    it only after the call returns), so a timer after the call could never fire.  One thread
    per cache watches the call in progress instead; past the limit it runs `rescue`
    (unstalling the disk, letting held completions through) so that the call returns, and
    the call then fails the step.
    """

    def __init__(self, limit: float, rescue: Callable[[], None]) -> None:
        self.limit = limit
        self.slowest = 0.0
        """The longest serving-loop call so far, in seconds."""
        self.fired: str | None = None
        self._rescue = rescue
        self._lock = threading.Lock()
        self._call: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fuzz-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.limit / 10):
            with self._lock:
                call = self._call
            if call is not None and self.fired is None and \
                    time.monotonic() - call[1] > self.limit:
                self.fired = call[0]
                self._rescue()

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Watch one call; it fails if it was blocked past the limit."""
        started = time.monotonic()
        with self._lock:
            self._call = (what, started)
        try:
            yield
        finally:
            with self._lock:
                self._call = None
            self.slowest = max(self.slowest, time.monotonic() - started)
        if self.fired is not None:
            raise AssertionError(f"{self.fired} was blocked for over {self.limit}s: the "
                                 "serving loop waited on disk I/O")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------- warming up
# Here, not in fuzz.memory_probe: the warm-up runs a whole Driver, and the Driver runs the
# warm-up before its first baseline; the probe module only measures.

WARM_TIMEOUT = 30.0
"""Seconds the warm-up's transfers may take to land."""

_warmed: set[tuple[str, str, int]] = set()


def warm_up(spec: SystemSpec, device: str, backend: str) -> bool:
    """Run one whole cache life of `spec`'s shape on `device` over `backend`, once per
    process for each (device, backend, block size); True if it ran now."""
    # The key comes from the configuration alone: opening a cache to learn it would double
    # the cost of every open (the GPU profile reopens dozens of times per example).
    block_bytes = spec.config(Path("unused"), device, backend).core_config().block_bytes
    key = (device, backend, block_bytes)
    if key in _warmed:
        return False
    shape = attrs.evolve(spec, spill_mode=SpillMode.ALL, drop_on_pressure=False,
                         protect_unexpired=False)
    d = Driver(shape, device=device, backend=backend, warm=False)
    try:
        payload_checksum_torch(torch.zeros(d.payloads.nbytes, dtype=torch.uint8,
                                           device=d.api.device))
        first = d.fresh_prompt(1)  # one block: it fits the smallest host tier
        d.serve(first, None, 0)
        # Push it down the tiers (GPU -> host copies, spills) without displacing it from
        # the disk, then read it back.
        for _ in range(2):
            d.serve(d.fresh_prompt(None), None, 0)
            _until_quiet(d)
        req = d.add(first, None, 0, None)
        if req is not None:
            d.api.wait_ready(req.rid, timeout=WARM_TIMEOUT)
            _until_quiet(d)
            d.release(req.rid)
        _until_quiet(d)
        stats = d.api.statistics().cache
        log.debug("warm-up: %d spills, %d onboards", stats.spills_completed,
                  stats.onboards_completed)
        d.api.close(drain=True)
    finally:
        d.clean_up()
    _warmed.add(key)
    return True


def _until_quiet(d: Driver) -> None:
    deadline = time.monotonic() + WARM_TIMEOUT
    while True:
        stats = d.api.statistics()
        if not (stats.cache.writes_in_flight or stats.cache.reads_in_flight):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the warm-up's transfers did not land: {stats}")
        time.sleep(0.001)
