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

Every public method validates its arguments before it changes anything, so a call that
raises leaves the cache exactly as it was.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs

from statekv.arith import blocks_for_tokens, expiry_after, full_blocks, is_live, matchable_blocks
from statekv.block import Block
from statekv.config import CacheConfig, is_finite_number, is_utf8_encodable
from statekv.cost import OnboardCosts, check_count, check_measurement
from statekv.errors import IllegalTransition, InvariantViolation, OutOfBlocks, UsageError
from statekv.hashing import DIGEST_SIZE, extend_chain, root_key, token_bytes
from statekv.ids import BlockHash, BlockId, PageId, RequestId, SlotId, TransferId
from statekv.lifecycle import TRANSITIONS, BlockEvent, BlockState
from statekv.messages import (
    BatchFinished,
    Command,
    Completion,
    CopyGpuToHost,
    CopyHostToGpu,
    FreeSlot,
    PersistRetention,
    PrefetchSlot,
    PrefetchSlots,
    ReadSlot,
    ReadSlots,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
    WriteSlot,
    WriteSlots,
)
from statekv.orderings import BlockList
from statekv.policies import Policies
from statekv.pools import DiskSlots, HostPagePool, PagePool
from statekv.stats import CacheStatistics, Counters
from statekv.trace import TraceSink

_S = BlockState
_E = BlockEvent
_MAX_LORA_ID = 2**63 - 1


class _Refusal(enum.Enum):
    """Why a host victim was dropped instead of spilled."""

    GATE = "the spill mode does not admit it"
    PRESSURE = "best-effort, and the write queue is full (drop-on-pressure)"
    ADMISSION = "the disk is full of unexpired retained content (protect_unexpired)"
    DISK_BUSY = "every slot has a read or write in flight"


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


@attrs.frozen(kw_only=True)
class RestoredBlock:
    """One block an index rebuild found on disk, to be adopted by :meth:`KVCacheManager.restore`.

    Everything here was stored with the block by the process that spilled it.
    """

    key: BlockHash
    parent_key: BlockHash
    slot: SlotId
    depth: int
    reuse_count: int
    expiry: float | None
    """Retention deadline on the same clock as `now` (wall-clock seconds)."""
    written_at: float
    """When the spill was issued, on the same clock."""
    sequence: int
    """Orders spills issued at the same `written_at`."""


@attrs.define(eq=False, slots=True)
class _Request:
    id: RequestId
    encoded: bytearray
    num_tokens: int
    root: BlockHash
    ttl: float | None
    priority: int
    keys: list[BlockHash] = attrs.field(factory=list)
    blocks: list[Block] = attrs.field(factory=list)
    pages: list[PageId] = attrs.field(factory=list)
    num_computed: int = 0
    committed: int = 0
    """Blocks [0, committed) are full and were offered to the prefix index."""
    pending: int = 0
    """Blocks of this request whose onboard read has not landed."""


@attrs.define(eq=False, slots=True)
class _Write:
    block: Block | None
    """The spilling block, or None once it was recalled to GPU while its write drained."""
    host_page: PageId
    slot: SlotId


def _check_now(now: object, last: float) -> float:
    if not is_finite_number(now):
        raise UsageError("now", f"must be a finite number of seconds, got {now!r}")
    if now < last:
        raise UsageError("now", f"clock went backwards: {now!r} < {last!r}")
    return float(now)


class KVCacheManager:
    """Tiered KV cache bookkeeping for one rank: GPU, pinned host and disk, sans I/O."""

    def __init__(self, config: CacheConfig, *, trace: TraceSink | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise UsageError("config", f"must be a CacheConfig, got {config!r}")
        self.config = config
        self._block_size = config.block_size
        self._block_bytes = config.block_bytes
        self._policies = Policies.from_config(config)
        nrecords = (
            config.gpu_blocks + config.host_blocks + config.reserved_host_blocks
            + config.disk_blocks
        )
        # Every live block owns at least one page or slot, so this many records suffice.
        self._records = [Block(BlockId(i)) for i in range(nrecords)]
        self._free_records = list(reversed(self._records))
        self._gpu = PagePool(config.gpu_blocks, config.priority_levels)
        self._host = HostPagePool(
            config.host_blocks, config.reserved_host_blocks, config.priority_levels
        )
        self._has_host = config.host_blocks + config.reserved_host_blocks > 0
        self._disk = DiskSlots(config.disk_blocks)
        self._has_disk = config.disk_blocks > 0
        self._index: dict[BlockHash, Block] = {}
        self._children: dict[BlockHash, int] = {}
        self._requests: dict[RequestId, _Request] = {}
        self._writes: dict[TransferId, _Write] = {}
        self._reads: dict[TransferId, Block] = {}
        # Prefetch: reads into host pages in flight, the blocks each queued request asked
        # for, and the PREFETCHED blocks in landing order (the newest is reclaimed first: its
        # request is the furthest from admission).
        self._prefetch_reads: dict[TransferId, Block] = {}
        self._queued: dict[RequestId, list[Block]] = {}
        self._prefetched = BlockList()
        self._prefetch_outbox: list[PrefetchSlot] = []
        self._costs = OnboardCosts()
        self._cost_aware = config.cost_aware_onboarding
        self._reclaim_first = config.reclaim_prefetched_first
        self._outbox: list[Command] = []
        # Disk transfers wait here until take_commands() packs them into batches.
        self._write_outbox: list[WriteSlot] = []
        self._read_outbox: list[ReadSlot] = []
        self._counters = Counters()
        self._state_counts = [0] * len(BlockState)
        self._state_counts[_S.FREE] = nrecords
        self._parked = 0
        self._now = -math.inf
        self._seq = 0
        self._next_transfer = 0
        self._trace = trace
        self._cause: RequestId | None = None

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
    ) -> PrefixMatch:
        """Register a request and take the longest cached prefix of its prompt.

        Matched blocks on GPU are shared at once; host blocks are copied back; disk blocks
        are read back asynchronously and the request is parked until they land.  Raises
        OutOfBlocks (changing nothing) when the GPU cannot hold the blocks to onboard.
        """
        now = _check_now(now, self._now)
        rid = self._check_new_request_id(request_id)
        ttl = self._check_ttl(ttl_seconds)
        self._check_priority(priority)
        req = self._new_request(rid, token_ids, cache_salt, lora_id, ttl, priority)
        matched = self._lookup_prefix(req)
        matched, skipped = self._cost_cut(req, matched)
        # Capacity: every matched block that is not already on GPU needs a GPU page.
        needs_page = 0
        released_hits = 0
        for block in matched:
            state = block.state
            if state is _S.RELEASED:
                released_hits += 1
            elif state is not _S.ON_GPU and state is not _S.ONBOARDING:
                needs_page += 1
        obtainable = self._gpu.obtainable() - released_hits
        if needs_page > obtainable:
            raise OutOfBlocks(rid, needs_page, obtainable)

        self._advance(now)
        self._cause = rid
        try:
            gpu, host, disk = self._take_matched(req, matched)
            if rid in self._queued:
                self._end_prefetch(rid, now)
        finally:
            self._cause = None
        self._requests[rid] = req
        c = self._counters
        c.requests_added += 1
        c.onboards_skipped_as_too_slow += skipped
        if req.pending:
            c.requests_parked += 1
            self._parked += 1
        bs = self._block_size
        return PrefixMatch(
            request_id=rid, num_prompt_tokens=req.num_tokens,
            matched_tokens=len(matched) * bs, gpu_tokens=gpu * bs, host_tokens=host * bs,
            disk_tokens=disk * bs, ready=req.pending == 0, skipped_disk_tokens=skipped * bs,
        )

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
        now = _check_now(now, self._now)
        rid = self._check_new_request_id(request_id)
        req = self._new_request(rid, token_ids, cache_salt, lora_id, None, 0)
        matched = self._lookup_prefix(req)
        self._advance(now)
        blocks = self._queued.setdefault(rid, [])
        started = shared = cached = unfetched = 0
        self._cause = rid
        try:
            for i, block in enumerate(matched):
                state = block.state
                if rid in block.prefetchers:
                    shared += 1  # asked for by an earlier call of this request
                elif state is _S.PREFETCHING or state is _S.PREFETCHED:
                    block.prefetchers.append(rid)
                    blocks.append(block)
                    shared += 1
                elif state is _S.ON_DISK:
                    # Out of the displacement order first: finding a host page may spill a
                    # host victim, and that spill must not displace this block.
                    self._disk.unfile(block)
                    page = self._take_host_page(now, for_prefetch=True)
                    if page is None:
                        self._disk.file(block, now, self._next_seq())
                        unfetched = sum(1 for b in matched[i:] if b.state is _S.ON_DISK)
                        break
                    self._start_prefetch(block, page)
                    block.prefetchers.append(rid)
                    blocks.append(block)
                    started += 1
                elif state is _S.FREE or state is _S.ERROR:
                    break  # dropped by the evictions above: the chain ends here
                else:
                    cached += 1
        finally:
            self._cause = None
        bs = self._block_size
        return PrefetchStarted(
            request_id=rid, started_tokens=started * bs, shared_tokens=shared * bs,
            cached_tokens=cached * bs, unfetched_tokens=unfetched * bs,
        )

    def report_disk_read(self, num_bytes: int, seconds: float) -> None:
        """An actor read `num_bytes` from disk in `seconds` (one batch): the read-rate estimate."""
        nbytes = check_count("num_bytes", num_bytes, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        self._costs.observe_read(nbytes, secs)

    def report_prefill(self, num_tokens: int, seconds: float, *, context_tokens: int) -> None:
        """The model computed `num_tokens` new tokens in `seconds` (one forward pass, maybe a
        batch), the longest of its contexts ending at `context_tokens`: the prefill-rate
        estimate at that context length."""
        ntok = check_count("num_tokens", num_tokens, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        # A batch's tokens may outnumber its longest context (many short prompts): no check
        # ties the two together.
        ctx = check_count("context_tokens", context_tokens, low=1)
        self._costs.observe_prefill(ntok, secs, ctx)

    def cost_estimates(self) -> tuple[float | None, float | None]:
        """(disk bytes per second, prefill seconds per token at the longest context seen):
        None where nothing was reported yet."""
        return self._costs.disk_bytes_per_second, self._costs.prefill_seconds_per_token(
            1 << 62
        )

    def _new_request(
        self, rid: RequestId, token_ids: Sequence[int], cache_salt: str | None,
        lora_id: int | None, ttl: float | None, priority: int,
    ) -> _Request:
        """A request record for `token_ids`, every argument checked (nothing changed)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise UsageError("cache_salt", f"must be a string or None, got {cache_salt!r}")
        if cache_salt is not None and not is_utf8_encodable(cache_salt):
            raise UsageError("cache_salt", f"must be encodable as UTF-8, got {cache_salt!r}")
        if lora_id is not None and (
            isinstance(lora_id, bool) or not isinstance(lora_id, int)
            or not 0 <= lora_id <= _MAX_LORA_ID
        ):
            raise UsageError("lora_id", f"must be a non-negative integer or None, got {lora_id!r}")
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise UsageError("token_ids", "must be a sequence of integer token ids")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise UsageError("token_ids", "a request needs at least one token")
        capacity_tokens = self.config.gpu_blocks * self._block_size
        if num_tokens > capacity_tokens:
            raise UsageError(
                "token_ids",
                f"{num_tokens} tokens do not fit in {self.config.gpu_blocks} GPU blocks "
                f"of {self._block_size} tokens",
            )
        encoded = bytearray(token_bytes(token_ids))
        return _Request(
            id=rid, encoded=encoded, num_tokens=num_tokens,
            root=root_key(self.config.model_fingerprint, cache_salt, lora_id),
            ttl=ttl, priority=priority,
        )

    def _cost_cut(self, req: _Request, matched: list[Block]) -> tuple[list[Block], int]:
        """Where to end the match so that the request is fastest: returns the blocks to take
        and how many disk blocks were left to recompute.

        Ending the match at a block means recomputing every matched token from there on (a
        request's computed tokens are a prefix), so the candidates are the starts of the runs
        of disk blocks, each costing the reads before it plus a prefill of the rest; no cut
        costs every read.  Ties keep the longer match (read).
        """
        if not self._cost_aware or not matched:
            return matched, 0
        costs = self._costs
        rate = costs.disk_bytes_per_second
        per_token = costs.prefill_seconds_per_token(req.num_tokens)
        if rate is None or per_token is None:
            return matched, 0
        on_disk = _S.ON_DISK
        disk_before = [0] * (len(matched) + 1)
        for i, block in enumerate(matched):
            disk_before[i + 1] = disk_before[i] + (block.state is on_disk)
        total = disk_before[-1]
        if not total:
            return matched, 0
        bb, bs = self._block_bytes, self._block_size
        best = len(matched)
        best_cost = total * bb / rate
        for i, block in enumerate(matched):
            if block.state is on_disk and (i == 0 or matched[i - 1].state is not on_disk):
                cost = disk_before[i] * bb / rate + (len(matched) - i) * bs * per_token
                if cost < best_cost:
                    best, best_cost = i, cost
        return matched[:best], total - disk_before[best]

    def append_tokens(self, request_id: RequestId | str, token_ids: Sequence[int]) -> None:
        """Append generated tokens to a request's sequence."""
        req = self._request(request_id)
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
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
        now = _check_now(now, self._now)
        req = self._request(request_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise UsageError("num_tokens", f"must be an integer, got {num_tokens!r}")
        if not req.num_computed <= num_tokens <= req.num_tokens:
            raise UsageError(
                "num_tokens",
                f"must be between the computed ({req.num_computed}) and known "
                f"({req.num_tokens}) token counts of request {req.id!r}, got {num_tokens}",
            )
        needed = blocks_for_tokens(num_tokens, self._block_size) - len(req.blocks)
        obtainable = self._gpu.obtainable()
        if needed > obtainable:
            raise OutOfBlocks(req.id, needed, obtainable)
        self._advance(now)
        if needed <= 0:
            return
        self._cause = req.id
        try:
            blocks, pages = req.blocks, req.pages
            # Pages first: an eviction that drops content also frees its record.
            empty = self._gpu.empty
            new_pages = [empty.pop() if empty else self._take_gpu_page(now)
                         for _ in range(needed)]
            free_records = self._free_records
            fresh = [free_records.pop() for _ in range(needed)]
            self._move_all(fresh, _E.ALLOCATED)
            depth = len(blocks)
            for block, page in zip(fresh, new_pages, strict=True):
                block.gpu_page = page
                block.ref_count = 1
                block.depth = depth
                depth += 1
            pages.extend(new_pages)
            blocks.extend(fresh)
        finally:
            self._cause = None

    def commit(self, request_id: RequestId | str, num_computed_tokens: int, *, now: float) -> None:
        """Record that KV for tokens [0, num_computed_tokens) is written; share full blocks."""
        now = _check_now(now, self._now)
        req = self._request(request_id)
        n = num_computed_tokens
        if isinstance(n, bool) or not isinstance(n, int):
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
        self._extend_keys(req, full)
        index, children = self._index, self._children
        keys, blocks = req.keys, req.blocks
        for i in range(req.committed, full):
            key = keys[i]
            if key in index:
                continue  # the same content was committed meanwhile: ours stays private
            block = blocks[i]
            parent = keys[i - 1] if i else req.root
            block.key = key
            block.parent_key = parent
            block.depth = i
            index[key] = block
            children[parent] = children.get(parent, 0) + 1
        req.committed = full

    def release(self, request_id: RequestId | str, *, now: float) -> None:
        """The request finished or was cancelled: give its blocks back.

        Cached content stays reusable (stamped with the request's TTL, counted from now).
        A block whose onboard read is still in flight keeps its GPU page until the read
        lands, whoever releases it.
        """
        now = _check_now(now, self._now)
        if (isinstance(request_id, str) and request_id in self._queued
                and request_id not in self._requests):
            # A queued request left before admission: give its prefetched pages back.
            rid = RequestId(request_id)
            self._advance(now)
            self._cause = rid
            try:
                self._end_prefetch(rid, now)
            finally:
                self._cause = None
            return
        req = self._request(request_id)
        self._advance(now)
        del self._requests[req.id]
        if req.pending:
            self._parked -= 1
        self._cause = req.id
        try:
            if req.ttl:
                self._stamp_retention(req, expiry_after(now, req.ttl), now)
            self._let_go(req, req.blocks)
        finally:
            self._cause = None
        self._counters.requests_released += 1

    def _stamp_retention(self, req: _Request, expiry: float, now: float) -> None:
        """Keep the request's full blocks until `expiry` (never shortening a stamp).

        A block the request computed after another request had committed the same content
        is a private duplicate; the stamp goes to the cached twin, wherever it is now -- on
        disk it is re-filed in the retention order at once.  A stamped block that has a disk
        slot (on disk, being spilled or read back) was written with an earlier deadline in
        its slot header: a PersistRetention makes the new one survive a restart.
        """
        index = self._index
        for i in range(req.committed):
            block = req.blocks[i]
            target = block if block.key is not None else index.get(req.keys[i])
            if target is None or (target.expiry is not None and target.expiry >= expiry):
                continue
            if target.state is _S.ON_DISK:
                self._disk.unfile(target)
                target.expiry = expiry
                self._disk.file(target, now, self._next_seq())
            else:
                target.expiry = expiry
            slot, key = target.disk_slot, target.key
            if slot is not None and key is not None:
                self._outbox.append(PersistRetention(slot=slot, key=key, expiry=expiry))

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
        now = _check_now(now, self._now)
        if (self._requests or self._index or self._writes or self._reads
                or self._prefetch_reads or self._queued
                or len(self._disk.empty) != self.config.disk_blocks):
            raise UsageError("restore", "only a fresh cache can restore blocks from disk")
        given: object = blocks
        if isinstance(given, str | bytes) or not isinstance(given, Sequence):
            raise UsageError("blocks", "must be a sequence of RestoredBlock")
        slots: set[int] = set()
        keys: set[bytes] = set()
        for i, entry in enumerate(blocks):
            self._check_restored(i, entry, slots, keys)
        self._advance(now)
        by_slot = sorted(blocks, key=lambda e: e.slot)
        live = [e for e in by_slot if is_live(e.expiry, now)]
        best_effort = [e for e in by_slot if not is_live(e.expiry, now)]

        def became_best_effort(e: RestoredBlock) -> tuple[float, float, int, int]:
            expired_at = e.expiry if e.expiry is not None else -math.inf
            return (max(e.written_at, expired_at), e.written_at, e.sequence, -e.depth)

        best_effort.sort(key=became_best_effort)
        live.sort(key=lambda e: (e.written_at, e.sequence))
        disk = self._disk
        index, children = self._index, self._children
        fresh: list[Block] = []
        for entry in [*best_effort, *live]:
            block = self._free_records.pop()
            fresh.append(block)
            block.key = entry.key
            block.parent_key = entry.parent_key
            block.depth = entry.depth
            block.reuse_count = entry.reuse_count
            block.expiry = entry.expiry
            block.disk_slot = entry.slot
            index[entry.key] = block
            children[entry.parent_key] = children.get(entry.parent_key, 0) + 1
        self._move_all(fresh, _E.RESTORED)
        for block in fresh:
            disk.file(block, now, self._next_seq())
        disk.empty = [slot for slot in disk.empty if slot not in slots]
        self._counters.restored_blocks += len(fresh)

    def _check_restored(
        self, i: int, entry: object, slots: set[int], keys: set[bytes]
    ) -> None:
        where = f"blocks[{i}]"
        if not isinstance(entry, RestoredBlock):
            raise UsageError("blocks", f"{where} is not a RestoredBlock: {entry!r:.80}")
        hashes: tuple[tuple[str, object], ...] = (
            ("key", entry.key), ("parent_key", entry.parent_key)
        )
        for field, digest in hashes:
            if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
                raise UsageError(field, f"{where}: must be a BlockHash, got {digest!r:.80}")
        slot: object = entry.slot
        if isinstance(slot, bool) or not isinstance(slot, int) or not (
            0 <= slot < self.config.disk_blocks
        ):
            raise UsageError(
                "slot", f"{where}: must be a slot in [0, {self.config.disk_blocks}), got {slot!r}"
            )
        if slot in slots:
            raise UsageError("slot", f"{where}: slot {slot} restored twice")
        assert isinstance(slot, int)
        if entry.key in keys:
            raise UsageError("key", f"{where}: key restored twice")
        counts: tuple[tuple[str, object], ...] = (
            ("depth", entry.depth), ("reuse_count", entry.reuse_count),
            ("sequence", entry.sequence),
        )
        for field, value in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(field, f"{where}: must be an integer >= 0, got {value!r}")
        if entry.expiry is not None and not is_finite_number(entry.expiry):
            raise UsageError("expiry", f"{where}: must be finite seconds or None")
        if not is_finite_number(entry.written_at):
            raise UsageError("written_at", f"{where}: must be finite seconds")
        slots.add(slot)
        keys.add(entry.key)

    def is_ready(self, request_id: RequestId | str) -> bool:
        """Whether every block of the request has landed on GPU.  O(1)."""
        return self._request(request_id).pending == 0

    def block_table(self, request_id: RequestId | str) -> tuple[PageId, ...]:
        """The GPU pages of the request's blocks, in sequence order."""
        return tuple(self._request(request_id).pages)

    def request_status(self, request_id: RequestId | str) -> RequestStatus:
        req = self._request(request_id)
        return RequestStatus(
            request_id=req.id, num_tokens=req.num_tokens, num_computed_tokens=req.num_computed,
            num_blocks=len(req.blocks), pending_reads=req.pending, ready=req.pending == 0,
        )

    def obtainable_gpu_blocks(self) -> int:
        """GPU pages that allocation could have now: empty ones plus evictable cached ones."""
        return self._gpu.obtainable()

    def has_request(self, request_id: RequestId | str) -> bool:
        return isinstance(request_id, str) and request_id in self._requests

    def cached_blocks(self) -> tuple[CachedBlock, ...]:
        """Every block in the prefix index, with its tier: for debugging and tests."""
        return tuple(
            CachedBlock(
                key=block.key, state=block.state, ref_count=block.ref_count,
                reuse_count=block.reuse_count, expiry=block.expiry, depth=block.depth,
                priority=block.priority,
            )
            for block in self._index.values()
            if block.key is not None
        )

    def advance(self, now: float) -> None:
        """Tell the cache the time: TTLs that ran out stop protecting their content."""
        self._advance(_check_now(now, self._now))

    def handle(self, event: Completion, *, now: float) -> None:
        """Feed back a completion from an actor: one transfer's, or a batch's.

        A batch is checked whole before any of it is applied (every transfer in flight, of
        one kind, named once), so a bad one changes nothing.
        """
        now = _check_now(now, self._now)
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
            if event.transfer not in self._writes:
                raise UsageError("transfer", f"no write {event.transfer} is in flight")
        elif isinstance(event, SlotRead | SlotReadFailed):
            if event.transfer not in self._reads and event.transfer not in self._prefetch_reads:
                raise UsageError("transfer", f"no read {event.transfer} is in flight")
        else:
            raise UsageError("event", f"not a completion: {event!r}")

    def _apply(self, event: TransferOutcome, now: float) -> None:
        if isinstance(event, SlotWritten | SlotWriteFailed):
            write = self._writes.pop(event.transfer)
            if isinstance(event, SlotWritten):
                self._write_landed(write, now)
            else:
                self._write_failed(write)
        elif event.transfer in self._reads:
            block = self._reads.pop(event.transfer)
            if isinstance(event, SlotRead):
                self._read_landed(block)
            else:
                self._read_failed(block)
        else:
            block = self._prefetch_reads.pop(event.transfer)
            if isinstance(event, SlotRead):
                self._prefetch_landed(block, now)
            else:
                self._prefetch_failed(block)

    def take_commands(self) -> list[Command]:
        """Everything the actors must do, in order; the outbox is empty afterwards.

        Copies and FreeSlots come first, in the order they were decided; then the spills and
        the reads, packed into batches of at most ``max_batch_blocks`` (see
        :mod:`statekv.messages` for why that order keeps the ordering contract).
        """
        out = self._outbox
        self._outbox = []
        size = self.config.max_batch_blocks
        writes = self._write_outbox
        if writes:
            self._write_outbox = []
            out.extend(
                WriteSlots(writes=tuple(writes[i : i + size]))
                for i in range(0, len(writes), size)
            )
        reads = self._read_outbox
        if reads:
            self._read_outbox = []
            out.extend(
                ReadSlots(reads=tuple(reads[i : i + size])) for i in range(0, len(reads), size)
            )
        prefetches = self._prefetch_outbox
        if prefetches:
            self._prefetch_outbox = []
            out.extend(
                PrefetchSlots(reads=tuple(prefetches[i : i + size]))
                for i in range(0, len(prefetches), size)
            )
        return out

    def statistics(self) -> CacheStatistics:
        c = self._counters
        bs = self._block_size
        return CacheStatistics(
            requests_added=c.requests_added,
            requests_released=c.requests_released,
            requests_parked=c.requests_parked,
            parked_requests=self._parked,
            requests_fallen_back=c.requests_fallen_back,
            hit_blocks_gpu=c.hit_blocks_gpu,
            hit_blocks_host=c.hit_blocks_host,
            hit_blocks_disk=c.hit_blocks_disk,
            hit_blocks_disk_retained=c.hit_blocks_disk_retained,
            hit_tokens_gpu=c.hit_blocks_gpu * bs,
            hit_tokens_host=c.hit_blocks_host * bs,
            hit_tokens_disk=c.hit_blocks_disk * bs,
            gpu_evictions=c.gpu_evictions,
            host_offloads=c.host_offloads,
            host_recalls=c.host_recalls,
            offloads_skipped=c.offloads_skipped,
            host_drops=c.host_drops,
            spills=c.spills,
            spills_completed=c.spills_completed,
            spill_failures=c.spill_failures,
            bytes_written=c.bytes_written,
            writes_in_flight=len(self._writes),
            onboards=c.onboards,
            onboards_completed=c.onboards_completed,
            onboard_failures=c.onboard_failures,
            bytes_read=c.bytes_read,
            reads_in_flight=len(self._reads),
            gate_drops=c.gate_drops,
            pressure_drops=c.pressure_drops,
            admission_refusals=c.admission_refusals,
            disk_busy_refusals=c.disk_busy_refusals,
            displacements=c.displacements,
            expirations=c.expirations,
            restored_blocks=c.restored_blocks,
            io_errors=c.spill_failures + c.onboard_failures + c.prefetch_failures,
            prefetches=c.prefetches,
            prefetches_completed=c.prefetches_completed,
            prefetch_failures=c.prefetch_failures,
            prefetch_hits=c.prefetch_hits,
            prefetches_taken_over=c.prefetches_taken_over,
            prefetches_cancelled=c.prefetches_cancelled,
            prefetches_reclaimed=c.prefetches_reclaimed,
            prefetch_reads_in_flight=len(self._prefetch_reads),
            prefetched_blocks=self._state_counts[_S.PREFETCHED],
            prefetching_requests=len(self._queued),
            onboards_skipped_as_too_slow=c.onboards_skipped_as_too_slow,
            onboard_tokens_skipped_as_too_slow=c.onboards_skipped_as_too_slow * bs,
            cached_blocks=len(self._index),
            gpu_free_pages=len(self._gpu.empty),
            gpu_evictable_blocks=self._gpu.evictable.size,
            host_free_pages=len(self._host.empty),
            host_reserved_pages=len(self._host.reserved),
            host_cached_blocks=self._host.evictable.size,
            disk_empty_slots=len(self._disk.empty),
            disk_cached_blocks=self._state_counts[_S.ON_DISK],
            disk_retained_blocks=len(self._disk.retained),
            blocks_by_state=tuple((s.name, self._state_counts[s]) for s in BlockState),
        )

    # ------------------------------------------------------------------ validation

    def _request(self, request_id: str) -> _Request:
        if not isinstance(request_id, str):
            raise UsageError("request_id", f"must be a string, got {request_id!r}")
        req = self._requests.get(RequestId(request_id))
        if req is None:
            raise UsageError("request_id", f"unknown request {request_id!r}")
        return req

    def _check_new_request_id(self, request_id: object) -> RequestId:
        if not isinstance(request_id, str) or not request_id:
            raise UsageError("request_id", f"must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise UsageError("request_id", f"request {request_id!r} already exists")
        return RequestId(request_id)

    def _check_ttl(self, ttl: object) -> float | None:
        if ttl is None:
            return None
        if isinstance(ttl, bool) or not isinstance(ttl, int | float):
            raise UsageError("ttl_seconds", f"must be a number of seconds or None, got {ttl!r}")
        if not is_finite_number(ttl) or ttl < 0:
            raise UsageError("ttl_seconds", f"must be finite and >= 0, got {ttl!r}")
        if ttl > self.config.max_ttl_seconds:
            raise UsageError(
                "ttl_seconds", f"{ttl!r} exceeds max_ttl_seconds={self.config.max_ttl_seconds}"
            )
        return float(ttl) if ttl > 0 else None

    def _check_priority(self, priority: object) -> None:
        levels = self.config.priority_levels
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
            0 <= priority < levels
        ):
            raise UsageError("priority", f"must be an integer in [0, {levels}), got {priority!r}")

    # ------------------------------------------------------------------ the lifecycle

    def _move(self, block: Block, event: BlockEvent) -> None:
        """Change a block's state through the table (the only place a state changes)."""
        old = block.state
        new = TRANSITIONS.get((old, event))
        if new is None:
            raise IllegalTransition(block.id, old.name, event.name)
        block.state = new
        counts = self._state_counts
        counts[old] -= 1
        counts[new] += 1
        if self._trace is not None:
            self._trace.record(self._now, block.id, self._cause, old, new, event)

    def _move_all(self, blocks: list[Block], event: BlockEvent) -> None:
        """_move for a batch of blocks (one call instead of one per block on hot paths)."""
        table = TRANSITIONS
        counts = self._state_counts
        trace = self._trace
        for block in blocks:
            old = block.state
            new = table.get((old, event))
            if new is None:
                raise IllegalTransition(block.id, old.name, event.name)
            block.state = new
            counts[old] -= 1
            counts[new] += 1
            if trace is not None:
                trace.record(self._now, block.id, self._cause, old, new, event)

    def _advance(self, now: float) -> None:
        self._now = now
        if self._has_disk:
            expired = self._disk.expire(now)
            if expired:
                self._counters.expirations += len(expired)

    def _next_seq(self) -> int:
        """An arrival stamp for the retention heap: first in, first out among equal keys.
        (The lists order by position and need no stamp.)"""
        self._seq += 1
        return self._seq

    def _new_transfer(self) -> TransferId:
        self._next_transfer += 1
        return TransferId(self._next_transfer)

    # ------------------------------------------------------------------ prefix matching

    def _extend_keys(self, req: _Request, upto: int) -> None:
        if len(req.keys) < upto:
            extend_chain(req.keys, req.root, req.encoded, self._block_size, upto)

    def _lookup_prefix(self, req: _Request) -> list[Block]:
        """The cached blocks of the longest matching prefix (no state is changed).

        Keys of every matchable block are computed at once: commit needs them anyway.
        """
        limit = matchable_blocks(req.num_tokens, self._block_size)
        self._extend_keys(req, limit)
        get = self._index.get
        matched: list[Block] = []
        for key in req.keys:
            block = get(key)
            if block is None:
                break
            matched.append(block)
        return matched

    def _take_matched(self, req: _Request, matched: list[Block]) -> tuple[int, int, int]:
        """Acquire matched blocks, bringing host and disk ones back to GPU.

        Returns the hits by tier the bytes came from: (GPU, host, disk).
        """
        # First take every matched block out of the eviction orders, so that evictions
        # made below to find GPU pages can never pick one of them.
        released, on_gpu = _S.RELEASED, _S.ON_GPU
        if all(b.state is released or b.state is on_gpu for b in matched):
            return self._take_gpu_hits(req, matched), 0, 0
        gpu_evictable = self._gpu.evictable
        for block in matched:
            state = block.state
            if state is _S.RELEASED:
                gpu_evictable.remove(block)
            elif state is _S.ON_HOST:
                self._host.evictable.remove(block)
            elif state is _S.ON_DISK:
                self._disk.unfile(block)
            elif state is _S.PREFETCHED:
                self._prefetched.remove(block)  # no GPU eviction below may reclaim it
        gpu_hits = host_hits = disk_hits = retained_hits = 0
        for block in matched:
            state = block.state
            block.reuse_count += 1
            if state is _S.RELEASED or state is _S.ON_GPU:
                self._move(block, _E.ACQUIRED)
                gpu_hits += 1
            elif state is _S.ONBOARDING:
                self._move(block, _E.ACQUIRED)
                block.waiters.append(req.id)
                req.pending += 1
                disk_hits += 1
                retained_hits += is_live(block.expiry, self._now)
            elif state is _S.ON_HOST or state is _S.SPILLING or state is _S.PREFETCHED:
                self._recall(block)
                host_hits += 1
            elif state is _S.ON_DISK:
                retained_hits += is_live(block.expiry, self._now)
                self._start_read(req, block)
                disk_hits += 1
            elif state is _S.PREFETCHING:
                retained_hits += is_live(block.expiry, self._now)
                self._take_over_prefetch(req, block)
                disk_hits += 1
            else:
                raise InvariantViolation(f"matched {block!r} in state {state.name}")
            block.ref_count += 1
            req.blocks.append(block)
            page = block.gpu_page
            assert page is not None
            req.pages.append(page)
        bs = self._block_size
        req.num_computed = len(matched) * bs
        req.committed = len(matched)
        c = self._counters
        c.hit_blocks_gpu += gpu_hits
        c.hit_blocks_host += host_hits
        c.hit_blocks_disk += disk_hits
        c.hit_blocks_disk_retained += retained_hits
        return gpu_hits, host_hits, disk_hits

    def _take_gpu_hits(self, req: _Request, matched: list[Block]) -> int:
        """The common case of _take_matched: every matched block is already on GPU."""
        remove = self._gpu.evictable.remove
        released = _S.RELEASED
        pages = req.pages
        for block in matched:
            if block.state is released:
                remove(block)
            block.reuse_count += 1
            block.ref_count += 1
            pages.append(block.gpu_page)  # type: ignore[arg-type]  # set in ON_GPU/RELEASED
        self._move_all(matched, _E.ACQUIRED)
        req.blocks.extend(matched)
        n = len(matched)
        req.num_computed = n * self._block_size
        req.committed = n
        self._counters.hit_blocks_gpu += n
        return n

    def _recall(self, block: Block) -> None:
        """Copy a host-resident block back to a GPU page (also while its spill drains)."""
        page = self._take_gpu_page(self._now)
        host_page = block.host_page
        assert host_page is not None
        self._outbox.append(CopyHostToGpu(block=block.id, host_page=host_page, gpu_page=page))
        block.host_page = None
        block.gpu_page = page
        if block.state is _S.SPILLING:
            # The writer still reads the intact host page: the write finishes on its own and
            # then frees the page and the slot, which no block points at any more.
            assert block.transfer is not None
            self._writes[block.transfer].block = None
            block.disk_slot = None
            block.transfer = None
        else:
            self._host.give_back(host_page)
            if block.state is _S.PREFETCHED:
                # The content leaves the disk as an onboard would: its slot is free again.
                slot = block.disk_slot
                assert slot is not None
                block.disk_slot = None
                self._disk.empty.append(slot)
                self._outbox.append(FreeSlot(slot=slot))
                block.prefetchers.clear()
                self._counters.prefetch_hits += 1
        self._move(block, _E.RECALLED)
        self._counters.host_recalls += 1

    def _take_over_prefetch(self, req: _Request, block: Block) -> None:
        """`req` matched a block whose prefetch read is in flight: it becomes the request's
        onboard (parked until it lands, then copied host -> GPU), with no second read."""
        page = self._take_gpu_page(self._now)
        tid = block.transfer
        assert tid is not None
        self._reads[tid] = self._prefetch_reads.pop(tid)
        block.gpu_page = page
        block.prefetchers.clear()
        self._move(block, _E.ACQUIRED)
        block.waiters.append(req.id)
        req.pending += 1
        c = self._counters
        c.onboards += 1
        c.prefetches_taken_over += 1

    def _start_prefetch(self, block: Block, host_page: PageId) -> None:
        """Read an ON_DISK block (already out of the displacement order) into `host_page`."""
        slot = block.disk_slot
        key = block.key
        assert slot is not None and key is not None
        tid = self._new_transfer()
        self._prefetch_outbox.append(
            PrefetchSlot(transfer=tid, block=block.id, key=key, slot=slot, host_page=host_page)
        )
        self._prefetch_reads[tid] = block
        block.transfer = tid
        block.host_page = host_page
        self._move(block, _E.PREFETCH_STARTED)
        self._counters.prefetches += 1

    def _end_prefetch(self, rid: RequestId, now: float) -> None:
        """The queued request `rid` was admitted or left: it no longer wants its prefetched
        blocks.  A PREFETCHED block nobody else wants goes back to disk only; one whose read
        is in flight keeps its page until the read lands (then goes back the same way)."""
        for block in reversed(self._queued.pop(rid)):
            prefetchers = block.prefetchers
            if rid not in prefetchers:
                continue  # taken by a request, reclaimed or failed meanwhile
            prefetchers.remove(rid)
            if not prefetchers and block.state is _S.PREFETCHED:
                self._prefetched.remove(block)
                self._host.give_back(self._give_up_prefetch(block, now))
                self._counters.prefetches_cancelled += 1

    def _give_up_prefetch(self, block: Block, now: float) -> PageId:
        """PREFETCHED -> ON_DISK (out of every order already): returns its host page, which
        the caller gives back or passes on."""
        page = block.host_page
        assert page is not None
        block.host_page = None
        block.prefetchers.clear()
        self._move(block, _E.PREFETCH_CANCELLED)
        self._disk.file(block, now, self._next_seq())
        return page

    def _start_read(self, req: _Request, block: Block) -> None:
        """Read a disk block back into a GPU page; `req` is parked until it lands."""
        page = self._take_gpu_page(self._now)
        slot = block.disk_slot
        key = block.key
        assert slot is not None and key is not None
        tid = self._new_transfer()
        self._read_outbox.append(
            ReadSlot(transfer=tid, block=block.id, key=key, slot=slot, gpu_page=page)
        )
        self._reads[tid] = block
        block.transfer = tid
        block.gpu_page = page
        self._move(block, _E.READ_STARTED)
        block.waiters.append(req.id)
        req.pending += 1
        self._counters.onboards += 1

    # ------------------------------------------------------------------ giving blocks back

    def _let_go(self, req: _Request, blocks: list[Block]) -> None:
        """`req` stops holding `blocks` (tail first, so tails are evicted first)."""
        rid = req.id
        priority = req.priority
        cached: list[Block] = []
        for block in reversed(blocks):
            state = block.state
            if state is not _S.ON_GPU and rid in block.waiters:
                block.waiters.remove(rid)
            block.ref_count -= 1
            if block.ref_count:
                continue
            block.priority = priority
            if state is _S.ON_GPU:
                if block.key is not None:
                    cached.append(block)
                else:
                    self._discard(block, _E.DISCARDED)
            elif state is _S.ONBOARDING or state is _S.ERROR:
                # ONBOARDING keeps its GPU page until the read lands (then RELEASED); an
                # ERROR block is discarded by the failure handler once nobody holds it.
                pass
            else:
                raise InvariantViolation(f"request {rid!r} held {block!r}")
        if cached:
            self._move_all(cached, _E.RELEASED)
            self._gpu.evictable.push_all(cached, priority)

    def _discard(self, block: Block, event: BlockEvent) -> None:
        """The content leaves the cache: unindex it, free the GPU or host page it still owns.

        Never a disk slot: whoever takes a block off disk (displacement, a landed or failed
        read) frees or passes on its slot first, since only it knows whether a transfer still
        uses the slot.
        """
        if block.disk_slot is not None or block.transfer is not None:
            raise InvariantViolation(f"discarding {block!r} with a disk slot or a transfer")
        self._move(block, event)
        self._unindex(block)
        if block.gpu_page is not None:
            self._gpu.empty.append(block.gpu_page)
        if block.host_page is not None:
            self._host.give_back(block.host_page)
        # Back to a FREE record's defaults.  Holders, waiters and the heap position are
        # already cleared whenever a block is discarded (check_invariants verifies it).
        block.gpu_page = block.host_page = None
        block.expiry = None
        block.reuse_count = block.depth = block.priority = 0
        self._free_records.append(block)

    def _unindex(self, block: Block) -> None:
        """Remove a block from the prefix index (its content is leaving or failing)."""
        key = block.key
        if key is None:
            return
        del self._index[key]
        parent = block.parent_key
        assert parent is not None
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
        else:
            del self._children[parent]
        block.key = block.parent_key = None

    # ------------------------------------------------------------------ finding pages

    def _take_gpu_page(self, now: float) -> PageId:
        """An empty GPU page, evicting the coldest cached block if need be.

        Callers check `obtainable()` first, so a page is always found.
        """
        gpu = self._gpu
        if gpu.empty:
            return gpu.empty.pop()
        victim = gpu.evictable.pop()
        page = victim.gpu_page
        assert page is not None
        victim.gpu_page = None
        c = self._counters
        c.gpu_evictions += 1
        if self._has_host:
            host_page = self._take_host_page(now, for_prefetch=False)
            if host_page is not None:
                self._outbox.append(
                    CopyGpuToHost(block=victim.id, gpu_page=page, host_page=host_page)
                )
                victim.host_page = host_page
                self._move(victim, _E.OFFLOADED)
                self._host.evictable.push(victim)
                c.host_offloads += 1
                return page
            c.offloads_skipped += 1
        self._discard(victim, _E.DROPPED)
        return page

    def _take_host_page(self, now: float, *, for_prefetch: bool) -> PageId | None:
        """A host page for a GPU victim or a prefetch: an empty one, else (for a GPU victim)
        the newest prefetched block's, else from evicting host victims -- or, with
        ``reclaim_prefetched_first`` off, the prefetched page only after the host victims
        yielded none.

        Prefetched pages go first by default because giving one back costs nothing (the
        bytes are still on disk) and a prefetch is only a guess about a request that has not
        run yet.  A victim that spills keeps its page until the write lands; the caller then
        gets a reserved page, or the next victim is tried.  A prefetch never takes another's
        page and evicts at most one host victim: a guess must not spill the whole host tier
        looking for a page (the spill's page comes back when it lands, for the next call).
        None when no page can be had now.
        """
        host = self._host
        if host.empty:
            return host.empty.pop()
        if for_prefetch:
            evictable = host.evictable
            return self._evict_host_victim(evictable.pop(), now) if evictable.size else None
        if self._reclaim_first and self._prefetched.tail is not None:
            return self._reclaim_prefetched(now)
        evictable = host.evictable
        while evictable.size:
            victim = evictable.pop()
            page = self._evict_host_victim(victim, now)
            if page is not None:
                return page
        if self._prefetched.tail is not None:
            return self._reclaim_prefetched(now)
        return None

    def _reclaim_prefetched(self, now: float) -> PageId:
        """The newest prefetched block goes back to disk only; its host page is returned."""
        newest = self._prefetched.tail
        assert newest is not None
        self._prefetched.remove(newest)
        self._counters.prefetches_reclaimed += 1
        return self._give_up_prefetch(newest, now)

    def _evict_host_victim(self, victim: Block, now: float) -> PageId | None:
        """Spill `victim` to disk or drop it; return the host page this frees now, if any."""
        c = self._counters
        page = victim.host_page
        assert page is not None
        if self._has_disk:
            refusal = self._spill_refusal(victim, now)
            if refusal is None:
                self._spill(victim, now)
                host = self._host
                return host.reserved.pop() if host.reserved else None
            if refusal is _Refusal.GATE:
                c.gate_drops += 1
            elif refusal is _Refusal.PRESSURE:
                c.pressure_drops += 1
            elif refusal is _Refusal.ADMISSION:
                c.admission_refusals += 1
            else:
                c.disk_busy_refusals += 1
        c.host_drops += 1
        victim.host_page = None
        self._discard(victim, _E.DROPPED)
        return page

    def _spill_refusal(self, victim: Block, now: float) -> _Refusal | None:
        """Why `victim` may not be spilled now, or None when it may."""
        policies = self._policies
        if not policies.spill.admits(victim, now):
            return _Refusal.GATE
        if policies.pressure.sheds(is_live(victim.expiry, now), len(self._writes)):
            return _Refusal.PRESSURE
        disk = self._disk
        if disk.empty:
            return None
        if disk.next_victim(policies.admission.may_displace_live()) is not None:
            return None
        if disk.next_victim(True) is not None:
            return _Refusal.ADMISSION
        return _Refusal.DISK_BUSY

    def _spill(self, victim: Block, now: float) -> None:
        """Start writing `victim` to a disk slot (displacing the next disk victim if need be)."""
        disk = self._disk
        if disk.empty:
            slot = disk.empty.pop()
        else:
            displaced = disk.next_victim(self._policies.admission.may_displace_live())
            assert displaced is not None
            disk.unfile(displaced)
            slot_of = displaced.disk_slot
            assert slot_of is not None
            slot = slot_of
            displaced.disk_slot = None  # the slot passes straight to the new spill
            self._counters.displacements += 1
            self._discard(displaced, _E.DROPPED)
        host_page = victim.host_page
        key = victim.key
        assert host_page is not None and key is not None
        tid = self._new_transfer()
        self._writes[tid] = _Write(block=victim, host_page=host_page, slot=slot)
        victim.disk_slot = slot
        victim.transfer = tid
        self._move(victim, _E.SPILL_STARTED)
        self._write_outbox.append(
            WriteSlot(
                transfer=tid, block=victim.id, key=key, host_page=host_page, slot=slot,
                retained=is_live(victim.expiry, now), parent=victim.parent_key,
                depth=victim.depth, reuse_count=victim.reuse_count, expiry=victim.expiry,
                issued_at=now,
            )
        )
        self._counters.spills += 1

    # ------------------------------------------------------------------ completions

    def _write_landed(self, write: _Write, now: float) -> None:
        c = self._counters
        c.spills_completed += 1
        c.bytes_written += self._block_bytes
        self._host.give_back(write.host_page)
        block = write.block
        if block is None:
            # Recalled to GPU while the write drained: the bytes in the slot belong to no
            # block any more.
            self._disk.empty.append(write.slot)
            self._outbox.append(FreeSlot(slot=write.slot))
            return
        block.host_page = None
        block.transfer = None
        self._move(block, _E.SPILL_LANDED)
        self._disk.file(block, now, self._next_seq())

    def _write_failed(self, write: _Write) -> None:
        self._counters.spill_failures += 1
        self._disk.empty.append(write.slot)
        self._outbox.append(FreeSlot(slot=write.slot))
        block = write.block
        if block is None:
            self._host.give_back(write.host_page)
            return
        # The bytes are still in the host page: the block stays cached on host.
        block.disk_slot = None
        block.transfer = None
        self._move(block, _E.SPILL_FAILED)
        self._host.evictable.push(block)

    def _prefetch_landed(self, block: Block, now: float) -> None:
        c = self._counters
        c.prefetches_completed += 1
        c.bytes_read += self._block_bytes
        block.transfer = None
        self._move(block, _E.PREFETCH_LANDED)
        if block.prefetchers:
            self._prefetched.append(block)
        else:
            # Every queued request that wanted it left while the read was in flight.
            self._host.give_back(self._give_up_prefetch(block, now))
            c.prefetches_cancelled += 1

    def _prefetch_failed(self, block: Block) -> None:
        """Never serve the bytes: the content leaves the cache (queued requests that wanted
        it will recompute it)."""
        self._counters.prefetch_failures += 1
        slot = block.disk_slot
        assert slot is not None
        block.disk_slot = None
        block.transfer = None
        self._disk.empty.append(slot)
        self._outbox.append(FreeSlot(slot=slot))
        block.prefetchers.clear()
        self._discard(block, _E.PREFETCH_FAILED)

    def _read_landed(self, block: Block) -> None:
        c = self._counters
        c.onboards_completed += 1
        c.bytes_read += self._block_bytes
        host_page = block.host_page
        if host_page is not None:
            # A prefetch taken over by an admitted request: its bytes landed in the host page.
            gpu_page = block.gpu_page
            assert gpu_page is not None
            self._outbox.append(
                CopyHostToGpu(block=block.id, host_page=host_page, gpu_page=gpu_page)
            )
            block.host_page = None
            self._host.give_back(host_page)
        slot = block.disk_slot
        assert slot is not None
        block.disk_slot = None
        block.transfer = None
        self._disk.empty.append(slot)
        self._outbox.append(FreeSlot(slot=slot))
        self._move(block, _E.READ_LANDED)
        requests = self._requests
        for rid in block.waiters:
            req = requests[rid]
            req.pending -= 1
            if req.pending == 0:
                self._parked -= 1
        block.waiters.clear()
        if block.ref_count == 0:
            self._move(block, _E.RELEASED)
            self._gpu.evictable.push(block)

    def _read_failed(self, block: Block) -> None:
        """Never publish the bytes: every waiting request falls back to recompute."""
        c = self._counters
        c.onboard_failures += 1
        if block.host_page is not None:  # a prefetch taken over: its page is never read
            self._host.give_back(block.host_page)
            block.host_page = None
        slot = block.disk_slot
        assert slot is not None
        block.disk_slot = None
        block.transfer = None
        self._disk.empty.append(slot)
        self._outbox.append(FreeSlot(slot=slot))
        self._move(block, _E.READ_FAILED)
        self._unindex(block)
        for rid in list(block.waiters):
            req = self._requests[rid]
            self._rewind(req, req.blocks.index(block))
        if block.ref_count == 0:
            self._discard(block, _E.DISCARDED)

    def _rewind(self, req: _Request, position: int) -> None:
        """Drop `req`'s blocks from `position` on: it recomputes them."""
        was_parked = req.pending > 0
        dropped = req.blocks[position:]
        for block in dropped:
            if req.id in block.waiters:  # ONBOARDING, or the ERROR block being failed
                req.pending -= 1
        del req.blocks[position:]
        del req.pages[position:]
        req.num_computed = min(req.num_computed, position * self._block_size)
        req.committed = min(req.committed, position)
        self._cause = req.id
        try:
            self._let_go(req, dropped)
        finally:
            self._cause = None
        if was_parked and req.pending == 0:
            self._parked -= 1
        self._counters.requests_fallen_back += 1

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Verify every structural invariant; raises InvariantViolation.  Not for the hot path."""
        cfg = self.config
        gpu_owner: dict[PageId, Block | str] = {}
        host_owner: dict[PageId, Block | str] = {}
        slot_owner: dict[SlotId, Block | str] = {}

        def own(table: dict[int, Block | str], item: int, who: Block | str, what: str) -> None:
            if item in table:
                raise InvariantViolation(f"{what} {item} owned by {table[item]!r} and {who!r}")
            table[item] = who

        for page in self._gpu.empty:
            own(gpu_owner, page, "gpu-empty", "GPU page")  # type: ignore[arg-type]
        for page in [*self._host.empty, *self._host.reserved]:
            own(host_owner, page, "host-free", "host page")  # type: ignore[arg-type]
        for slot in self._disk.empty:
            own(slot_owner, slot, "disk-empty", "slot")  # type: ignore[arg-type]
        for tid, write in self._writes.items():
            if write.block is None:
                own(host_owner, write.host_page, f"write {tid}", "host page")  # type: ignore[arg-type]
                own(slot_owner, write.slot, f"write {tid}", "slot")  # type: ignore[arg-type]
            elif write.block.transfer != tid or write.block.state is not _S.SPILLING:
                raise InvariantViolation(f"write {tid} points at {write.block!r}")
        for tid, block in self._reads.items():
            if block.transfer != tid or block.state is not _S.ONBOARDING:
                raise InvariantViolation(f"read {tid} points at {block!r}")
        for tid, block in self._prefetch_reads.items():
            if block.transfer != tid or block.state is not _S.PREFETCHING:
                raise InvariantViolation(f"prefetch {tid} points at {block!r}")
        wanted: dict[int, list[RequestId]] = {}
        for rid, listed in self._queued.items():
            if rid in self._requests:
                raise InvariantViolation(f"request {rid!r} is both admitted and queued")
            for block in listed:
                if rid in block.prefetchers:
                    wanted.setdefault(block.id, []).append(rid)

        counts = [0] * len(BlockState)
        held: dict[int, int] = {}
        waiting: dict[int, list[RequestId]] = {}
        for req in self._requests.values():
            if len(req.pages) != len(req.blocks):
                raise InvariantViolation(f"request {req.id!r}: block table out of step")
            pending = 0
            for i, block in enumerate(req.blocks):
                held[block.id] = held.get(block.id, 0) + 1
                if req.pages[i] != block.gpu_page:
                    raise InvariantViolation(f"request {req.id!r}: page {i} is stale")
                if block.state is _S.ONBOARDING:
                    pending += 1
                    waiting.setdefault(block.id, []).append(req.id)
                elif block.state is not _S.ON_GPU:
                    raise InvariantViolation(f"request {req.id!r} holds {block!r}")
                if block.key is not None and i < len(req.keys) and block.key != req.keys[i]:
                    raise InvariantViolation(f"request {req.id!r}: block {i} has another key")
            if pending != req.pending:
                raise InvariantViolation(
                    f"request {req.id!r}: pending={req.pending}, {pending} blocks in flight"
                )
            if req.num_computed > len(req.blocks) * cfg.block_size:
                raise InvariantViolation(f"request {req.id!r}: computed tokens without pages")
        parked = sum(1 for r in self._requests.values() if r.pending)
        if parked != self._parked:
            raise InvariantViolation(f"parked gauge {self._parked} but {parked} parked")

        gpu_lru = set(map(id, self._gpu.evictable))
        host_lru = set(map(id, self._host.evictable))
        unmarked = set(map(id, self._disk.unmarked))
        retained = set(map(id, self._disk.retained))
        prefetched = set(map(id, self._prefetched))
        free_records = set(map(id, self._free_records))
        if len(free_records) != len(self._free_records):
            raise InvariantViolation("a record is on the free list twice")
        now = self._now
        for block in self._records:
            st = block.state
            counts[st] += 1
            if block.ref_count != held.get(block.id, 0):
                raise InvariantViolation(
                    f"{block!r}: ref_count {block.ref_count}, held {held.get(block.id, 0)}"
                )
            if sorted(block.waiters) != sorted(waiting.get(block.id, [])):
                raise InvariantViolation(f"{block!r}: waiters {block.waiters} disagree")
            if sorted(block.prefetchers) != sorted(wanted.get(block.id, [])):
                raise InvariantViolation(f"{block!r}: prefetchers {block.prefetchers} disagree")
            if block.prefetchers and st not in (_S.PREFETCHING, _S.PREFETCHED):
                raise InvariantViolation(f"{block!r}: wanted by a prefetch in state {st.name}")
            if st is _S.PREFETCHED and not block.prefetchers:
                raise InvariantViolation(f"{block!r}: prefetched for no queued request")
            expect_gpu = st in (_S.ON_GPU, _S.RELEASED, _S.ONBOARDING, _S.ERROR)
            # An ONBOARDING block may own a host page: a prefetch taken over (the page lands
            # the read; the pool accounting below checks that it is not owned twice).
            expect_host = st in (_S.ON_HOST, _S.SPILLING, _S.PREFETCHING, _S.PREFETCHED) or (
                st is _S.ONBOARDING and block.host_page is not None
            )
            expect_slot = st in (_S.SPILLING, _S.ON_DISK, _S.ONBOARDING, _S.PREFETCHING,
                                 _S.PREFETCHED)
            expect_transfer = st in (_S.SPILLING, _S.ONBOARDING, _S.PREFETCHING)
            for what, value, expected in (
                ("gpu_page", block.gpu_page, expect_gpu),
                ("host_page", block.host_page, expect_host),
                ("disk_slot", block.disk_slot, expect_slot),
                ("transfer", block.transfer, expect_transfer),
            ):
                if (value is not None) != expected:
                    raise InvariantViolation(f"{block!r}: {what}={value} in state {st.name}")
            if block.gpu_page is not None:
                own(gpu_owner, block.gpu_page, block, "GPU page")  # type: ignore[arg-type]
            if block.host_page is not None:
                own(host_owner, block.host_page, block, "host page")  # type: ignore[arg-type]
            if block.disk_slot is not None:
                own(slot_owner, block.disk_slot, block, "slot")  # type: ignore[arg-type]
            if (id(block) in free_records) != (st is _S.FREE):
                raise InvariantViolation(f"{block!r}: free list membership wrong")
            if (id(block) in gpu_lru) != (st is _S.RELEASED):
                raise InvariantViolation(f"{block!r}: GPU evictable membership wrong")
            if (id(block) in host_lru) != (st is _S.ON_HOST):
                raise InvariantViolation(f"{block!r}: host evictable membership wrong")
            on_disk = id(block) in unmarked or id(block) in retained
            if on_disk != (st is _S.ON_DISK):
                raise InvariantViolation(f"{block!r}: disk order membership wrong")
            if (id(block) in prefetched) != (st is _S.PREFETCHED):
                raise InvariantViolation(f"{block!r}: prefetched order membership wrong")
            if id(block) in retained and not is_live(block.expiry, now):
                raise InvariantViolation(f"{block!r}: expired but still in the deadline set")
            if id(block) in unmarked and is_live(block.expiry, now):
                raise InvariantViolation(f"{block!r}: live TTL filed as best-effort")
            if st in (_S.RELEASED, _S.ON_HOST, _S.SPILLING, _S.ON_DISK, _S.PREFETCHING,
                      _S.PREFETCHED) and block.key is None:
                raise InvariantViolation(f"{block!r}: cached without a key")
            if st in (_S.FREE, _S.ERROR) and block.key is not None:
                raise InvariantViolation(f"{block!r}: indexed in state {st.name}")
            if st is _S.FREE and (block.heap_pos != -1 or block.expiry is not None
                                  or block.reuse_count or block.waiters or block.prefetchers
                                  or block.prev
                                  or block.next):
                raise InvariantViolation(f"{block!r}: a free record kept old fields")
            if block.key is not None and self._index.get(block.key) is not block:
                raise InvariantViolation(f"{block!r}: key not indexed to it")
            if st is _S.RELEASED and block.ref_count:
                raise InvariantViolation(f"{block!r}: released but held")
            if st is _S.ON_GPU and not block.ref_count:
                raise InvariantViolation(f"{block!r}: on GPU with no holder")
        if counts != self._state_counts:
            raise InvariantViolation(f"state counts {self._state_counts} but found {counts}")
        # Every page and slot has exactly one owner, and nothing else is owned: a lost id
        # or a stray one (None, an id past the pool) is as wrong as a doubly owned one.
        host_total = cfg.host_blocks + cfg.reserved_host_blocks
        for what, owned, total in (("GPU pages", gpu_owner, cfg.gpu_blocks),
                                   ("host pages", host_owner, host_total),
                                   ("slots", slot_owner, cfg.disk_blocks)):
            if owned.keys() != set(range(total)):
                missing = sorted(set(range(total)) - owned.keys())
                stray = [item for item in owned if item not in range(total)]
                raise InvariantViolation(
                    f"{total} {what}: owned {len(owned)}, unowned {missing}, stray {stray}"
                )
        if len(self._host.reserved) > self._host.reserve_target:
            raise InvariantViolation("host reserve above its target")
        if self._host.empty and len(self._host.reserved) < self._host.reserve_target:
            raise InvariantViolation("a free host page sits outside an unfilled reserve")
        children: dict[BlockHash, int] = {}
        for key, block in self._index.items():
            if block.key != key:
                raise InvariantViolation(f"index maps a key to {block!r} with another key")
            assert block.parent_key is not None
            children[block.parent_key] = children.get(block.parent_key, 0) + 1
        if children != self._children:
            raise InvariantViolation("child counts disagree with the index")
        self._gpu.evictable.check()
        self._host.evictable.check()
        self._disk.check()
        self._prefetched.check()
