"""The scheduler actor: owns the core, turns its commands into work, feeds completions back.

Who runs what:

* API calls (add a request, allocate, commit, release...) run on the caller's thread -- the
  serving loop's -- under the scheduler's lock, which is held for microseconds: the core's
  bookkeeping plus *enqueueing* the GPU <-> host copies it asked for, which are stream ordered
  and must be on the copy stream before the caller's next forward pass.  Disk reads and
  writes are only handed over (a deque and a thread-safe wake-up of the trio thread): the
  caller never waits on disk I/O, and never hops threads.
* On the trio thread, the scheduler's tasks move handed-over disk work into the pools: reads
  straight into the reader pool's queue, writes through a feeder task that waits while the
  writer pool's bounded queue is full -- that wait is the backpressure on spills.
* The shared tier (when configured): ``add_request`` first asks the remote fetcher which of
  the keys past the local match the cluster holds (one round trip, outside the lock) and
  hands those to the core; ``FetchBlocks`` run as trio tasks on worker threads and report
  like disk reads; ``PublishBlock`` is offered to the remote publisher at its place in the
  command order (the host page is copied there, after the copy stream's fence when a block
  is queued; the publisher's queue never blocks).
* Completions from the pools come back to the scheduler's completion task, which applies
  them to the core under the same lock.  A request whose onboard reads have not landed stays
  parked (`is_ready` is false, O(1)) until the last one is applied.

The clock: the core never reads one; the scheduler passes wall-clock time made monotonic
(retention deadlines must mean the same thing after a restart, and must never run
backwards within one process).  Tensor-parallel ranks may inject a shared clock instead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import attrs
import torch
import trio

from io_actors.actors.foreground import Foreground, ForegroundStatistics
from io_actors.actors.reader_pool import ReaderPool, ReadJob, SlotReader
from io_actors.actors.worker_threads import PoolStatistics
from io_actors.actors.writer_pool import SlotWriter, WriteJob, WriterPool
from io_actors.memory.pools import KVPools
from io_actors.storage.interfaces import CopyEngine, Fence, RetentionStore, SlotStore
from io_actors.storage.posix import SlotStoreStatistics
from io_actors.storage.posix_open import Recovery
from io_actors.storage.retention_journal import RetentionRecord
from io_actors.tracing.recorder import TraceRecorder
from statekv.config import CacheConfig
from statekv.errors import InvariantViolation, TransferFailed, UsageError
from statekv.ids import BlockHash, PageId, RequestId, SlotId, TransferId
from statekv.lifecycle import BlockState
from statekv.manager import (
    CachedBlock,
    KVCacheManager,
    PrefetchStarted,
    PrefixMatch,
    RequestStatus,
)
from statekv.messages import (
    BatchFinished,
    Completion,
    CopyGpuToHost,
    CopyHostToGpu,
    FetchBlocks,
    FreeSlot,
    PersistRetention,
    PrefetchSlots,
    PublishBlock,
    ReadSlots,
    SlotReadFailed,
    WriteSlots,
    is_read,
    outcomes,
)
from statekv.stats import CacheStatistics

if TYPE_CHECKING:  # the shared tier's actors need the optional redis-py: imported on use
    from io_actors.actors.remote_fetcher import RemoteFetcher
    from io_actors.actors.remote_publisher import PublisherStatistics, RemotePublisher

log = logging.getLogger(__name__)
T = TypeVar("T")


class WallClock:
    """time.time(), never running backwards."""

    def __init__(self) -> None:
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            now = time.time()
            self._last = max(self._last, now)
            return self._last


@attrs.frozen(kw_only=True)
class SystemStatistics:
    """One snapshot of everything: the core's counters and the pools'."""

    cache: CacheStatistics
    writer: PoolStatistics | None
    reader: PoolStatistics | None
    spill_backlog: int
    """Writes handed over but not yet accepted by the writer pool (backpressure).  The one
    the spill feeder is submitting counts as the writer pool's ``queued`` instead: each write
    is in exactly one of ``spill_backlog``, ``writer.queued`` and ``writer.in_flight``."""
    slots_discarded: int
    recovery: Recovery | None = None
    """What the index rebuild at open found on disk: restored slots, and the slots it
    reclaimed by reason (never served).  None without a disk tier."""
    store: SlotStoreStatistics | None = None
    """The slot store's counters (MAC failures among them), when the store keeps them."""
    retention_backlog: int = 0
    """Lengthened deadlines taken from the core (PersistRetention) whose journal append has
    not returned yet."""
    publisher: PublisherStatistics | None = None
    """The shared tier's publisher: offers by outcome, published, failed, queued (None
    without a shared tier)."""
    fetcher: dict[str, int] | None = None
    """The shared tier's fetcher: lookups, blocks found, fetched, failed by status."""
    foreground: ForegroundStatistics | None = None
    """How often the serving thread held the foreground and the cache's threads waited
    their turn (io_actors.actors.foreground)."""


@attrs.frozen(kw_only=True)
class RemoteTier:
    """The shared tier's actors and the pages they read and fill."""

    publisher: RemotePublisher
    fetcher: RemoteFetcher
    host_page: Callable[[PageId], torch.Tensor]
    gpu_page: Callable[[PageId], torch.Tensor]


@attrs.frozen(kw_only=True)
class CloseReport:
    """What closing the cache did with the work in flight."""

    drained: bool
    """Whether in-flight transfers were allowed to finish."""
    writes_dropped: int
    """Block spills queued but not started when the cache closed (their content was not
    kept); every CloseReport count is in block transfers, not batches."""
    reads_dropped: int
    writes_finished_during_close: int
    reads_finished_during_close: int
    retained_written: int = 0
    """Released blocks whose TTL was running and that the close wrote to disk (they were on
    GPU or host only): a restart finds them."""
    retained_not_written: int = 0
    """Released blocks whose TTL was running, on GPU or host only, that the close could not
    start writing (no slot they may take: protect_unexpired with a disk full of live
    deadlines; or the timeout): a restart does not find them.  A write that fails during the
    close is logged and counted in spill_failures."""


class InlineIO:
    """Disk reads and writes run on the caller's thread, inside the cache call.

    This is the naive design the benchmarks compare against (the serving loop's step waits
    for every disk transfer it causes); production uses the pools.  Executors are made on
    first use, on the calling thread, which then owns their staging buffer and stream.
    """

    def __init__(self, store: SlotStore, pools: KVPools, device: torch.device) -> None:
        self._store = store
        self._pools = pools
        self._device = device
        self._writer: SlotWriter | None = None
        self._reader: SlotReader | None = None
        self.measured: Callable[[int, float], None] | None = None
        """Where reads report their rate (set by the scheduler: the core, under its lock)."""

    def execute(self, job: WriteJob | ReadJob) -> Completion:
        if isinstance(job, WriteJob):
            if self._writer is None:
                self._writer = SlotWriter(self._store, self._pools.host_page,
                                          self._pools.host_checksums)
            return self._writer.execute(job)
        if self._reader is None:
            self._reader = SlotReader(self._store, self._pools.gpu_page,
                                      self._pools.new_staging_buffer, self._device,
                                      self._pools.config.max_batch_blocks,
                                      host_page=self._pools.host_page,
                                      checksums=self._pools.host_checksums,
                                      measured=self.measured)
        return self._reader.execute(job)


class Scheduler:
    """The actor that owns a KVCacheManager."""

    recovery: Recovery | None = None
    """Set by whoever opened the store and restored the core from it (io_actors.embed)."""

    completion_filter: Callable[[Completion], Completion] | None = None
    """Maps every completion the pools report before it is applied (None: as reported).
    Tensor-parallel ranks set it (io_actors.tensor_parallel.agreement): a transfer that
    failed on another rank must be applied as failed on this one too, or the ranks' caches
    would diverge."""

    def __init__(
        self,
        core: KVCacheManager,
        copies: CopyEngine,
        store: SlotStore | None,
        *,
        clock: Callable[[], float] | None = None,
        inline_io: InlineIO | None = None,
        recorder: TraceRecorder | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        self._core = core
        self._remote = remote
        self._fetch_handover: collections.deque[tuple[FetchBlocks, Fence | None]] = (
            collections.deque()
        )
        self._fetches_busy = 0
        """FetchBlocks handed over whose completion was not sent yet."""
        self._nursery: trio.Nursery | None = None
        self._inline = inline_io
        self._copies = copies
        self._store = store
        self._clock: Callable[[], float] = clock or WallClock()
        self._lock = threading.Lock()
        self.foreground = Foreground()
        """Held by the serving thread while it works; the trio thread and the pools' threads
        wait their turn before their Python (io_actors.actors.foreground)."""
        self._handover: collections.deque[WriteJob | ReadJob] = collections.deque()
        self._spill_backlog: collections.deque[WriteJob] = collections.deque()
        """The backlog's first job while the spill feeder waits in the writer's submit():
        the pool counts it as queued already (see `_backlog`)."""
        self._spill_wakeup = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake_pending = False
        self._slots_in_flight: set[SlotId] = set()
        self._slot_of_transfer: dict[int, SlotId] = {}
        self._ready_waiters: dict[RequestId, list[trio.Event]] = {}
        self._slots_discarded = 0
        self._closed = False
        self._refusing = False
        """Set when close starts: no more calls, while close still writes down retained
        content (the pools run until _closed)."""
        self._writer: WriterPool | None = None
        self._reader: ReaderPool | None = None
        self._completions_send, self._completions_recv = trio.open_memory_channel[Completion](
            float("inf")
        )
        self._all_closed = trio.Event()
        # PersistRetention: records wait here for the retention task, which appends all that
        # accumulated with one call in a worker thread (never on the serving thread).
        self._journal = retention_store(store)
        self._retention: list[RetentionRecord] = []
        self._retention_busy = 0
        self._retention_wakeup = trio.Event()
        # Recording (off when None): every hook below costs one `is None` test without it.
        self._recorder = recorder
        self._parked_traced: set[RequestId] = set()
        if inline_io is not None:
            # Inline reads run inside a cache call, under the lock: report to the core directly.
            # (Looked up per call: a wrapper installed on the core later sees the reports.)
            inline_io.measured = self._report_disk_read_locked

    # ------------------------------------------------------------------ the API (any thread)

    @property
    def core_config(self) -> CacheConfig:
        return self._core.config

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
        remote_keys: tuple[BlockHash, ...] = ()
        if self._remote is not None:
            with self._lock:
                if self._closed:
                    raise UsageError("cache", "the cache is closed")
                candidates = self._core.remote_candidates(token_ids, cache_salt=cache_salt,
                                                          lora_id=lora_id)
            # The lookup is a network round trip: never under the lock.  The core checks
            # the keys again against what it caches by then.
            remote_keys = self._remote.fetcher.lookup(candidates)
        return self._call(lambda now: self._core.add_request(
            request_id, token_ids, now=now, ttl_seconds=ttl_seconds, priority=priority,
            cache_salt=cache_salt, lora_id=lora_id, remote_keys=remote_keys,
        ))

    def prefetch(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> PrefetchStarted:
        return self._call(lambda now: self._core.prefetch(
            request_id, token_ids, now=now, cache_salt=cache_salt, lora_id=lora_id,
        ))

    def _report_disk_read_locked(self, num_bytes: int, seconds: float) -> None:
        self._core.report_disk_read(num_bytes, seconds)

    def report_disk_read(self, num_bytes: int, seconds: float) -> None:
        """A reader thread's measurement of one batch (any thread; the lock is brief)."""
        with self._lock:
            self._core.report_disk_read(num_bytes, seconds)

    def report_prefill(self, num_tokens: int, seconds: float, *, context_tokens: int) -> None:
        with self._lock:
            self._core.report_prefill(num_tokens, seconds, context_tokens=context_tokens)

    def cost_estimates(self) -> tuple[float | None, float | None]:
        with self._lock:
            return self._core.cost_estimates()

    def allocate_nowait(self, request_id: str, num_tokens: int) -> None:
        self._call(lambda now: self._core.allocate_nowait(request_id, num_tokens, now=now))

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        self._call(lambda now: self._core.commit(request_id, num_computed_tokens, now=now))

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._call(lambda _now: self._core.append_tokens(request_id, token_ids))

    def release(self, request_id: str) -> None:
        self._call(lambda now: self._core.release(request_id, now=now))

    def is_ready(self, request_id: str) -> bool:
        with self._lock:
            return self._core.is_ready(request_id)

    def obtainable_gpu_blocks(self) -> int:
        with self._lock:
            return self._core.obtainable_gpu_blocks()

    def prefetch_reads_pending(self, request_id: str) -> int:
        with self._lock:
            return self._core.prefetch_reads_pending(request_id)

    def prefetch_could_start(self) -> bool:
        with self._lock:
            return self._core.prefetch_could_start()

    def disk_reads_in_flight(self) -> int:
        with self._lock:
            return self._core.disk_reads_in_flight()

    def has_request(self, request_id: str) -> bool:
        with self._lock:
            return self._core.has_request(request_id)

    def block_table(self, request_id: str) -> tuple[PageId, ...]:
        with self._lock:
            return self._core.block_table(request_id)

    def request_status(self, request_id: str) -> RequestStatus:
        with self._lock:
            return self._core.request_status(request_id)

    @property
    def orders_passes_by_page(self) -> bool:
        return self._copies.orders_by_page

    def order_forward_after_copies(self, gpu_pages: Iterable[int]) -> None:
        # The copy engine's own lock orders this against every enqueue; the scheduler's is
        # not needed (a page of a ready request gets no new copy while it is used).
        self._copies.wait_for_pages(gpu_pages)

    def statistics(self) -> SystemStatistics:
        with self._lock:
            cache = self._core.statistics()
        return SystemStatistics(
            cache=cache,
            writer=self._writer.statistics() if self._writer else None,
            reader=self._reader.statistics() if self._reader else None,
            spill_backlog=self._backlog(),
            slots_discarded=self._slots_discarded,
            recovery=self.recovery,
            store=self._store_statistics(),
            retention_backlog=self._retention_backlog(),
            publisher=self._remote.publisher.statistics() if self._remote else None,
            fetcher=self._remote.fetcher.statistics() if self._remote else None,
            foreground=self.foreground.statistics(),
        )

    def _retention_backlog(self) -> int:
        with self._lock:
            return len(self._retention) + self._retention_busy

    def _store_statistics(self) -> SlotStoreStatistics | None:
        read = getattr(self._store, "statistics", None)
        if read is None:
            return None
        found = read()
        if isinstance(found, SlotStoreStatistics):
            return found
        inner = getattr(self._store, "inner", None)  # a wrapper (fault injection)
        read = getattr(inner, "statistics", None)
        found = read() if read is not None else None
        return found if isinstance(found, SlotStoreStatistics) else None

    def check_invariants(self) -> None:
        with self._lock:
            try:
                self._core.check_invariants()
                self.check_own_invariants_locked()
            except InvariantViolation as exc:
                if self._recorder is not None:
                    self._trace_invariant_locked(exc)
                raise

    def check_own_invariants_locked(self) -> None:
        """The scheduler's own counters agree with the core (the fields its threads share
        change only under the lock: a lost update shows up here)."""
        busy, handed = self._fetches_busy, len(self._fetch_handover)
        in_flight = self._core.statistics().fetches_in_flight
        # Each busy batch holds at least one block the core has in flight.
        if not handed <= busy <= in_flight:
            raise InvariantViolation(
                f"fetch batches: {handed} handed over, {busy} busy, {in_flight} blocks in "
                "flight in the core (want handed <= busy <= in flight)"
            )
        if self._retention_busy < 0 or self._slots_discarded < 0:
            raise InvariantViolation(
                f"negative counter: retention busy {self._retention_busy}, "
                f"slots discarded {self._slots_discarded}"
            )
        if len(self._slot_of_transfer) != len(self._slots_in_flight):
            raise InvariantViolation(
                f"{len(self._slot_of_transfer)} disk transfers in flight on "
                f"{len(self._slots_in_flight)} slots"
            )

    def transfers_in_flight(self) -> tuple[TransferId, ...]:
        """Disk transfers dispatched whose completion is not applied yet, oldest first."""
        with self._lock:
            return tuple(TransferId(t) for t in sorted(self._slot_of_transfer))

    def cached_blocks(self) -> tuple[CachedBlock, ...]:
        """Every block of the prefix index with its tier (KVCacheManager.cached_blocks)."""
        with self._lock:
            return self._core.cached_blocks()

    async def wait_ready(self, request_id: str) -> None:
        """Wait (trio thread) until the request's onboard reads have all landed, or it is gone.

        A request released on another thread after the caller saw it parked (the blocking
        facade checks `is_ready` on its own thread, then hands the wait over here) is gone
        by the time this runs: that is an answer (the async API's contract: ready, failed
        and rewound, or gone), never an error -- this runs in a trio system task, where an
        exception would kill the actor and with it the cache.
        """
        event = trio.Event()
        with self._lock:
            if self._settled_locked(request_id):
                return
            self._ready_waiters.setdefault(RequestId(request_id), []).append(event)
        await event.wait()

    def _call(self, op: Callable[[float], T]) -> T:
        with self._lock:
            if self._closed or self._refusing:
                raise UsageError("cache", "the cache is closed")
            try:
                result = op(self._clock())
                if self._recorder is not None:
                    self._trace_parks_locked(result)
                self._dispatch_locked()
            except InvariantViolation as exc:
                if self._recorder is not None:
                    self._trace_invariant_locked(exc)
                raise
            # A release lets go of a parked request: its waiters must not wait for a read
            # that may never be reported (the trio thread sets them; any thread may call).
            woken = self._waiters_to_wake_locked(None) if self._ready_waiters else []
        token = self._token
        if woken and token is not None:
            for event in woken:
                token.run_sync_soon(event.set)
        return result

    def _waiters_to_wake_locked(self, completion: Completion | None) -> list[trio.Event]:
        """Take the waiters of every request that is ready or gone (after `completion`, or
        after an API call when None): each is woken exactly once."""
        del completion  # any read completion, failed or not, and any call may let one go
        woken: list[trio.Event] = []
        for rid in list(self._ready_waiters):
            if self._settled_locked(rid):
                woken += self._ready_waiters.pop(rid)
        return woken

    def _settled_locked(self, request_id: str) -> bool:
        """What a waiter waits for: the request is ready, or gone (released)."""
        core = self._core
        return not core.has_request(request_id) or core.is_ready(request_id)

    def _trace_parks_locked(self, result: object) -> None:
        """Recording: the request this call parked, and those parked that it let go."""
        recorder = self._recorder
        assert recorder is not None
        parks = isinstance(result, PrefixMatch) and not result.ready
        if not parks and not self._parked_traced:
            return
        now = self._clock()
        if isinstance(result, PrefixMatch) and parks:
            self._parked_traced.add(result.request_id)
            recorder.park(now, result.request_id,
                          detail=f"{result.disk_tokens} tokens read back from disk, "
                                 f"{result.remote_tokens} fetched from the shared tier")
        core = self._core
        for rid in [r for r in self._parked_traced
                    if not core.has_request(r) or core.is_ready(r)]:
            self._parked_traced.discard(rid)
            recorder.unpark(now, rid, detail=None if core.has_request(rid)
                            else "released while parked")

    def _trace_invariant_locked(self, exc: InvariantViolation) -> None:
        assert self._recorder is not None
        block = getattr(exc, "block", None)
        self._recorder.invariant_failed(str(exc), actor="scheduler", time=self._clock(),
                                        block=block if isinstance(block, int) else None)

    # ------------------------------------------------------------------ commands

    def _dispatch_locked(self) -> None:
        """Execute copies now (enqueue on the copy stream); hand disk work to the trio side.

        With inline I/O, the completions applied may issue more work (a write-through retried
        as a write completes), executed here too: in a loop, not by recursion, since with a
        disk that fails every write each completion issues the next write."""
        while self._dispatch_once_locked():
            pass

    def _dispatch_once_locked(self) -> bool:
        """One round of _dispatch_locked; True if inline completions were applied (their
        reactions may be new commands)."""
        commands = self._core.take_commands()
        if not commands:
            return False
        if self._recorder is not None:
            self._recorder.commands(self._clock(), commands)
        copies = self._copies
        copied = False
        fence = None
        inline: list[WriteJob | ReadJob] = []
        retention: list[RetentionRecord] = []
        # The copies go to the copy engine as one call, in order: runs of one direction
        # each (an admission that recalls host blocks into the pages it evicts alternates
        # directions at every block; one call per run cost the serving thread a stream wait,
        # an event and a checksum launch per page).  A FreeSlot between copies is no reason
        # to flush them (it touches no page); any other command is, since its fence must
        # come after them.
        runs: list[tuple[bool, list[tuple[PageId, PageId]]]] = []
        for cmd in commands:
            if isinstance(cmd, CopyGpuToHost | CopyHostToGpu):
                to_gpu = isinstance(cmd, CopyHostToGpu)
                if not runs or runs[-1][0] != to_gpu:
                    runs.append((to_gpu, []))
                runs[-1][1].append((cmd.host_page, cmd.gpu_page) if to_gpu
                                   else (cmd.gpu_page, cmd.host_page))
                copied = True
                fence = None
                continue
            if runs and not isinstance(cmd, FreeSlot):
                copies.copy_runs(runs)
                runs = []
            if isinstance(cmd, WriteSlots | ReadSlots | PrefetchSlots):
                for item in cmd.writes if isinstance(cmd, WriteSlots) else cmd.reads:
                    if item.slot in self._slots_in_flight:
                        raise InvariantViolation(
                            f"slot {item.slot} has a transfer in flight already"
                        )
                    self._slots_in_flight.add(item.slot)
                    self._slot_of_transfer[item.transfer] = item.slot
                if isinstance(cmd, WriteSlots):
                    # A write reads its host pages only: it waits for the copies into them,
                    # not for the rest of the round's (an eviction's batch to host, queued
                    # ahead of it, would hold the first write back by its whole length).
                    job: WriteJob | ReadJob = WriteJob(cmd, copies.fence_for_host_pages(
                        [write.host_page for write in cmd.writes]))
                else:
                    if fence is None:
                        fence = copies.fence()
                    job = ReadJob(cmd, fence)
                if self._inline is not None:
                    inline.append(job)
                else:
                    self._handover.append(job)
            elif isinstance(cmd, FreeSlot):
                # A hint only (see SlotStore.discard): never I/O on this path, and ordered
                # before any later write to the slot because it runs right here.
                if self._store is not None:
                    self._store.discard(cmd.slot)
                self._slots_discarded += 1
            elif isinstance(cmd, PersistRetention):
                retention.append(RetentionRecord(slot=cmd.slot, key=cmd.key, expiry=cmd.expiry))
            elif isinstance(cmd, PublishBlock):
                if fence is None:
                    fence = copies.fence()
                self._offer_publish_locked(cmd, fence)
            elif isinstance(cmd, FetchBlocks):
                if fence is None:
                    fence = copies.fence()
                self._fetch_handover.append((cmd, fence))
                self._fetches_busy += 1
        if runs:
            copies.copy_runs(runs)
        if copied:
            copies.order_before_compute()
        journal = self._journal
        if retention and journal is not None:
            if self._inline is not None:
                append_retention(journal, retention)  # the naive design: right here
            else:
                self._retention += retention
        if inline:
            assert self._inline is not None
            for job in inline:
                completion = self._inline.execute(job)
                for outcome in outcomes(completion):
                    self._slots_in_flight.discard(self._slot_of_transfer.pop(outcome.transfer))
                if self._recorder is not None:
                    self._recorder.completion(self._clock(), completion)
                self._core.handle(completion, now=self._clock())
                if self._recorder is not None:
                    self._trace_parks_locked(None)
        # What this round queued for the trio thread -- a shared-tier fetch issued with the
        # synchronous spill -- needs the wake-up whether or not another round follows.
        if ((self._handover or self._retention or self._fetch_handover)
                and not self._wake_pending and self._token is not None):
            self._wake_pending = True
            self._token.run_sync_soon(self._pump)
        return bool(inline)

    def _offer_publish_locked(self, cmd: PublishBlock, fence: Fence) -> None:
        remote = self._remote
        if remote is None:
            raise InvariantViolation("the core published with no shared tier attached")

        def page() -> torch.Tensor:
            # The page was filled by a copy just enqueued: wait for it (only for a block
            # the publisher queues), then the publisher copies it before this call returns.
            fence.wait()
            return remote.host_page(cmd.host_page)

        remote.publisher.offer(cmd, page, now=self._clock(), wall_now=time.time())

    async def _run_fetch(self, cmd: FetchBlocks, fence: Fence | None) -> None:
        """Trio task: one FetchBlocks on a worker thread; its completion goes to the core."""
        remote = self._remote
        assert remote is not None
        try:
            try:
                fetched = await trio.to_thread.run_sync(
                    remote.fetcher.fetch, cmd.reads, remote.gpu_page, fence
                )
            except Exception as exc:
                log.warning("fetch batch %s failed: %s", cmd.transfer, exc)
                completion: Completion = BatchFinished(outcomes=tuple(
                    SlotReadFailed(transfer=r.transfer, cause=f"{type(exc).__name__}: {exc}")
                    for r in cmd.reads
                ))
            else:
                completion = fetched.completion
                if fetched.landed_bytes and fetched.seconds > 0:
                    with self._lock:
                        self._core.report_fetch(fetched.landed_bytes, fetched.seconds)
        finally:
            # Shared with the API threads: changed under the lock, like every such field.
            # Before the report: no checkpoint lies between the two (the channel is
            # unbounded), so close() never sees the batch neither busy nor reported, and
            # the busy count never exceeds the core's fetches in flight.
            with self._lock:
                self._fetches_busy -= 1
        await self.report_completion(completion)

    def _pump(self) -> None:
        """Trio thread: move handed-over disk work into the pools."""
        self.foreground.wait_turn()  # blocks the trio thread, holding nothing: bounded
        with self._lock:
            self._wake_pending = False
            jobs = list(self._handover)
            self._handover.clear()
            fetches = list(self._fetch_handover)
            self._fetch_handover.clear()
            if self._retention:
                self._retention_wakeup.set()
        if fetches:
            assert self._nursery is not None
            for cmd, fence in fetches:
                self._nursery.start_soon(self._run_fetch, cmd, fence)
        for job in jobs:
            if isinstance(job, WriteJob):
                self._spill_backlog.append(job)
                self._spill_wakeup.set()
            else:
                assert self._reader is not None
                # The reader queue holds as many jobs as there are GPU and host pages (each job
                # fills at least one page): never full.
                self._reader.submit_nowait(job)

    def _backlog(self) -> int:
        """Spills handed over that the writer pool has not counted yet."""
        return len(self._spill_backlog)

    async def _feed_spills(self) -> None:
        """Trio task: move spills into the writer queue, waiting while it is full."""
        writer = self._writer
        assert writer is not None
        while True:
            while self._spill_backlog:
                # Taken off the backlog before the hand-over, not after: once submit() has
                # put the job in the queue, a worker may start it before this task runs
                # again, and a close in between would count it dropped (from the backlog)
                # and landed (from the thread) at once.  From the start of submit() the pool
                # counts it as queued, and a close that drops the queue finds it there.
                job = self._spill_backlog.popleft()
                try:
                    await writer.submit(job)
                except trio.ClosedResourceError:
                    # Handed over after close() counted the backlog: back into it, where
                    # close() counts what is left once the threads are done.
                    self._spill_backlog.appendleft(job)
                    return
            if self._closed and not self._handover:
                return
            self._spill_wakeup = trio.Event()
            await self._spill_wakeup.wait()

    async def _feed_retention(self, store: RetentionStore) -> None:
        """Trio task: append the lengthened deadlines, all that accumulated in one call, in a
        worker thread; until closed and every record taken (drained or dropped)."""
        while True:
            with self._lock:
                records, self._retention = self._retention, []
                self._retention_busy = len(records)
            if records:
                await trio.to_thread.run_sync(append_retention, store, records)
                with self._lock:
                    self._retention_busy = 0
                continue
            if self._closed:
                return
            self._retention_wakeup = trio.Event()
            await self._retention_wakeup.wait()

    async def report_completion(self, completion: Completion) -> None:
        """Called by the pools (trio thread) for every completion."""
        if self.completion_filter is not None:
            completion = self.completion_filter(completion)
        await self._completions_send.send(completion)

    async def _apply_completions(self) -> None:
        async for completion in self._completions_recv:
            self.foreground.wait_turn()  # blocks the trio thread, holding nothing: bounded
            with self._lock:
                for outcome in outcomes(completion):
                    # A fetch has no slot.
                    slot = self._slot_of_transfer.pop(outcome.transfer, None)
                    if slot is not None:
                        self._slots_in_flight.discard(slot)
                if self._recorder is not None:
                    self._recorder.completion(self._clock(), completion)
                self._core.handle(completion, now=self._clock())
                if self._recorder is not None:
                    self._trace_parks_locked(None)
                self._dispatch_locked()
                woken: list[trio.Event] = []
                if self._ready_waiters and is_read(completion):
                    woken = self._waiters_to_wake_locked(completion)
            for event in woken:
                event.set()

    # ------------------------------------------------------------------ life

    async def run(
        self,
        writer: WriterPool | None,
        reader: ReaderPool | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Host the pools and the scheduler's tasks until `close` has finished."""
        self._writer, self._reader = writer, reader
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._apply_completions)
            if self._remote is not None:
                nursery.start_soon(self._remote.publisher.run)
            if writer is not None:
                await nursery.start(writer.run)
                nursery.start_soon(self._feed_spills)
            if reader is not None:
                await nursery.start(reader.run)
            if self._journal is not None and self._inline is None:
                nursery.start_soon(self._feed_retention, self._journal)
            task_status.started()
            await self._all_closed.wait()
            self._completions_send.close()

    async def close(self, *, drain: bool = True, timeout: float = 30.0) -> CloseReport:
        """Stop taking calls; with `drain`, write down what a TTL promised to keep and drain
        the disk work, else drop it; stop the pools' threads."""
        retained_left = 0
        with self._lock:
            self._refusing = True
            self._core.stop_write_through_retries()
            spills_before = self._core.statistics().spills
        if drain and self._writer is not None:
            with trio.move_on_after(timeout):
                retained_left = await self._flush_retained()
        with self._lock:
            retained_written = self._core.statistics().spills - spills_before
        with self._lock:
            self._closed = True
        self._pump()
        writes_dropped = reads_dropped = 0
        # Counted in block transfers, as the core counts them (a job is a batch of them).
        with self._lock:
            in_flight = self._core.statistics()
        busy_writes = in_flight.writes_in_flight
        busy_reads = in_flight.reads_in_flight + in_flight.prefetch_reads_in_flight
        if drain:
            with trio.move_on_after(timeout):
                while (self._spill_backlog or (self._writer and self._writer.busy)
                       or (self._reader and self._reader.busy) or self._retention_backlog()):
                    await trio.sleep(0.001)
        with self._lock:
            retention_dropped = len(self._retention)
            self._retention.clear()
        self._retention_wakeup.set()
        self._spill_wakeup.set()
        if self._writer is not None:
            dropped = self._writer.close_queue(drop_queued=True)
            writes_dropped += sum(len(job.command.writes) for job in dropped)
            # No job is in both: the feeder takes a job off the backlog before submitting it.
            writes_dropped += sum(len(job.command.writes) for job in self._spill_backlog)
        self._spill_backlog.clear()
        if self._reader is not None:
            reads_dropped += sum(
                len(job.command.reads) for job in self._reader.close_queue(drop_queued=True)
            )
        # Jobs already in a thread cannot be abandoned (the thread owns the buffers): wait.
        # A fetch in flight is bounded by the store's timeout, so this never hangs.
        while ((self._writer and self._writer.busy) or (self._reader and self._reader.busy)
               or self._fetches_busy):
            await trio.sleep(0.001)
        # A spill handed over after the count above (the feeder found the queue closed).
        writes_dropped += sum(len(job.command.writes) for job in self._spill_backlog)
        self._spill_backlog.clear()
        if self._remote is not None:
            publisher = self._remote.publisher
            if not drain:
                shed = publisher.discard_queued()
                if shed:
                    log.warning("closed with %d publishes to the shared tier dropped", shed)
            publisher.close()
        if drain and self._writer is not None:
            # Counted again after the drain: a write the close issued may have failed.  The
            # threads are done; their completions may still be on the way to the core.
            with trio.move_on_after(timeout):
                while True:
                    with self._lock:
                        if self._core.statistics().writes_in_flight <= writes_dropped:
                            break
                    await trio.sleep(0.001)
            with self._lock:
                retained_left = _retained_unwritten(self._core, self._clock())
        self._all_closed.set()
        if writes_dropped or reads_dropped:
            log.warning("closed with %d spills and %d onboards dropped", writes_dropped,
                        reads_dropped)
        if retention_dropped:
            log.warning("closed with %d lengthened deadlines not journaled (a restart keeps "
                        "the earlier ones)", retention_dropped)
        return CloseReport(
            drained=drain and not writes_dropped and not reads_dropped,
            writes_dropped=writes_dropped,
            reads_dropped=reads_dropped,
            writes_finished_during_close=busy_writes - writes_dropped,
            reads_finished_during_close=busy_reads - reads_dropped,
            retained_written=retained_written,
            retained_not_written=retained_left,
        )

    async def _flush_retained(self) -> int:
        """Write down released content under a running TTL that is on no disk yet (the
        core's flush_retained), round after round as writes land and give host pages back;
        returns how many such blocks are left when no more progress can be made."""
        while True:
            with self._lock:
                left, moved = self._core.flush_retained(now=self._clock())
                self._dispatch_locked()
                writing = self._core.statistics().writes_in_flight
            self._pump()
            if moved:
                continue
            if left == 0 or not writing:
                if left:
                    log.warning("closing with %d retained blocks not written to disk (a "
                                "restart will not find them)", left)
                return left
            await trio.sleep(0.001)



def _retained_unwritten(core: KVCacheManager, now: float) -> int:
    """Released blocks under a running TTL that are on GPU or host with no disk copy."""
    return sum(1 for b in core.cached_blocks()
               if b.state in (BlockState.RELEASED, BlockState.ON_HOST) and not b.has_disk_copy
               and b.expiry is not None and b.expiry > now)


def append_retention(store: RetentionStore, records: list[RetentionRecord]) -> None:
    """Journal lengthened deadlines; a failure leaves them in memory only (logged; the store
    counts it), never fails the cache: the block is still served, its restart deadline is the
    one its slot header holds."""
    try:
        store.persist_retention(records)
    except TransferFailed as exc:
        log.warning("%d lengthened deadlines not journaled: %s", len(records), exc)


def retention_store(store: object) -> RetentionStore | None:
    """`store` where it keeps a retention journal; None where lengthened deadlines stay in
    memory (a store without one keeps each block's spill-time deadline across restarts)."""
    return store if isinstance(store, RetentionStore) else None
