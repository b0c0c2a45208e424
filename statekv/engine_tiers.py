"""statekv beneath an engine's prefix cache: pinned host and disk tiers of copies, no GPU pool.

An engine such as vLLM has its own paged KV pool and its own prefix cache: it decides which
GPU blocks are hits and which are evicted, and the GPU page ids are its block ids.  Here
statekv keeps no GPU pages at all.  Its tiers -- pinned host pages and disk slots -- hold
*inclusive copies* of full blocks the engine computed, keyed by content exactly as the
serving-loop manager keys them (chained hash of the tokens under the model fingerprint,
``cache_salt`` and LoRA id), with the same eviction cascade (host -> disk spill or drop), the
same displacement order and retention deadlines on disk, and the same restore at open.

The engine asks three things, and this class answers them with no I/O:

* :meth:`EngineTiers.lookup` -- past the blocks the engine already has, how many of a
  prompt's blocks can the tiers supply (host and disk, in one contiguous run), and is
  reading the disk part faster than recomputing it (the cost gate of :mod:`statekv.cost`).
  It changes nothing: an engine may ask again and again.
* :meth:`EngineTiers.start_load` -- the engine allocated pages for them: copy host hits into
  those pages (``CopyHostToEngine``, stream ordered) and read disk hits into them
  (``LoadSlots``, reported back through :meth:`EngineTiers.handle`).  A host copy stays in
  its page and a disk block stays in its slot: the engine's copy is the engine's to evict.
* :meth:`EngineTiers.save` -- a request is done: copy each full block the tiers do not hold
  yet from the engine's page into a host page (``CopyEngineToHost``); blocks already held are
  only stamped with the request's TTL.  The engine must keep those pages until the copies
  have run (the connector reports the save finished).

A request aborted while its disk reads are in flight needs nothing here: each read keeps its
slot until it reports (LOADING, in no displacement order), whoever gave up on it; the engine
must keep the pages it handed out until then (:meth:`EngineTiers.loading`).  A read that
fails takes the content out of the cache at once (no later lookup finds it) and frees its
slot when the last read of it has reported.  The lifecycle rows are those of
``statekv.lifecycle`` ("Beneath an engine").
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from statekv.arith import expiry_after, matchable_blocks
from statekv.block import Block
from statekv.config import CacheConfig, check_now, check_ttl_seconds
from statekv.cost import OnboardCosts, cheapest_cut, check_count, check_measurement
from statekv.disk_tier import DiskTier, RestoredBlock
from statekv.errors import ConfigError, InvariantViolation, UsageError
from statekv.eviction import Eviction
from statekv.ids import RequestId, TransferId
from statekv.invariants import check_invariants
from statekv.lifecycle import BlockEvent, BlockState
from statekv.messages import (
    BatchFinished,
    Command,
    Completion,
    CopyEngineToHost,
    CopyHostToEngine,
    FreeSlot,
    LoadSlot,
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
from statekv.requests import Request, RequestTable
from statekv.stats import CacheStatistics, Counters, snapshot
from statekv.trace import TraceSink

__all__ = ["EngineMatch", "EngineTiers", "LoadPlan", "SaveOutcome"]

WRITE_THROUGH = ("all", "retained", "none")
"""The write-through policies of :class:`EngineTiers`."""

_S = BlockState
_E = BlockEvent
_IN_HOST = (_S.ON_HOST, _S.SPILLING)
_ON_DISK = (_S.ON_DISK, _S.LOADING)


@attrs.frozen(kw_only=True)
class EngineMatch:
    """What the tiers can supply past the engine's own blocks (changes nothing)."""

    start_block: int
    """The first block asked about: the engine's computed tokens / block size."""
    num_blocks: int
    """Blocks to load from `start_block` on (host and disk), after the cost gate."""
    host_blocks: int
    disk_blocks: int
    skipped_disk_blocks: int = 0
    """Blocks the tiers hold past the match that are recomputed instead (the cost gate)."""


@attrs.frozen(kw_only=True)
class LoadPlan:
    """What start_load issued for one request."""

    request_id: RequestId
    host_blocks: int
    """Copied from host pages (stream ordered: done before the engine's next forward)."""
    disk_blocks: int
    """Read from disk: ``transfers`` report through handle()."""
    transfers: tuple[TransferId, ...]
    unavailable_pages: tuple[int, ...] = ()
    """Engine pages whose block the tiers no longer held at start_load (never filled): the
    engine must recompute them."""


@attrs.frozen(kw_only=True)
class SaveOutcome:
    """What save did with a request's full blocks."""

    saved_blocks: int
    """Copied from the engine into host pages (``CopyEngineToHost``)."""
    cached_blocks: int
    """Already held by a tier (only stamped with the TTL)."""
    unsaved_blocks: int
    """Not saved: no host page could be had now (every page busy spilling)."""


@attrs.define(eq=False, slots=True)
class _Load:
    block: Block
    request: RequestId
    failed: bool = False


def _check_pages(field: str, pages: object, count: int | None) -> tuple[int, ...]:
    if isinstance(pages, str | bytes) or not isinstance(pages, Sequence):
        raise UsageError(field, f"must be a sequence of engine page ids, got {pages!r:.80}")
    out = tuple(pages)
    for page in out:
        if isinstance(page, bool) or not isinstance(page, int) or page < 0:
            raise UsageError(field, f"must hold integer page ids >= 0, got {page!r}")
    if len(set(out)) != len(out):
        raise UsageError(field, "names one engine page twice")
    if count is not None and len(out) < count:
        raise UsageError(field, f"{len(out)} pages for {count} blocks")
    return out


class EngineTiers:
    """The host and disk tiers beneath an engine's own GPU pool and prefix cache, sans I/O."""

    def __init__(self, config: CacheConfig, *, trace: TraceSink | None = None,
                 write_through: str = "all") -> None:
        """`write_through`: which saved blocks are written to disk at once, keeping their
        host page -- "all", "retained" (those saved with a TTL), or "none" (a block reaches
        disk only when the host tier evicts it).  What is on disk survives a restart; what
        is only in host memory does not."""
        if write_through not in WRITE_THROUGH:
            raise ConfigError("write_through", f"must be one of {', '.join(WRITE_THROUGH)}, "
                              f"got {write_through!r}")
        self.write_through = write_through
        if not isinstance(config, CacheConfig):
            raise UsageError("config", f"must be a CacheConfig, got {config!r}")
        if config.shared_tier:
            raise ConfigError("shared_tier", "the shared tier is not available beneath an "
                              "engine's prefix cache yet")
        if config.host_blocks + config.reserved_host_blocks == 0:
            raise ConfigError("host_blocks", "beneath an engine every saved block is copied "
                              "into a host page first: the host tier must have pages")
        self.config = config
        self._block_size = config.block_size
        policies = Policies.from_config(config)
        # No GPU pages: the engine's pool is the engine's.  (gpu_blocks still bounds a
        # request's length: the engine cannot hold a longer one.)
        self._gpu = PagePool(0, config.priority_levels)
        self._host = HostPagePool(config.host_blocks, config.reserved_host_blocks,
                                  config.priority_levels)
        nrecords = config.host_blocks + config.reserved_host_blocks + config.disk_blocks
        self._counters = counters = Counters()
        self._outbox = outbox = Outbox()
        self._index = index = PrefixIndex(config.block_size)
        self._requests = requests = RequestTable(config)
        self._records = records = BlockRecords(nrecords, index, self._gpu, self._host, trace)
        self._disk = disk = DiskTier(config, policies, records, index, self._host, outbox,
                                     counters)
        self._eviction = eviction = Eviction(config, policies, records, self._gpu, self._host,
                                             disk, outbox, counters)
        # Only its structures are used (none of its transfers happen here): the invariant
        # check reads them, and they stay empty.
        self._onboarding = Onboarding(config, records, index, requests, eviction, disk, outbox,
                                      counters)
        self._costs = OnboardCosts()
        self._loads: dict[TransferId, _Load] = {}
        self._loading: dict[RequestId, set[TransferId]] = {}
        self._forgotten: set[int] = set()
        """Slots of failed content whose FreeSlot went out while other reads of them were
        still in flight (reused once the last one reports)."""
        self._probe_next = False
        """The gate dropped disk hits PROBE_EVERY times in a row unmeasured: the next match
        reads them anyway (statekv.cost)."""

    # ------------------------------------------------------------------ asking

    def lookup(
        self,
        token_ids: Sequence[int],
        *,
        start_block: int,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> EngineMatch:
        """The blocks from `start_block` on that the tiers can supply, in one run, cut where
        recomputing is cheaper than reading from disk.  Changes nothing."""
        req, start = self._request(token_ids, start_block, cache_salt, lora_id)
        run = self._run(req, start)
        take, skipped = self._gate(req, run)
        taken = run[:take]
        disk = sum(1 for b in taken if b.state in _ON_DISK)
        return EngineMatch(start_block=start, num_blocks=take, host_blocks=take - disk,
                           disk_blocks=disk, skipped_disk_blocks=skipped)

    def loading(self, request_id: str) -> bool:
        """Whether reads into pages the engine gave this request are still in flight."""
        return isinstance(request_id, str) and request_id in self._loading

    # ------------------------------------------------------------------ loading

    def start_load(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        start_block: int,
        engine_pages: Sequence[int],
        now: float,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> LoadPlan:
        """Fill `engine_pages` (one per block from `start_block` on, as many as lookup said)
        from the tiers: host hits are copied, disk hits read.

        A block the tiers stopped holding since lookup (a caller that let other calls in
        between) is not filled: its page is in ``unavailable_pages`` and everything after
        it too, since the engine's computed tokens are a prefix.
        """
        records = self._records
        now = check_now(now, records.now)
        if not isinstance(request_id, str) or not request_id:
            raise UsageError("request_id", f"must be a non-empty string, got {request_id!r}")
        rid = RequestId(request_id)
        if rid in self._loading:
            raise UsageError("request_id", f"request {request_id!r} is loading already")
        req, start = self._request(token_ids, start_block, cache_salt, lora_id)
        pages = _check_pages("engine_pages", engine_pages, None)
        run = self._run(req, start)
        if len(pages) > matchable_blocks(req.num_tokens, self._block_size) - start:
            raise UsageError("engine_pages", f"{len(pages)} pages past block {start}, but "
                             "the prompt has fewer blocks the cache may supply")
        self._advance(now)
        take, skipped = self._gate(req, run)
        if len(pages) < len(run):
            # The engine takes fewer than the tiers hold: the gate's cut (or the engine's
            # own limit).  A gated cut is counted towards the next probe.
            if skipped and len(pages) == take and self._costs.probe_due(True, False):
                self._probe_next = True
        elif self._probe_next and any(b.state in _ON_DISK for b in run):
            self._probe_next = False
            self._counters.cost_probes += 1
        usable = min(len(pages), len(run))
        records.cause = rid
        host_hits = 0
        transfers: list[TransferId] = []
        c = self._counters
        try:
            for i in range(usable):
                block = run[i]
                page = pages[i]
                block.reuse_count += 1
                if block.state in _IN_HOST:
                    host_page = block.host_page
                    assert host_page is not None
                    self._outbox.commands.append(CopyHostToEngine(
                        block=block.id, host_page=host_page, engine_page=page))
                    if block.state is _S.ON_HOST:  # the newest of the host order again
                        evictable = self._host.evictable
                        evictable.remove(block)
                        evictable.push(block)
                    records.move(block, _E.COPIED_OUT)
                    host_hits += 1
                    continue
                if block.state is _S.ON_DISK:
                    self._disk.slots.unfile(block)  # no spill may take the slot under a read
                slot, key = block.disk_slot, block.key
                assert slot is not None and key is not None
                records.move(block, _E.LOAD_STARTED)
                block.ref_count += 1
                tid = self._outbox.new_transfer()
                self._outbox.loads.append(LoadSlot(transfer=tid, block=block.id, key=key,
                                                   slot=slot, engine_page=page))
                self._loads[tid] = _Load(block=block, request=rid)
                transfers.append(tid)
                if block.expiry is not None and block.expiry > now:
                    c.hit_blocks_disk_retained += 1
        finally:
            records.cause = None
        if transfers:
            self._loading[rid] = set(transfers)
            c.onboards += len(transfers)
        c.hit_blocks_host += host_hits
        c.host_recalls += host_hits
        c.hit_blocks_disk += len(transfers)
        c.requests_added += 1
        c.onboards_skipped_as_too_slow += skipped if len(pages) == take else 0
        return LoadPlan(request_id=rid, host_blocks=host_hits, disk_blocks=len(transfers),
                        transfers=tuple(transfers), unavailable_pages=pages[usable:])

    # ------------------------------------------------------------------ saving

    def save(
        self,
        token_ids: Sequence[int],
        *,
        engine_pages: Sequence[int],
        now: float,
        ttl_seconds: float | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> SaveOutcome:
        """Copy the full blocks of `token_ids` (tokens whose KV the engine computed, in its
        pages `engine_pages`, one per block) that the tiers do not hold into host pages;
        stamp every one with ``now + ttl_seconds``.

        Host pages come as for a GPU eviction in the serving-loop cache: an empty page, else
        the coldest host block is spilled (or dropped, by the spill policy).  When no page
        can be had (every page busy spilling) the rest is not saved (counted).
        """
        records = self._records
        now = check_now(now, records.now)
        ttl = self._check_ttl(ttl_seconds)
        req = self._requests.new_record(RequestId("?"), token_ids, cache_salt, lora_id,
                                        None, 0)
        full = req.num_tokens // self._block_size
        pages = _check_pages("engine_pages", engine_pages, full)
        self._advance(now)
        expiry = expiry_after(now, ttl) if ttl else None
        self._index.extend_keys(req, full)
        index = self._index.blocks
        saved = cached = 0
        c = self._counters
        for i in range(full):
            key = req.keys[i]
            known = index.get(key)
            if known is not None:
                cached += 1
                if expiry is not None:
                    self._disk.extend_retention(known, expiry, now)
                continue
            host_page = self._eviction.take_host_page(now, for_prefetch=False)
            if host_page is None:
                break
            block = records.free.pop()
            block.depth = i
            block.host_page = host_page
            block.expiry = expiry
            block.priority = 0
            self._index.add(block, key, req.keys[i - 1] if i else req.root)
            records.move(block, _E.SAVED)
            if self._writes_through(block, now):
                self._disk.spill(block, now, keep_host=True)
            else:
                self._host.evictable.push(block)
            self._outbox.commands.append(CopyEngineToHost(
                block=block.id, engine_page=pages[i], host_page=host_page))
            saved += 1
        unsaved = full - saved - cached
        c.host_offloads += saved
        c.offloads_skipped += unsaved
        return SaveOutcome(saved_blocks=saved, cached_blocks=cached, unsaved_blocks=unsaved)

    # ------------------------------------------------------------------ completions

    def handle(self, event: Completion, *, now: float) -> None:
        """Feed back a completion of a disk write (spill) or read (load), or a batch of them.
        A batch is checked whole before any of it is applied."""
        now = check_now(now, self._records.now)
        items: tuple[TransferOutcome, ...]
        if isinstance(event, BatchFinished):
            items = event.outcomes
            if not isinstance(items, tuple) or not items:
                raise UsageError("event", f"a batch needs at least one outcome: {event!r}")
            if len({item.transfer for item in items}) != len(items):
                raise UsageError("event", "a batch names one transfer twice")
        else:
            items = (event,)
        for item in items:
            self._check_outcome(item)
        self._advance(now)
        for item in items:
            if isinstance(item, SlotWritten | SlotWriteFailed):
                write = self._disk.writes.pop(item.transfer)
                if isinstance(item, SlotWritten):
                    self._disk.write_landed(write, now)
                else:
                    self._disk.write_failed(write)
            else:
                self._load_done(item, now)

    def _check_outcome(self, event: object) -> None:
        if isinstance(event, SlotWritten | SlotWriteFailed):
            if event.transfer not in self._disk.writes:
                raise UsageError("transfer", f"no write {event.transfer} is in flight")
        elif isinstance(event, SlotRead | SlotReadFailed):
            if event.transfer not in self._loads:
                raise UsageError("transfer", f"no load {event.transfer} is in flight")
        else:
            raise UsageError("event", f"not a completion: {event!r}")

    def _load_done(self, event: SlotRead | SlotReadFailed, now: float) -> None:
        load = self._loads.pop(event.transfer)
        block = load.block
        waiting = self._loading[load.request]
        waiting.discard(event.transfer)
        if not waiting:
            del self._loading[load.request]
        c = self._counters
        records = self._records
        records.cause = load.request
        try:
            if isinstance(event, SlotReadFailed):
                c.onboard_failures += 1
                c.requests_fallen_back += 1
                # Never served again: out of the index now, even while other reads of the
                # slot are in flight (they keep the record, and the slot, until they report).
                self._index.remove(block)
                for other in self._loads.values():
                    if other.block is block:
                        other.failed = True
                load.failed = True
                slot = block.disk_slot
                if block.ref_count > 1 and slot is not None and slot not in self._forgotten:
                    # Other reads keep the slot until they report, but a restart meanwhile
                    # must not find the content: the store forgets it now (the bytes stay
                    # for the reads in flight; the slot is reused only once they reported).
                    self._outbox.commands.append(FreeSlot(slot=slot))
                    self._forgotten.add(slot)
            else:
                c.onboards_completed += 1
                c.bytes_read += self.config.block_bytes
            block.ref_count -= 1
            if block.ref_count:
                return
            if load.failed or block.key is None:
                slot = block.disk_slot
                assert slot is not None
                block.disk_slot = None
                if slot in self._forgotten:
                    self._forgotten.discard(slot)
                    self._disk.slots.empty.append(slot)   # its FreeSlot went out already
                else:
                    self._disk.free_slot(slot)
                records.discard(block, _E.LOAD_FAILED)
            else:
                records.move(block, _E.LOAD_LANDED)
                self._disk.file(block, now)
        finally:
            records.cause = None

    # ------------------------------------------------------------------ measurements

    def report_disk_read(self, num_bytes: int, seconds: float) -> None:
        """A batch of `num_bytes` was read from disk in `seconds`: the read-rate estimate."""
        nbytes = check_count("num_bytes", num_bytes, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        self._costs.observe_read(nbytes, secs)
        self._probe_next = False

    def report_prefill(self, num_tokens: int, seconds: float, *, context_tokens: int) -> None:
        """The engine computed `num_tokens` in `seconds` (one forward pass), its longest
        context ending at `context_tokens`: the prefill-rate estimate."""
        ntok = check_count("num_tokens", num_tokens, low=1)
        secs = check_measurement("seconds", seconds, positive=True)
        ctx = check_count("context_tokens", context_tokens, low=1)
        self._costs.observe_prefill(ntok, secs, ctx)

    def cost_estimates(self) -> tuple[float | None, float | None]:
        """(disk bytes per second, prefill seconds per token at the longest context seen)."""
        costs = self._costs
        return costs.disk_bytes_per_second, costs.prefill_seconds_per_token(1 << 30)

    # ------------------------------------------------------------------ the rest

    def restore(self, blocks: Sequence[RestoredBlock], *, now: float) -> None:
        """Adopt blocks an earlier process left on disk (as KVCacheManager.restore: only on a
        tier that has done nothing yet; everything validated before anything changes)."""
        now = check_now(now, self._records.now)
        disk = self._disk
        if (self._index.blocks or disk.writes or self._loads
                or len(disk.slots.empty) != self.config.disk_blocks):
            raise UsageError("restore", "only a fresh cache can restore blocks from disk")
        slots = disk.check_restore(blocks)
        self._advance(now)
        disk.restore(blocks, slots, now)

    def advance(self, now: float) -> None:
        """Tell the tiers the time: TTLs that ran out stop protecting their content."""
        self._advance(check_now(now, self._records.now))

    def take_commands(self) -> list[Command]:
        """Everything the worker must do, in order (statekv.messages); the outbox empties."""
        return self._outbox.take(self.config.max_batch_blocks)

    def cached_keys(self) -> dict[bytes, BlockState]:
        """Every indexed block's key and state: for tests and debugging."""
        return {key: block.state for key, block in self._index.blocks.items()}

    def statistics(self) -> CacheStatistics:
        records, disk = self._records, self._disk
        counts = records.state_counts
        return snapshot(
            self._counters, block_size=self._block_size, parked_requests=len(self._loading),
            writes_in_flight=len(disk.writes), reads_in_flight=len(self._loads),
            prefetch_reads_in_flight=0, prefetched_blocks=0, prefetching_requests=0,
            fetches_in_flight=0, cached_blocks=len(self._index.blocks), gpu_free_pages=0,
            gpu_evictable_blocks=0, host_free_pages=len(self._host.empty),
            host_reserved_pages=len(self._host.reserved),
            host_cached_blocks=self._host.evictable.size,
            disk_empty_slots=len(disk.slots.empty),
            disk_cached_blocks=counts[_S.ON_DISK] + counts[_S.LOADING],
            disk_retained_blocks=len(disk.slots.retained),
            disk_copy_blocks=0, host_copy_pages=0,
            blocks_by_state=tuple((s.name, counts[s]) for s in BlockState),
        )

    def check_invariants(self) -> None:
        """Verify every structural invariant; raises InvariantViolation.  Not for the hot path."""
        loads = {tid: load.block for tid, load in self._loads.items()}
        check_invariants(self.config, self._records, self._index, self._requests,
                         self._eviction, self._disk, self._onboarding, loads=loads)
        for rid, tids in self._loading.items():
            for tid in tids:
                if self._loads[tid].request != rid:
                    raise InvariantViolation(f"load {tid} is not {rid!r}'s")

    # ------------------------------------------------------------------ internals

    def _request(self, token_ids: Sequence[int], start_block: object, cache_salt: str | None,
                 lora_id: int | None) -> tuple[Request, int]:
        req = self._requests.new_record(RequestId("?"), token_ids, cache_salt, lora_id,
                                        None, 0)
        if isinstance(start_block, bool) or not isinstance(start_block, int) or start_block < 0:
            raise UsageError("start_block", f"must be an integer >= 0, got {start_block!r}")
        return req, start_block

    def _run(self, req: Request, start: int) -> list[Block]:
        """The indexed blocks from `start` on, up to the first one the tiers lack."""
        limit = matchable_blocks(req.num_tokens, self._block_size)
        if start >= limit:
            return []
        self._index.extend_keys(req, limit)
        get = self._index.blocks.get
        run: list[Block] = []
        for key in req.keys[start:limit]:
            block = get(key)
            if block is None:
                break
            run.append(block)
        return run

    def _gate(self, req: Request, run: list[Block]) -> tuple[int, int]:
        """(blocks to take, disk blocks skipped) for `run` under the cost gate."""
        costs = self._costs
        if not self.config.cost_aware_onboarding or self._probe_next or not run:
            return len(run), 0
        disk_rate = costs.disk_bytes_per_second
        per_token = costs.prefill_seconds_per_token(req.num_tokens)
        if disk_rate is None or per_token is None:
            return len(run), 0
        kinds = [1 if b.state in _ON_DISK else 0 for b in run]
        if 1 not in kinds:
            return len(run), 0
        best = cheapest_cut(kinds, block_bytes=self.config.block_bytes,
                            block_size=self._block_size, disk_rate=disk_rate, net_rate=None,
                            per_token=per_token)
        return best, sum(kinds[best:])

    def _writes_through(self, block: Block, now: float) -> bool:
        policy = self.write_through
        if policy == "none" or not self.config.disk_blocks:
            return False
        if policy == "retained" and not (block.expiry is not None and block.expiry > now):
            return False
        return self._disk.spill_refusal(block, now) is None

    def _check_ttl(self, ttl: object) -> float | None:
        return check_ttl_seconds(ttl, self.config.max_ttl_seconds)

    def _advance(self, now: float) -> None:
        self._records.now = now
        if self.config.disk_blocks:
            self._disk.expire(now)
