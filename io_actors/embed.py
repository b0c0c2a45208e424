"""Embedding statekv: an async API for trio programs and a blocking facade for the rest.

Async (trio)::

    async with open_cache(config) as cache:
        match = cache.add_request("r1", prompt, ttl_seconds=600)
        await cache.wait_ready("r1")          # only when match.disk_tokens > 0
        ...

Blocking (a synchronous serving loop, the common case)::

    with BlockingCache(config) as cache:      # the trio loop runs in its own thread
        match = cache.add_request("r1", prompt)
        if cache.is_ready("r1"):              # O(1); parked while disk reads are in flight
            cache.allocate_nowait("r1", len(prompt))
            pages = cache.block_table("r1")   # index cache.kv_pool with these
            ...forward pass writes KV...
            cache.commit("r1", len(prompt))
        cache.release("r1")

Every method is thread-safe and returns without waiting on disk: the calls run the core's
bookkeeping on the caller's thread under the scheduler's lock (microseconds) and hand disk
work to the trio thread.  See README.md for the whole step protocol.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, suppress
from types import TracebackType
from typing import TYPE_CHECKING, Final

import attrs
import torch
import trio

if TYPE_CHECKING:  # needs the optional redis-py: imported where a shared tier is opened
    from io_actors.storage.redis_store import RedisClusterStore

from io_actors.actors.gate import CompletionGate, OpenGate
from io_actors.actors.reader_pool import ReaderPool
from io_actors.actors.scheduler import (
    CloseReport,
    InlineIO,
    RemoteTier,
    Scheduler,
    SystemStatistics,
    WallClock,
)
from io_actors.actors.writer_pool import WriterPool
from io_actors.config import StateKVConfig, public_size_error
from io_actors.memory.pools import KVPools, TorchCopyEngine, physical_memory
from io_actors.storage.gc_pause import gc_paused
from io_actors.storage.interfaces import SlotStore
from io_actors.storage.open_store import open_slot_store, public_config_error
from io_actors.storage.posix_open import Recovery
from io_actors.tracing.recorder import TraceRecorder
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.ids import BlockHash, PageId, TransferId
from statekv.manager import (
    CachedBlock,
    KVCacheManager,
    PrefetchStarted,
    PrefixMatch,
    RequestStatus,
    RestoredBlock,
)
from statekv.messages import Completion
from statekv.trace import TraceSink

log = logging.getLogger(__name__)


def check_device_present(name: str) -> None:
    """raises: ConfigError("device") where `name` asks for CUDA ("cuda" or "cuda:N") and
    torch sees no GPU.  Makes no CUDA context."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA was asked for but torch sees no GPU")


def resolve_device(name: str) -> torch.device:
    """'auto' means CUDA when present, else the CPU (same code path, real copies)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    check_device_present(name)
    if name.startswith("cuda:"):
        return torch.device(name)
    if name == "cuda":
        # Bound to the current device's index: reader threads call torch.cuda.set_device
        # with it, which refuses an index-less device, and a tensor-parallel rank's current
        # device is its own GPU (its local rank), not device 0.
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


CORE_BYTES_PER_BLOCK: Final = 400
"""What the core keeps per page and slot (its preallocated records and free lists), rounded
up from about 390 bytes measured with tracemalloc at a million disk slots."""


def check_bookkeeping_fits(config: CacheConfig) -> None:
    """Refuse sizes whose bookkeeping alone exceeds this machine's memory: a ConfigError
    naming the largest size, before anything is allocated (not a MemoryError, or the
    process killed by the kernel, halfway through building the core)."""
    sizes = {"gpu": config.gpu_blocks, "host": config.host_blocks,
             "reserved_host": config.reserved_host_blocks, "disk": config.disk_blocks}
    need = sum(sizes.values()) * CORE_BYTES_PER_BLOCK
    physical = physical_memory()
    if physical is not None and need > physical // 2:
        field = max(sizes, key=lambda name: sizes[name])
        raise ConfigError(
            field, f"{sizes[field]} blocks need about {need} bytes of bookkeeping "
            f"({CORE_BYTES_PER_BLOCK} per block), more than half of this machine's "
            f"{physical} bytes of memory"
        )


def restore_from_disk(
    core: KVCacheManager, store: SlotStore | None, now: float
) -> Recovery | None:
    """Adopt what the store's index rebuild found (PosixSlotStore.recovery) into a fresh core."""
    recovery = getattr(store, "recovery", None)
    if not isinstance(recovery, Recovery):
        return None
    with gc_paused():  # a few kept objects per slot: see io_actors/storage/gc_pause.py
        core.restore(
            [
                RestoredBlock(
                    key=found.key, parent_key=BlockHash(found.meta.parent), slot=found.slot,
                    depth=found.meta.depth, reuse_count=found.meta.reuse_count,
                    expiry=found.meta.expiry, written_at=found.meta.written_at,
                    sequence=found.meta.sequence,
                )
                for found in recovery.slots
            ],
            now=now,
        )
    if recovery.slots or recovery.reclaimed or recovery.old_files:
        log.info(
            "disk index rebuilt from %s: %d blocks restored; reclaimed %d foreign, %d corrupt,"
            " %d unauthenticated, %d duplicate, %d beyond capacity slots; %d old files",
            "the index journal" if recovery.index.source == "journal" else "the slot headers",
            len(recovery.slots), recovery.foreign, recovery.corrupt, recovery.unauthenticated,
            recovery.duplicates, recovery.beyond_capacity, recovery.old_files,
        )
    return recovery


class CacheAPI:
    """The calls a serving loop makes; shared by the async API and the blocking facade."""

    _scheduler: Scheduler
    _pools: KVPools

    @property
    def config(self) -> CacheConfig:
        return self._scheduler.core_config

    @property
    def kv_pool(self) -> torch.Tensor:
        """The GPU pool: [blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]."""
        if self._pools.released:
            raise UsageError("kv_pool", "the cache is closed: its pools were given back")
        return self._pools.gpu

    @property
    def device(self) -> torch.device:
        return self._pools.gpu.device

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        ttl_seconds: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> PrefixMatch:
        """Register a request and take the longest cached prefix (see KVCacheManager)."""
        return self._scheduler.add_request(
            request_id, token_ids, ttl_seconds=ttl_seconds, priority=priority,
            cache_salt=cache_salt, lora_id=lora_id,
        )

    def prefetch(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> PrefetchStarted:
        """A request waiting for admission: start reading its disk blocks into host pages,
        so that its add_request finds host hits (see KVCacheManager.prefetch).  Ends with
        add_request(request_id, ...) or release(request_id)."""
        return self._scheduler.prefetch(request_id, token_ids, cache_salt=cache_salt,
                                        lora_id=lora_id)

    def report_prefill(self, num_tokens: int, seconds: float, *, context_tokens: int) -> None:
        """The model prefilled `num_tokens` new tokens in `seconds`, ending at a context of
        `context_tokens`: the estimate cost-aware onboarding weighs disk reads against."""
        self._scheduler.report_prefill(num_tokens, seconds, context_tokens=context_tokens)

    def cost_estimates(self) -> tuple[float | None, float | None]:
        """(disk read bytes per second measured by the readers, prefill seconds per token at
        the longest context reported): None where nothing was measured yet."""
        return self._scheduler.cost_estimates()

    def allocate_nowait(self, request_id: str, num_tokens: int) -> None:
        """GPU pages for the request's first `num_tokens` tokens, or OutOfBlocks."""
        self._scheduler.allocate_nowait(request_id, num_tokens)

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """KV for tokens [0, num_computed_tokens) is written: share its full blocks."""
        self._scheduler.commit(request_id, num_computed_tokens)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._scheduler.append_tokens(request_id, token_ids)

    def release(self, request_id: str) -> None:
        """The request finished or was cancelled (or, never admitted, left the queue after
        a prefetch)."""
        self._scheduler.release(request_id)

    def is_ready(self, request_id: str) -> bool:
        """Whether every block has landed on GPU (O(1)); a parked request is not."""
        return self._scheduler.is_ready(request_id)

    def block_table(self, request_id: str) -> tuple[PageId, ...]:
        return self._scheduler.block_table(request_id)

    @property
    def orders_passes_by_page(self) -> bool:
        """Whether :meth:`order_forward_after_copies` orders anything: True under
        ``compute_waits="pages"`` on a GPU; False where every pass already waits for every
        copy (a serving loop then need not gather its pages at all)."""
        return self._scheduler.orders_passes_by_page

    def order_forward_after_copies(self, gpu_pages: Iterable[int]) -> None:
        """Call before launching GPU work that reads or writes `gpu_pages` of :attr:`kv_pool`
        (a forward pass: every page of its batch's block tables).  Under
        ``compute_waits="pages"`` that work then waits for the copies of those pages only;
        under "all" (and on a CPU device) it already waits for every copy, and this returns
        at once.  A page named before, still held by the same request, need not be named
        again: the cache copies into no page of a request once it is ready, and out of such a
        page only whole committed blocks, which a pass does not write."""
        self._scheduler.order_forward_after_copies(gpu_pages)

    def obtainable_gpu_blocks(self) -> int:
        """GPU pages allocation could have now (empty plus evictable): for admission control."""
        return self._scheduler.obtainable_gpu_blocks()

    def request_status(self, request_id: str) -> RequestStatus:
        return self._scheduler.request_status(request_id)

    def prefetch_reads_pending(self, request_id: str) -> int:
        """Reads of a queued request's prefetch still in flight (0: all landed, or none)."""
        return self._scheduler.prefetch_reads_pending(request_id)

    def prefetch_could_start(self) -> bool:
        """Whether a prefetch could take a host page now; when not, asking again for a
        queued request's unfetched blocks would start nothing (KVCacheManager's)."""
        return self._scheduler.prefetch_could_start()

    def disk_reads_in_flight(self) -> int:
        """Disk reads (onboards and prefetches) the cache waits for: the readers' work."""
        return self._scheduler.disk_reads_in_flight()

    def foreground(self) -> AbstractContextManager[None]:
        """Hold it while the serving thread works -- its scheduling, its cache calls, the
        launch of its forward pass -- and let go while it waits for the GPU: the cache's
        threads run their Python in those waits, not in the hand-overs of the serving
        thread's torch calls (io_actors.actors.foreground).  Waits are bounded, so holding
        it too long only delays the cache's disk work."""
        return self._scheduler.foreground.held()

    def statistics(self) -> SystemStatistics:
        return self._scheduler.statistics()

    def check_invariants(self) -> None:
        self._scheduler.check_invariants()

    def cached_blocks(self) -> tuple[CachedBlock, ...]:
        """Every block of the prefix index with its tier: for debugging, tests and the
        cross-rank agreement checks of io_actors.tensor_parallel.agreement."""
        return self._scheduler.cached_blocks()

    def transfers_in_flight(self) -> tuple[TransferId, ...]:
        """Disk transfers dispatched whose completion is not applied yet, oldest first."""
        return self._scheduler.transfers_in_flight()

    def filter_completions(self, completion_filter: Callable[[Completion], Completion]) -> None:
        """Map every completion before it is applied (Scheduler.completion_filter); set it
        before the first request: io_actors.tensor_parallel.agreement does."""
        self._scheduler.completion_filter = completion_filter


class AsyncCache(CacheAPI):
    """The cache inside a trio program (from open_cache)."""

    def __init__(self, scheduler: Scheduler, pools: KVPools) -> None:
        self._scheduler = scheduler
        self._pools = pools
        self.close_report: CloseReport | None = None
        self.drain_on_close = True
        """Whether leaving open_cache waits for disk work in flight (else drops the queue)."""

    async def wait_ready(self, request_id: str) -> None:
        """Wait until the request's onboard reads have landed, or it is gone (released,
        perhaps by another thread before this task ran: returns at once)."""
        await self._scheduler.wait_ready(request_id)


@asynccontextmanager
async def open_cache(
    config: StateKVConfig,
    *,
    store: SlotStore | None = None,
    gate: CompletionGate | None = None,
    clock: Callable[[], float] | None = None,
    trace: TraceSink | None = None,
    synchronous_io: bool = False,
    recorder: TraceRecorder | None = None,
) -> AsyncIterator[AsyncCache]:
    """Open a cache for a trio program; closing drains (or drops) disk work in flight.

    `store` replaces the configured backend (tests wrap one in fault injection); `gate`
    holds completions until released (the fuzz suite); `clock` replaces the wall clock;
    `synchronous_io` runs disk transfers inside the cache calls (the naive design, kept
    for comparison in the benchmarks); `recorder` records every transition and every
    message between the actors (io_actors.tracing.recorder; off when None).
    """
    if not isinstance(config, StateKVConfig):
        raise UsageError("config", f"must be a StateKVConfig, got {config!r}")
    if recorder is None and isinstance(trace, TraceRecorder):
        recorder = trace  # a recorder passed as the core's sink records messages too
    if recorder is not None:
        # The recorder is the core's sink as well: one trace holds both, in one order.
        if trace is not None and trace is not recorder:
            raise UsageError("trace", "pass either `trace` or `recorder` (which records "
                             "transitions too), not both")
        trace = recorder
    core_config = config.core_config()
    device = resolve_device(config.device)
    check_bookkeeping_fits(core_config)
    try:
        pools = KVPools(core_config, device)
    except ConfigError as exc:
        raise public_size_error(exc) from None
    try:
        copies = TorchCopyEngine(
            pools, compute_waits=config.compute_waits,
            gather_kernel={"auto": None, "on": True, "off": False}[config.copy_kernel])
    except ConfigError as exc:
        if exc.field != "gather_kernel":
            raise
        raise ConfigError("copy_kernel", f'"on" {exc.message}') from None
    clock = clock or WallClock()
    owns_store = store is None
    # All or nothing: the shared tier is connected first, because opening the slot store
    # creates the directory and data file (and with persist=False wipes what was there).
    # An unreachable cluster must leave the disk as it found it.
    shared: RedisClusterStore | None = (
        open_shared_store(config, core_config) if config.remote_url is not None else None
    )
    if core_config.disk_blocks and store is None:
        directory = config.rank_directory()
        assert directory is not None
        try:
            store = open_slot_store(
                config.backend, directory, core_config, persist=config.persist,
                sync_writes=config.disk_sync == "data", mac_key=config.disk_mac_key,
                owned_from=config.disk_dir,
            )
        except BaseException as exc:
            if shared is not None:
                shared.close()
            if isinstance(exc, ConfigError):
                raise public_config_error(exc) from None
            raise
    remote: RemoteTier | None = None
    try:
        if shared is not None:
            from io_actors.actors.remote_fetcher import RemoteFetcher
            from io_actors.actors.remote_publisher import RemotePublisher

            remote = RemoteTier(
                publisher=RemotePublisher(shared, core_config,
                                          queue_depth=config.remote_queue_depth),
                fetcher=RemoteFetcher(shared, core_config,
                                      lookup_timeout_s=config.remote_timeout_s),
                host_page=pools.host_page, gpu_page=pools.gpu_page,
            )
        inline = InlineIO(store, pools, device) if synchronous_io and store is not None else None
        core = KVCacheManager(core_config, trace=trace)
        recovery = restore_from_disk(core, store, clock())
        scheduler = Scheduler(core, copies, store, clock=clock, inline_io=inline,
                              recorder=recorder, remote=remote)
        scheduler.recovery = recovery
        gate = gate or OpenGate()
        writer = reader = None
        if store is not None and inline is None:
            writer = WriterPool(
                store, pools.host_page, checksums=pools.host_checksums, workers=config.writers,
                queue_depth=config.write_queue_depth, gate=gate,
                report=scheduler.report_completion, foreground=scheduler.foreground,
            )
            reader = ReaderPool(
                store, pools.gpu_page, new_staging=pools.new_staging_buffer, device=device,
                batch_blocks=core_config.max_batch_blocks, workers=config.readers,
                queue_depth=max(1, core_config.gpu_blocks + core_config.host_blocks
                                + core_config.reserved_host_blocks),
                gate=gate, report=scheduler.report_completion,
                foreground=scheduler.foreground, host_page=pools.host_page,
                checksums=pools.host_checksums, measured=scheduler.report_disk_read,
            )
        cache = AsyncCache(scheduler, pools)
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run, writer, reader)
            ok = False
            try:
                yield cache
                ok = True
            finally:
                with trio.CancelScope(shield=True):
                    cache.close_report = await scheduler.close(
                        drain=cache.drain_on_close and ok
                    )
    finally:
        # Every thread that touched a page has stopped (the nursery is done, or never ran).
        pools.release()
        copies.release()
        if remote is not None:
            remote.fetcher.close()
        if shared is not None:
            shared.close()
        if store is not None and owns_store:
            store.close()


def remote_key(secret: bytes, namespace: str) -> bytes:
    """The shared tier's MAC key for one namespace: keyed BLAKE2b of the namespace under the
    caller's secret, so that one secret serves several deployments on a cluster and a value
    of one namespace never verifies in another."""
    return hashlib.blake2b(namespace.encode(), key=secret, digest_size=32,
                           person=b"statekv-remote").digest()


def open_shared_store(config: StateKVConfig, core_config: CacheConfig) -> RedisClusterStore:
    """Connect to the configured cluster; ConfigError naming the StateKVConfig field."""
    assert config.remote_url is not None
    try:
        from io_actors.storage.redis_store import RedisClusterStore
    except ImportError as exc:
        raise ConfigError("remote_url", "the shared tier needs redis-py: pip install "
                          f"'statekv[redis]' ({exc})") from None
    try:
        assert config.remote_secret is not None  # StateKVConfig requires it
        return RedisClusterStore(config.remote_url, core_config,
                                 namespace=config.remote_namespace,
                                 mac_key=remote_key(config.remote_secret,
                                                    config.remote_namespace),
                                 timeout_s=config.remote_timeout_s,
                                 password=config.remote_password,
                                 tls_ca_file=config.remote_tls_ca_file)
    except ConfigError as exc:
        field = {"url": "remote_url", "namespace": "remote_namespace",
                 "mac_key": "remote_secret", "timeout_s": "remote_timeout_s",
                 "password": "remote_password",
                 "tls_ca_file": "remote_tls_ca_file"}.get(exc.field, exc.field)
        raise ConfigError(field, str(exc).split(": ", 1)[-1]) from None


class BlockingCache(CacheAPI):
    """The cache for a synchronous serving loop: its trio loop runs in a thread of its own."""

    def __init__(
        self,
        config: StateKVConfig,
        *,
        store: SlotStore | None = None,
        gate: CompletionGate | None = None,
        clock: Callable[[], float] | None = None,
        trace: TraceSink | None = None,
        synchronous_io: bool = False,
        recorder: TraceRecorder | None = None,
    ) -> None:
        if isinstance(config, StateKVConfig):
            # CUDA's current device is per thread: resolve "cuda"/"auto" here, on the caller's
            # thread (a tensor-parallel rank has selected its own GPU), not on the cache's
            # trio thread, which starts on device 0.
            config = attrs.evolve(config, device=str(resolve_device(config.device)))
        self._open_args = (config, store, gate, clock, trace, synchronous_io)
        self._recorder = recorder
        self.async_cache: AsyncCache | None = None
        """The async API this facade runs on its trio thread (for tasks spawned there)."""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._drain = True
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.close_report: CloseReport | None = None
        self._thread = threading.Thread(target=self._main, name="statekv-trio", daemon=True)
        try:
            self._thread.start()  # waits for the thread to run: interruptible too
            self._ready.wait()
        except BaseException:
            # Interrupted (Ctrl-C) while the trio thread opens the cache: left running, that
            # daemon thread would still be in the store's open (torch buffers, file syncs)
            # when the interpreter exits, which aborted the process ("terminate called
            # without an active exception").  Let it finish opening, then close it.  An
            # interrupt inside start() may come before or after the thread was launched: one
            # that is not running a second later never was.
            waited = 0
            while not self._ready.wait(0.01):
                waited = 0 if self._thread.is_alive() else waited + 1
                if waited > 100:
                    break
            if self._ready.is_set():
                with suppress(BaseException):
                    self.close(drain=False)
            raise
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        """Re-raise what stopped the trio thread (an actor crashed, or it never started)."""
        error = self._error
        if error is not None:
            self._thread.join()
            raise error

    def _main(self) -> None:
        try:
            trio.run(self._amain)
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _amain(self) -> None:
        config, store, gate, clock, trace, synchronous_io = self._open_args
        async with open_cache(config, store=store, gate=gate, clock=clock, trace=trace,
                              synchronous_io=synchronous_io,
                              recorder=self._recorder) as cache:
            self._scheduler = cache._scheduler
            self._pools = cache._pools
            self.async_cache = cache
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()
            # Leaving open_cache closes the scheduler: drain unless told otherwise.
            cache.drain_on_close = self._drain
        self.close_report = cache.close_report

    def wait_ready(self, request_id: str, timeout: float | None = None) -> bool:
        """Block until the request's onboard reads landed; False on timeout."""
        done = threading.Event()
        token = self._token
        assert token is not None

        async def waiter() -> None:
            try:
                await self._scheduler.wait_ready(request_id)
            finally:
                done.set()

        def start() -> None:
            trio.lowlevel.spawn_system_task(waiter)

        if self.is_ready(request_id):
            return True
        token.run_sync_soon(start)
        return done.wait(timeout) and (
            not self._scheduler.has_request(request_id) or self.is_ready(request_id)
        )

    def close(self, *, drain: bool = True) -> CloseReport | None:
        """Drain (or drop) disk work in flight, stop every thread; idempotent."""
        if self._thread.is_alive():
            self._drain = drain
            token, stop = self._token, self._stop
            if token is not None and stop is not None:
                with suppress(trio.RunFinishedError):
                    token.run_sync_soon(stop.set)
            self._thread.join()
        self._raise_if_failed()
        return self.close_report

    def __enter__(self) -> BlockingCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(drain=exc is None)
