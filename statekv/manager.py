"""The cache manager: the API a serving loop calls (through the actors), with no I/O.

The manager decides; actors do.  Every call takes the caller's clock as ``now`` (the core never
reads a clock), changes blocks only through the lifecycle table, and leaves work for the
actors in an outbox (:meth:`KVCacheManager.take_commands`).  Actors report back with
:meth:`KVCacheManager.handle`.

Step protocol of a serving loop::

    match = cache.add_request(rid, prompt, now=t, ttl_seconds=600)   # prefix hit by tier
    ...execute cache.take_commands()...                              # copies, reads
    if cache.is_ready(rid):                                          # O(1); else parked
        cache.allocate_nowait(rid, num_tokens, now=t)                # pages for new tokens
        table = cache.block_table(rid)                               # for attention
        ...forward pass writes KV for tokens [computed, num_tokens)...
        cache.commit(rid, num_tokens, now=t)                         # full blocks shared
    cache.append_tokens(rid, [sampled])                              # decode
    cache.release(rid, now=t)                                        # finish or cancel

A request still waiting for admission may ask for its disk blocks ahead of time with
``cache.prefetch(rid, prompt, now=t)``: they are read into host pages, so that its
``add_request`` finds host hits.  ``add_request`` takes the prefetch over; ``release(rid)``
of a request that never got admitted gives its prefetched pages back.

Cost-aware onboarding: the actors report disk reads (``report_disk_read``) and the serving
loop reports prefills (``report_prefill``); with both estimates, ``add_request`` recomputes a
run of disk hits instead of reading it when that is faster (``statekv.cost``).

The shared tier (``CacheConfig.shared_tier``, specs/remote_tier.md): the core does no lookup
of its own.  ``remote_candidates`` names the keys of a prompt past the local match; the remote
fetcher actor asks the cluster which of them it holds and passes those to
``add_request(..., remote_keys=...)``, which fetches the leading run of them into GPU pages
(FETCHING; the request is parked as for a disk read), unless recomputing is faster (the
fetcher reports its rate with ``report_fetch``).  Host offloads of admitted content are
offered for publishing (``PublishBlock``).

Every public method validates its arguments before it changes anything, so a call that
raises leaves the cache exactly as it was.

The manager is the facade: it validates, keeps the step protocol and composes the concerns,
each an object that owns its data (none shares the manager's ``self``):

* :mod:`statekv.records` -- the block records, their states and the transition calls;
* :mod:`statekv.prefix_index` -- chained key -> cached block, and matching;
* :mod:`statekv.requests` -- the admitted requests and the parked gauge;
* :mod:`statekv.eviction` -- GPU and host pages, their eviction orders, the cascade;
* :mod:`statekv.disk_tier` -- disk slots, spills, displacement and retention;
* :mod:`statekv.onboarding` -- reads, prefetches, fetches and the cost gate;
* :mod:`statekv.outbox` -- the commands waiting for the actors, packed into batches;
* :mod:`statekv.stats` -- the counters and the statistics snapshot;
* :mod:`statekv.invariants` -- the structural checks across all of them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

from statekv.arith import blocks_for_tokens, expiry_after, full_blocks
from statekv.config import CacheConfig, check_now, check_ttl_seconds
from statekv.cost import check_count, check_measurement
from statekv.disk_tier import DiskTier, RestoredBlock
from statekv.errors import OutOfBlocks, UsageError
from statekv.eviction import Eviction
from statekv.hashing import DIGEST_SIZE, token_bytes
from statekv.ids import BlockHash, PageId, RequestId
from statekv.invariants import check_invariants
from statekv.lifecycle import COPY_STATES, BlockEvent, BlockState
from statekv.messages import (
    BatchFinished,
    Command,
    Completion,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
)
from statekv.onboarding import Onboarding
from statekv.outbox import Outbox
from statekv.policies import Policies
from statekv.pools import HostPagePool, PagePool
from statekv.prefix_index import PrefixIndex
from statekv.records import BlockRecords
from statekv.requests import QueuedRecord, RequestTable
from statekv.stats import CacheStatistics, Counters, snapshot
from statekv.trace import TraceSink

__all__ = [
    "CachedBlock",
    "KVCacheManager",
    "PrefetchStarted",
    "PrefixMatch",
    "RequestStatus",
    "RestoredBlock",
]

_S = BlockState
_E = BlockEvent


@attrs.frozen(kw_only=True)
class PrefixMatch:
    """What add_request found in the cache for a new request."""

    request_id: RequestId
    num_prompt_tokens: int
    matched_tokens: int
    """Prompt tokens whose KV comes from the cache (a multiple of the block size)."""
    gpu_tokens: int
    host_tokens: int
    disk_tokens: int
    """Tokens being read back from disk; the request is parked until they land."""
    ready: bool
    skipped_disk_tokens: int = 0
    """Tokens on disk not read back because recomputing them is faster (cost-aware
    onboarding): the match ends where they start, and the request computes them."""
    remote_tokens: int = 0
    """Tokens being fetched from the shared tier; the request is parked until they land."""
    skipped_remote_tokens: int = 0
    """Tokens the shared tier holds that are recomputed instead (cheaper, or after a cut)."""


@attrs.frozen(kw_only=True)
class PrefetchStarted:
    """What prefetch found for a queued request."""

    request_id: RequestId
    started_tokens: int
    """Tokens whose disk -> host read this call issued."""
    shared_tokens: int
    """Tokens already being prefetched (or prefetched) for another queued request, or by an
    earlier call for this one."""
    cached_tokens: int
    """Tokens of the matched prefix already on GPU or host (or being onboarded)."""
    unfetched_tokens: int
    """Disk tokens of the matched prefix left on disk: no host page could be had."""


@attrs.frozen(kw_only=True)
class RequestStatus:
    """Where one request stands."""

    request_id: RequestId
    num_tokens: int
    num_computed_tokens: int
    """Tokens whose KV is in the request's blocks (matched or computed and committed)."""
    num_blocks: int
    pending_reads: int
    ready: bool


@attrs.frozen(kw_only=True)
class CachedBlock:
    """One cached block as seen from outside: its key, tier and retention."""

    key: BlockHash
    state: BlockState
    ref_count: int
    reuse_count: int
    expiry: float | None
    depth: int
    priority: int
    has_disk_copy: bool = False
    """On GPU or host and also in a disk slot (a valid copy: evicting it writes nothing)."""
    has_host_copy: bool = False
    """On GPU and also in a host page (a host copy: evicting it to host copies nothing)."""


class KVCacheManager:
    """Tiered KV cache bookkeeping for one rank: GPU, pinned host and disk, sans I/O."""

    def __init__(self, config: CacheConfig, *, trace: TraceSink | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise UsageError("config", f"must be a CacheConfig, got {config!r}")
        self.config = config
        self._block_size = config.block_size
        policies = Policies.from_config(config)
        nrecords = (
            config.gpu_blocks + config.host_blocks + config.reserved_host_blocks
            + config.disk_blocks
        )
        self._gpu = PagePool(config.gpu_blocks, config.priority_levels)
        self._host = HostPagePool(
            config.host_blocks, config.reserved_host_blocks, config.priority_levels
        )
        self._has_disk = config.disk_blocks > 0
        self._shared = config.shared_tier
        self._write_through = config.retention_write_through and config.disk_blocks > 0
        self._retry_write_throughs = True
        """Cleared at a close (stop_write_through_retries)."""
        self._publish_on_release = config.shared_tier and config.publish_on == "release"
        self._counters = counters = Counters()
        self._outbox = outbox = Outbox()
        self._index = index = PrefixIndex(config.block_size)
        self._requests = requests = RequestTable(config)
        self._records = records = BlockRecords(nrecords, index, self._gpu, self._host, trace)
        self._disk = disk = DiskTier(config, policies, records, index, self._host, outbox,
                                     counters)
        self._eviction = eviction = Eviction(config, policies, records, self._gpu, self._host,
                                             disk, outbox, counters)
        self._onboarding = Onboarding(config, records, index, requests, eviction, disk, outbox,
                                      counters)

    # ------------------------------------------------------------------ the public API

    def add_request(
        self,
        request_id: RequestId | str,
        token_ids: Sequence[int],
        *,
        now: float,
        ttl_seconds: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        remote_keys: Collection[BlockHash] = (),
    ) -> PrefixMatch:
        """Register a request and take the longest cached prefix of its prompt.

        Matched blocks on GPU are shared at once; host blocks are copied back; disk blocks
        are read back asynchronously and the request is parked until they land.  Past the
        local match, the leading blocks whose keys are in `remote_keys` (what the shared tier
        was found to hold) are fetched the same way.  Raises OutOfBlocks (changing nothing)
        when the GPU cannot hold the blocks to onboard.
        """
        records = self._records
        now = check_now(now, records.now)
        requests = self._requests
        rid = requests.check_new_id(request_id)
        ttl = self._check_ttl(ttl_seconds)
        self._check_priority(priority)
        remote_set = self._check_remote_keys(remote_keys)
        onboarding = self._onboarding
        # A queued request that prefetched is admitted with the same prompt tuple: its
        # prefetch's checks, encoding and keys hold (a 5k-token prompt's were a sixth of the
        # serving thread's cache-call time before a pass, py-spy on an H100).
        known = onboarding.queued_records.get(rid)
        if known is not None and known.same_call(token_ids, cache_salt, lora_id):
            req = requests.from_queued(known.request, ttl, priority)
        else:
            req = requests.new_record(rid, token_ids, cache_salt, lora_id, ttl, priority)
        matched = self._index.lookup(req)
        remote = self._index.remote_run(req, len(matched), remote_set)
        matched, skipped, remote, skipped_remote = onboarding.cost_cut(req, matched, remote)
        # Capacity: every matched block that is not already on GPU needs a GPU page.
        needs_page = remote
        released_hits = 0
        released, on_gpu = _S.RELEASED, _S.ON_GPU  # locals: once per matched block
        for block in matched:
            state = block.state
            if state is released:
                released_hits += 1
            elif state is not on_gpu and state is not _S.ONBOARDING and (
                state is not _S.FETCHING
            ):
                needs_page += 1
        obtainable = self._gpu.obtainable() - released_hits
        if needs_page > obtainable:
            raise OutOfBlocks(rid, needs_page, obtainable)

        self._advance(now)
        records.cause = rid
        try:
            gpu, host, disk = onboarding.take_matched(req, matched, remote)
            if rid in onboarding.queued:
                onboarding.end_prefetch(rid, now)
        finally:
            records.cause = None
        requests.live[rid] = req
        c = self._counters
        c.requests_added += 1
        c.prefix_cache_queries += req.num_tokens
        c.onboards_skipped_as_too_slow += skipped
        c.fetches_skipped_as_too_slow += skipped_remote
        if req.pending:
            c.requests_parked += 1
            requests.parked += 1
        bs = self._block_size
        return PrefixMatch(
            request_id=rid, num_prompt_tokens=req.num_tokens,
            matched_tokens=(len(matched) + remote) * bs, gpu_tokens=gpu * bs,
            host_tokens=host * bs, disk_tokens=disk * bs, ready=req.pending == 0,
            skipped_disk_tokens=skipped * bs, remote_tokens=remote * bs,
            skipped_remote_tokens=skipped_remote * bs,
        )

    def remote_candidates(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> tuple[BlockHash, ...]:
        """The chained keys of the prompt's matchable blocks past its local match, in order:
        what to look up in the shared tier before ``add_request``.  Changes nothing."""
        if not self._shared:
            raise UsageError("shared_tier", "the cache has no shared tier configured")
        req = self._requests.new_record(RequestId("?"), token_ids, cache_salt, lora_id, None, 0)
        matched = self._index.lookup(req)
        return tuple(req.keys[len(matched):])

    def prefetch(
        self,
        request_id: RequestId | str,
        token_ids: Sequence[int],
        *,
        now: float,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> PrefetchStarted:
        """Start reading a queued request's disk blocks into host pages before it is admitted.

        Takes an empty host page, else the page that evicting one host victim yields (a
        dropped victim's, or a reserved page for a spilled one), never another prefetch's and
        never a GPU page: admission is never held up by a prefetch.  Blocks already on GPU
        or host are left alone.  Calling it again for a request still queued starts the reads
        that could not start before (host pages come back as spills land).  Ends with
        ``add_request(request_id, ...)``, which takes the prefetched blocks as host hits, or
        ``release(request_id)`` if the request leaves the queue; the host tier may also
        reclaim the pages (prefetched pages go first).
        """
        records = self._records
        now = check_now(now, records.now)
        rid = self._requests.check_new_id(request_id)
        onboarding = self._onboarding
        known = onboarding.queued_records.get(rid)
        if known is None or not known.same_call(token_ids, cache_salt, lora_id):
            req = self._requests.new_record(rid, token_ids, cache_salt, lora_id, None, 0)
            known = QueuedRecord(token_ids, cache_salt, lora_id, req)
        matched = self._index.lookup(known.request)
        self._advance(now)
        records.cause = rid
        try:
            started, shared, cached, unfetched = onboarding.prefetch(rid, matched, now)
        finally:
            records.cause = None
        onboarding.queued_records[rid] = known
        bs = self._block_size
        return PrefetchStarted(
            request_id=rid, started_tokens=started * bs, shared_tokens=shared * bs,
            cached_tokens=cached * bs, unfetched_tokens=unfetched * bs,
        )

    def report_disk_read(self, num_bytes: int, seconds: float) -> None:
        """An actor read `num_bytes` from disk in `seconds` (one batch): the read-rate estimate."""
        nbytes = check_count("num_bytes", num_bytes, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        self._onboarding.costs.observe_read(nbytes, secs)

    def report_fetch(self, num_bytes: int, seconds: float) -> None:
        """The remote fetcher fetched `num_bytes` of verified values in `seconds` (one batch):
        the shared tier's rate estimate."""
        nbytes = check_count("num_bytes", num_bytes, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        self._onboarding.costs.observe_fetch(nbytes, secs)

    def report_prefill(self, num_tokens: int, seconds: float, *, context_tokens: int) -> None:
        """The model computed `num_tokens` new tokens in `seconds` (one forward pass, maybe a
        batch), the longest of its contexts ending at `context_tokens`: the prefill-rate
        estimate at that context length."""
        ntok = check_count("num_tokens", num_tokens, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        # A batch's tokens may outnumber its longest context (many short prompts): no check
        # ties the two together.
        ctx = check_count("context_tokens", context_tokens, low=1)
        self._onboarding.costs.observe_prefill(ntok, secs, ctx)

    def cost_estimates(self) -> tuple[float | None, float | None]:
        """(disk bytes per second, prefill seconds per token at the longest context seen):
        None where nothing was reported yet."""
        costs = self._onboarding.costs
        return costs.disk_bytes_per_second, costs.prefill_seconds_per_token(1 << 62)

    def append_tokens(self, request_id: RequestId | str, token_ids: Sequence[int]) -> None:
        """Append generated tokens to a request's sequence."""
        req = self._requests.get(request_id)
        # (A list first: the ABC check of Sequence costs more than the rest of a decode step's
        # append.)
        if type(token_ids) is not list and (
            isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence)
        ):
            raise UsageError("token_ids", "must be a sequence of integer token ids")
        capacity = self.config.gpu_blocks * self._block_size
        if req.num_tokens + len(token_ids) > capacity:
            raise UsageError(
                "token_ids",
                f"request {req.id!r} would grow to {req.num_tokens + len(token_ids)} tokens, "
                f"more than {self.config.gpu_blocks} GPU blocks of {self._block_size} hold",
            )
        req.encoded += token_bytes(token_ids)
        req.num_tokens += len(token_ids)

    def allocate_nowait(self, request_id: RequestId | str, num_tokens: int, *, now: float) -> None:
        """Make sure the request has GPU pages for its first `num_tokens` tokens.

        Raises OutOfBlocks, changing nothing, when not enough pages can be had.
        """
        records = self._records
        now = check_now(now, records.now)
        req = self._requests.get(request_id)
        if type(num_tokens) is not int and (  # an int first: once per decode step
                isinstance(num_tokens, bool) or not isinstance(num_tokens, int)):
            raise UsageError("num_tokens", f"must be an integer, got {num_tokens!r}")
        if not req.num_computed <= num_tokens <= req.num_tokens:
            raise UsageError(
                "num_tokens",
                f"must be between the computed ({req.num_computed}) and known "
                f"({req.num_tokens}) token counts of request {req.id!r}, got {num_tokens}",
            )
        needed = blocks_for_tokens(num_tokens, self._block_size) - len(req.blocks)
        if needed <= 0:  # most decode steps: the last block has room
            self._advance(now)
            return
        obtainable = self._gpu.obtainable()
        if needed > obtainable:
            raise OutOfBlocks(req.id, needed, obtainable)
        self._advance(now)
        records.cause = req.id
        try:
            blocks, pages = req.blocks, req.pages
            # Pages first: an eviction that drops content also frees its record.
            new_pages = self._eviction.take_gpu_pages(needed, now)
            free_records = records.free
            fresh = free_records[len(free_records) - needed:]
            del free_records[len(free_records) - needed:]
            fresh.reverse()  # the order of `needed` pops from the free stack's end
            records.move_all(fresh, _E.ALLOCATED)
            depth = len(blocks)
            for block, page in zip(fresh, new_pages, strict=True):
                block.gpu_page = page
                block.ref_count = 1
                block.depth = depth
                depth += 1
            pages.extend(new_pages)
            blocks.extend(fresh)
        finally:
            records.cause = None

    def commit(self, request_id: RequestId | str, num_computed_tokens: int, *, now: float) -> None:
        """Record that KV for tokens [0, num_computed_tokens) is written; share full blocks."""
        now = check_now(now, self._records.now)
        req = self._requests.get(request_id)
        n = num_computed_tokens
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, int)):
            raise UsageError("num_computed_tokens", f"must be an integer, got {n!r}")
        limit = min(req.num_tokens, len(req.blocks) * self._block_size)
        if not req.num_computed <= n <= limit:
            raise UsageError(
                "num_computed_tokens",
                f"must be between {req.num_computed} (already computed) and {limit} "
                f"(tokens with pages) for request {req.id!r}, got {n}",
            )
        if req.pending:
            raise UsageError(
                "request_id", f"request {req.id!r} is parked: its onboard reads have not landed"
            )
        self._advance(now)
        req.num_computed = n
        full = full_blocks(n, self._block_size)
        if full <= req.committed:
            return
        prefix_index = self._index
        prefix_index.extend_keys(req, full)
        # PrefixIndex.add, inlined: commit indexes every block a prefill computed, walking
        # the run's keys, blocks and parent keys side by side.
        index, children = prefix_index.blocks, prefix_index.children
        keys, start = req.keys, req.committed
        parent = keys[start - 1] if start else req.root
        depth = start
        for key, block in zip(keys[start:full], req.blocks[start:full], strict=True):
            if key not in index:  # else the same content was committed meanwhile: ours
                block.key = key   # stays private
                block.parent_key = parent
                block.depth = depth
                index[key] = block
                children[parent] = children.get(parent, 0) + 1
            parent = key
            depth += 1
        req.committed = full

    def release(self, request_id: RequestId | str, *, now: float) -> None:
        """The request finished or was cancelled: give its blocks back.

        Cached content stays reusable (stamped with the request's TTL, counted from now).
        A block whose onboard read is still in flight keeps its GPU page until the read
        lands, whoever releases it.
        """
        records = self._records
        now = check_now(now, records.now)
        requests = self._requests
        onboarding = self._onboarding
        if (isinstance(request_id, str) and request_id in onboarding.queued
                and request_id not in requests.live):
            # A queued request left before admission: give its prefetched pages back.
            rid = RequestId(request_id)
            self._advance(now)
            records.cause = rid
            try:
                onboarding.end_prefetch(rid, now)
            finally:
                records.cause = None
            return
        req = requests.get(request_id)
        self._advance(now)
        del requests.live[req.id]
        if req.pending:
            requests.parked -= 1
        records.cause = req.id
        try:
            if req.ttl:
                self._disk.stamp_retention(req, expiry_after(now, req.ttl), now)
            self._eviction.let_go(req, req.blocks)
            if self._publish_on_release:
                self._eviction.publish_released(req, self._index, now)
            if req.ttl and self._write_through:
                self._eviction.write_through(req, self._index, now)
        finally:
            records.cause = None
        self._counters.requests_released += 1

    def restore(self, blocks: Sequence[RestoredBlock], *, now: float) -> None:
        """Adopt blocks an earlier process left on disk, each ON_DISK in its slot.

        Only on a manager that has done nothing yet (no request, nothing cached, every slot
        empty).  The displacement order is rebuilt as if the blocks had stayed: best-effort
        content first, in the order it became best-effort (when it was written, or when its
        deadline passed -- also while the process was down), a deeper block before its prefix
        among equals; then content whose deadline is still running, by
        :func:`~statekv.arith.retention_order`.  Validates everything before changing
        anything: raises UsageError naming the field and the entry at fault.
        """
        now = check_now(now, self._records.now)
        disk, onboarding = self._disk, self._onboarding
        if (self._requests.live or self._index.blocks or disk.writes or onboarding.reads
                or onboarding.prefetch_reads or onboarding.queued or onboarding.fetches
                or len(disk.slots.empty) != self.config.disk_blocks):
            raise UsageError("restore", "only a fresh cache can restore blocks from disk")
        slots = disk.check_restore(blocks)
        self._advance(now)
        disk.restore(blocks, slots, now)

    def stop_write_through_retries(self) -> None:
        """A close began: no write of the write-through backlog starts from now on, as the
        writes in flight complete.  The close writes retained content down itself
        (flush_retained, within its bound and reported) or, without a drain, drops the work;
        a retry started after the writer queue closed would be neither written nor
        counted."""
        self._retry_write_throughs = False
        self._eviction.write_backlog.clear()

    def flush_retained(self, *, now: float) -> tuple[int, int]:
        """For a clean close: start writing down every released block whose TTL runs and
        that is on no disk yet (GPU -> host -> disk), as far as host pages and slots allow
        now; returns (how many are left to write, how many this call moved on).  Call again
        while it moves some or writes are in flight; left is 0 when every one is on disk or
        being written.  Best-effort host content may be dropped to make
        room: nothing is served after a close."""
        now = check_now(now, self._records.now)
        self._advance(now)
        return self._eviction.flush_retained(now)

    def is_ready(self, request_id: RequestId | str) -> bool:
        """Whether every block of the request has landed on GPU.  O(1)."""
        return self._requests.get(request_id).pending == 0

    def block_table(self, request_id: RequestId | str) -> tuple[PageId, ...]:
        """The GPU pages of the request's blocks, in sequence order."""
        return tuple(self._requests.get(request_id).pages)

    def request_status(self, request_id: RequestId | str) -> RequestStatus:
        req = self._requests.get(request_id)
        return RequestStatus(
            request_id=req.id, num_tokens=req.num_tokens, num_computed_tokens=req.num_computed,
            num_blocks=len(req.blocks), pending_reads=req.pending, ready=req.pending == 0,
        )

    def prefetch_reads_pending(self, request_id: RequestId | str) -> int:
        """Reads of the queued request's prefetch still in flight: 0 once they all landed,
        and for a request that never prefetched or left the queue.  O(1).  Only
        the request's own prefetch calls raise it (a read joins a request at its ask, and
        leaves it when it lands or fails, or with the request): once 0, it stays 0 until
        the request asks again."""
        return self._onboarding.queued_reading.get(RequestId(str(request_id)), 0)

    def prefetch_could_start(self) -> bool:
        """Whether a prefetch call could take a host page now: an empty one (or a host
        copy's), or a host victim to evict.  When not, asking again for a queued request's
        unfetched blocks starts no read and evicts nothing, so a loop whose prefetch left
        blocks unfetched need not repeat the ask (a walk of the whole prompt's chain) until
        this turns true: host pages come back as spills land, as prefetched blocks are
        taken or given up, and as requests release theirs.  O(1)."""
        host = self._host
        return host.free_count() > 0 or host.evictable.size > 0

    def disk_reads_in_flight(self) -> int:
        """Disk reads (onboards and prefetches) the cache waits for: the reader pool's work,
        dispatched or about to be.  O(1)."""
        onboarding = self._onboarding
        return len(onboarding.reads) + len(onboarding.prefetch_reads)

    def obtainable_gpu_blocks(self) -> int:
        """GPU pages that allocation could have now: empty ones plus evictable cached ones."""
        return self._gpu.obtainable()

    def has_request(self, request_id: RequestId | str) -> bool:
        return isinstance(request_id, str) and request_id in self._requests.live

    def cached_blocks(self) -> tuple[CachedBlock, ...]:
        """Every block in the prefix index, with its tier: for debugging and tests."""
        return tuple(
            CachedBlock(
                key=block.key, state=block.state, ref_count=block.ref_count,
                reuse_count=block.reuse_count, expiry=block.expiry, depth=block.depth,
                priority=block.priority,
                has_disk_copy=block.disk_slot is not None and block.state in COPY_STATES,
                has_host_copy=block.host_page is not None and block.gpu_page is not None
                and block.state in COPY_STATES,
            )
            for block in self._index.blocks.values()
            if block.key is not None
        )

    def advance(self, now: float) -> None:
        """Tell the cache the time: TTLs that ran out stop protecting their content."""
        self._advance(check_now(now, self._records.now))

    def handle(self, event: Completion, *, now: float) -> None:
        """Feed back a completion from an actor: one transfer's, or a batch's.

        A batch is checked whole before any of it is applied (every transfer in flight, of
        one kind, named once), so a bad one changes nothing.
        """
        now = check_now(now, self._records.now)
        if isinstance(event, BatchFinished):
            items = event.outcomes
            if not isinstance(items, tuple) or not items:
                raise UsageError("event", f"a batch needs at least one outcome: {event!r}")
            for item in items:
                self._check_outcome(item)
            if len({item.transfer for item in items}) != len(items):
                raise UsageError("event", "a batch names one transfer twice")
            if len({isinstance(item, SlotRead | SlotReadFailed) for item in items}) != 1:
                raise UsageError("event", "a batch holds reads or writes, not both")
            self._advance(now)
            for item in items:
                self._apply(item, now)
            return
        self._check_outcome(event)
        self._advance(now)
        self._apply(event, now)

    def _check_outcome(self, event: object) -> None:
        if isinstance(event, SlotWritten | SlotWriteFailed):
            if event.transfer not in self._disk.writes:
                raise UsageError("transfer", f"no write {event.transfer} is in flight")
        elif isinstance(event, SlotRead | SlotReadFailed):
            if not self._onboarding.in_flight(event.transfer):
                raise UsageError("transfer", f"no read {event.transfer} is in flight")
        else:
            raise UsageError("event", f"not a completion: {event!r}")

    def _apply(self, event: TransferOutcome, now: float) -> None:
        if isinstance(event, SlotWritten | SlotWriteFailed):
            disk = self._disk
            write = disk.writes.pop(event.transfer)
            if isinstance(event, SlotWritten):
                disk.write_landed(write, now)
                # Only after a write that landed: a disk failing every write must not be
                # handed the backlog one block after another.
                if self._write_through and self._retry_write_throughs:
                    self._eviction.retry_write_throughs(self._index, now)
            else:
                disk.write_failed(write)
        else:
            self._onboarding.complete(event, now)

    def take_commands(self) -> list[Command]:
        """Everything the actors must do, in order; the outbox is empty afterwards.

        Copies and FreeSlots come first, in the order they were decided; then the spills and
        the reads, packed into batches of at most ``max_batch_blocks`` (see
        :mod:`statekv.messages` for why that order keeps the ordering contract).
        """
        return self._outbox.take(self.config.max_batch_blocks)

    def statistics(self) -> CacheStatistics:
        records, onboarding, disk = self._records, self._onboarding, self._disk
        counts = records.state_counts
        return snapshot(
            self._counters, block_size=self._block_size,
            parked_requests=self._requests.parked,
            writes_in_flight=len(disk.writes),
            reads_in_flight=len(onboarding.reads),
            prefetch_reads_in_flight=len(onboarding.prefetch_reads),
            prefetched_blocks=counts[_S.PREFETCHED],
            prefetching_requests=len(onboarding.queued),
            fetches_in_flight=len(onboarding.fetches),
            cached_blocks=len(self._index.blocks),
            gpu_free_pages=len(self._gpu.empty),
            gpu_evictable_blocks=self._gpu.evictable.size,
            host_free_pages=self._host.free_count(),
            host_reserved_pages=len(self._host.reserved),
            host_cached_blocks=self._host.evictable.size,
            disk_empty_slots=len(disk.slots.empty),
            disk_cached_blocks=counts[_S.ON_DISK],
            disk_retained_blocks=len(disk.slots.retained),
            disk_copy_blocks=(len(disk.slots.retained) + len(disk.slots.unmarked)
                              - counts[_S.ON_DISK]),
            host_copy_pages=len(self._host.copies),
            blocks_by_state=tuple((s.name, counts[s]) for s in BlockState),
        )

    def check_invariants(self) -> None:
        """Verify every structural invariant; raises InvariantViolation.  Not for the hot path."""
        check_invariants(self.config, self._records, self._index, self._requests,
                         self._eviction, self._disk, self._onboarding)

    # ------------------------------------------------------------------ validation

    def _check_remote_keys(self, remote_keys: object) -> frozenset[bytes]:
        if isinstance(remote_keys, str | bytes) or not isinstance(remote_keys, Collection):
            raise UsageError("remote_keys", "must be a collection of block keys")
        if not remote_keys:
            return frozenset()
        if not self._shared:
            raise UsageError("remote_keys", "the cache has no shared tier configured")
        for key in remote_keys:
            if not isinstance(key, bytes) or len(key) != DIGEST_SIZE:
                raise UsageError("remote_keys", f"must hold BlockHash keys, got {key!r:.80}")
        return frozenset(remote_keys)

    def _check_ttl(self, ttl: object) -> float | None:
        return check_ttl_seconds(ttl, self.config.max_ttl_seconds)

    def _check_priority(self, priority: object) -> None:
        levels = self.config.priority_levels
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
            0 <= priority < levels
        ):
            raise UsageError("priority", f"must be an integer in [0, {levels}), got {priority!r}")

    # ------------------------------------------------------------------ the clock

    def _advance(self, now: float) -> None:
        self._records.now = now
        if self._has_disk:
            self._disk.expire(now)
