"""An executable reference model of the cache manager's observable behaviour.

This is the specification in code: small, slow and obviously correct.  It keeps cached
content in one dict and chooses every victim by a full scan with an explicit sort key, where
the real manager (``statekv.manager``) uses intrusive lists, bitmasks and an indexed heap.
The fuzz suite drives both with the same operations and compares what a caller can observe:
prefix matches by tier, readiness, computed-token counts, which content is cached on which
tier, the keys of reads and writes issued, and every counter of ``statistics()``.

What the model pins down (REQUIREMENTS sections 1-5, 10):

* Matching: the longest prefix of the request's full blocks (never its last token) found in
  the cache on any tier; GPU hits are shared, host hits copied up, disk hits read back (the
  request is parked until they land).
* GPU victims: no holder, lowest priority first, least recently released first.  A victim
  with reusable content moves to host if a host page can be had, else it is dropped.
* Host victims: lowest priority first, least recently offloaded first.  A victim is spilled
  if the spill mode admits it, the pressure gate does not shed it and the disk admits it;
  else it is dropped.  A spill hands back a reserved page when one is left.
* Disk: an empty slot first, then best-effort content in the order it became best-effort,
  then (unless protect_unexpired) retained content by (expiry, deeper first, first in).
* Retention: releasing a request with ttl_seconds stamps its full blocks (or, for a private
  duplicate, the cached twin) with max(current stamp, now + ttl); content is retained while
  now < expiry.  A stamp that lengthens the deadline of a block with a disk slot (on disk,
  spilling, being read) emits PersistRetention.
* Inclusive disk tier: a disk read that lands, and a host hit on a prefetched block, leave
  the slot holding the content: the block has a *disk copy* while it is on GPU or host,
  filed in the disk order as disk content of its retention class (it expires there, a
  lengthened deadline re-files it and emits PersistRetention).  Evicting a block with a
  copy (from host, or from GPU with no host page) makes it disk content again with no write
  (spills_saved_by_disk_copy); a spill that displaces a copy takes only the copy (the block
  stays where it is).  A copy is a disk candidate even while its block is matched.
* Inclusive host tier: a host hit (on host, or prefetched) leaves its host page holding the
  content as the block's *host copy* while it is on GPU -- unless the spill reserve is short,
  which the page then refills.  A host copy's page counts as free: a page is taken from the
  empty ones first, then from the oldest host copy (the copy is forgotten), before anything
  is evicted.  A GPU victim with a host copy moves to host onto it with no copy
  (offloads_saved_by_host_copy); a write-through of GPU content with a host copy writes from
  that page; a publish at release offers it from that page.
* Prefetch: a queued request's matched disk blocks are read into host pages, in prefix order,
  each page an empty one or the page evicting one host victim yields (a drop's, or a reserved
  one for a spill), never another prefetch's; a block whose page cannot be had goes back to
  the end of the disk order, and the prefetch stops there.
  A prefetched block keeps its slot; it is a host hit for the request that is admitted, an
  onboard for one admitted while its read is in flight, and goes back to disk when every
  queued request that wanted it left, or when a GPU victim needs a host page (newest
  prefetched first; before any host victim is evicted, or, with reclaim_prefetched_first
  off, only when evicting host victims yielded no page).  A failed prefetch drops the content.
* Cost-aware onboarding: with a disk read rate and a prefill time per token (moving averages
  of what was reported, the latter by power-of-two bucket of context length, nearest bucket),
  the match ends at the start of the disk run that minimises reads before it plus a prefill
  of every matched token after it, if that beats reading every disk hit.
* The shared tier (``shared_tier``): past the local match, the leading blocks whose keys the
  caller says the shared tier holds (a key cached locally ends the run) are fetched, each
  into a new block with a GPU page, parked like a disk read; a failed fetch is dropped and
  every request holding it recomputes from it.  The cost cut counts the remote run as one
  more run of paid blocks (at the fetch rate).  A GPU victim offloaded to host is offered
  for publishing (right after its copy) when the spill mode admits it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from statekv.arith import expiry_after, is_live
from statekv.config import CacheConfig, SpillMode
from statekv.errors import OutOfBlocks, UsageError
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.ids import BlockHash
from statekv.lifecycle import BlockState
from statekv.manager import CachedBlock, RestoredBlock
from statekv.stats import CacheStatistics

GPU, HOST, SPILLING, DISK, READING = "gpu", "host", "spilling", "disk", "reading"
PREFETCHING, PREFETCHED = "prefetching", "prefetched"
FETCHING = "fetching"
SMOOTHING = 0.25
PROBE_EVERY = 16
"""Gated requests in a row, without a new measurement of the tier, before one reads anyway."""

TIER_OF_STATE = {
    BlockState.ON_GPU: GPU,
    BlockState.RELEASED: GPU,
    BlockState.ON_HOST: HOST,
    BlockState.SPILLING: SPILLING,
    BlockState.ON_DISK: DISK,
    BlockState.ONBOARDING: READING,
    BlockState.PREFETCHING: PREFETCHING,
    BlockState.PREFETCHED: PREFETCHED,
    BlockState.FETCHING: FETCHING,
}
"""The model's tier of each state a cached block of the real core can be in."""


CommandKind = tuple[str, "BlockHash | tuple[BlockHash, ...] | None"]


def in_batches(
    commands: Iterable[tuple[str, BlockHash | None]], max_batch_blocks: int
) -> list[CommandKind]:
    """How the core emits a take's commands (statekv.messages, "Batches"): copies and
    FreeSlots in order, then the writes, then the reads, each packed into batches of at most
    `max_batch_blocks`, named by kind and their keys in order; only disk transfers keep keys."""
    others: list[CommandKind] = []
    disk: dict[str, list[BlockHash]] = {"WriteSlot": [], "ReadSlot": [], "PrefetchSlot": [],
                                        "FetchBlock": []}
    for kind, key in commands:
        if kind in disk:
            assert key is not None
            disk[kind].append(key)
        else:
            others.append((kind, None))
    for kind, keys in disk.items():
        others.extend(
            (kind + "s", tuple(keys[i : i + max_batch_blocks]))
            for i in range(0, len(keys), max_batch_blocks)
        )
    return others


def block_keys(tokens: Sequence[int], block_size: int, *,
               salt: str | None = None, fingerprint: str = "") -> list[BlockHash]:
    """The chained keys of the full blocks of `tokens`."""
    key = root_key(fingerprint, salt, None)
    keys = []
    for i in range(len(tokens) // block_size):
        key = chain_key(key, token_bytes(tokens[i * block_size:(i + 1) * block_size]))
        keys.append(key)
    return keys


def observed(
    blocks: Iterable[CachedBlock],
) -> dict[BlockHash, tuple[str, int, int, float | None, bool, bool]]:
    """The real core's `cached_blocks()` in the form of :meth:`ReferenceCache.cached`."""
    return {b.key: (TIER_OF_STATE[b.state], b.ref_count, b.reuse_count, b.expiry,
                    b.has_disk_copy, b.has_host_copy)
            for b in blocks}


@attrs.define(eq=False)
class MBlock:
    """A block of the model: cached content (key set) or private to one request."""

    key: BlockHash | None
    depth: int
    tier: str = GPU
    holders: int = 0
    waiters: list[str] = attrs.field(factory=list)
    reuse: int = 0
    expiry: float | None = None
    priority: int = 0
    stamp: int = 0
    """Order within its tier's eviction order (or disk best-effort order)."""
    retained_key: tuple[float, int, int] | None = None
    """Set while on disk with a running TTL."""
    failed: bool = False
    prefetchers: list[str] = attrs.field(factory=list)
    host_page: bool = False
    """READING with a host page: a prefetch an admitted request took over."""
    copy: bool = False
    """On GPU or host and also in a disk slot (a valid disk copy, filed in the disk order)."""
    disk_stamp: int = 0
    """Order in the disk best-effort order (on disk, or a copy)."""
    published: bool = False
    """Offered to the shared tier since it was cached."""
    host_copy: bool = False
    """On GPU and also in a host page (counted in host_free: taking the page forgets it)."""
    host_copy_stamp: int = 0
    """When the host copy was made (the oldest is forgotten first)."""


@attrs.define(eq=False)
class MRequest:
    rid: str
    tokens: list[int]
    root: BlockHash
    ttl: float | None
    priority: int
    blocks: list[MBlock] = attrs.field(factory=list)
    num_computed: int = 0
    committed: int = 0
    pending: int = 0

    def key(self, i: int, block_size: int) -> BlockHash:
        key = self.root
        for j in range(i + 1):
            key = chain_key(key, token_bytes(self.tokens[j * block_size:(j + 1) * block_size]))
        return key


@attrs.frozen
class MatchResult:
    matched_tokens: int
    gpu_tokens: int
    host_tokens: int
    disk_tokens: int
    ready: bool
    skipped_disk_tokens: int = 0
    remote_tokens: int = 0
    skipped_remote_tokens: int = 0


class ReferenceCache:
    """The reference model.  Methods mirror KVCacheManager's; commands are (kind, key)."""

    def __init__(self, config: CacheConfig) -> None:
        self.cfg = config
        self.bs = config.block_size
        self.entries: dict[BlockHash, MBlock] = {}
        self.requests: dict[str, MRequest] = {}
        self.private: list[MBlock] = []  # held private blocks (and failed ones being dropped)
        self.gpu_free = config.gpu_blocks
        self.host_free = config.host_blocks
        self.reserved = config.reserved_host_blocks
        self.disk_empty = config.disk_blocks
        self.writes: dict[int, MBlock | None] = {}
        # Write-throughs (retention_write_through): writes that keep their block on host,
        # and staged writes of GPU content (no block; the key and the deadline written).
        self.keep_host: set[int] = set()
        self.staged: dict[int, tuple[BlockHash, float | None, int, int]] = {}
        self.wt_backlog: dict[BlockHash, None] = {}
        self.wt_retries = True
        self.reads: dict[int, MBlock] = {}
        self.prefetch_reads: dict[int, MBlock] = {}
        self.fetches: dict[int, MBlock] = {}
        self.net_rate: float | None = None
        self.queued: dict[str, list[MBlock]] = {}
        self.disk_rate: float | None = None
        self.prefill: dict[int, float] = {}
        # Gated requests since each tier was last measured (a probe reads at PROBE_EVERY).
        self.disk_drops = 0
        self.net_drops = 0
        self.next_transfer = 0
        self.last_prefetch = (0, 0, 0, 0)
        self.counter = 0
        self.now = -math.inf
        self.commands: list[tuple[str, BlockHash | None]] = []
        self.protected: set[int] = set()
        self.c: dict[str, int] = {
            name: 0 for name in (
                "requests_added", "prefix_cache_queries", "requests_released",
                "requests_parked",
                "requests_fallen_back", "hit_blocks_gpu", "hit_blocks_host", "hit_blocks_disk",
                "hit_blocks_disk_retained",
                "gpu_evictions", "host_offloads", "host_recalls", "offloads_skipped",
                "host_copies_kept", "offloads_saved_by_host_copy",
                "host_drops", "spills", "spills_completed", "spill_failures", "bytes_written",
                "spills_saved_by_disk_copy",
                "onboards", "onboards_completed", "onboard_failures", "bytes_read",
                "gate_drops", "pressure_drops", "admission_refusals", "disk_busy_refusals",
                "displacements", "expirations", "restored_blocks",
                "prefetches", "prefetches_completed", "prefetch_failures", "prefetch_hits",
                "prefetches_taken_over", "prefetches_cancelled", "prefetches_reclaimed",
                "onboards_skipped_as_too_slow", "cost_probes",
                "hit_blocks_remote", "fetches", "fetches_completed", "fetch_failures",
                "bytes_fetched", "fetches_skipped_as_too_slow", "publishes_offered",
                "publishes_not_admitted", "write_throughs", "write_throughs_skipped",
                "write_throughs_retried",
            )
        }

    # ------------------------------------------------------------------ helpers

    def _stamp(self) -> int:
        self.counter += 1
        return self.counter

    def _check_now(self, now: float) -> None:
        if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            raise UsageError("now", "not finite")
        if now < self.now:
            raise UsageError("now", "clock went backwards")

    def _advance(self, now: float) -> None:
        self.now = now
        expired = sorted(
            (b for b in self.entries.values()
             if (b.tier == DISK or b.copy) and b.retained_key is not None
             and not is_live(b.expiry, now)),
            key=lambda b: b.retained_key or (0.0, 0, 0),
        )
        for b in expired:
            b.retained_key = None
            b.disk_stamp = self._stamp()
        self.c["expirations"] += len(expired)

    def _request(self, rid: str) -> MRequest:
        if rid not in self.requests:
            raise UsageError("request_id", "unknown")
        return self.requests[rid]

    def _candidates(self, tier: str) -> list[MBlock]:
        return [b for b in self.entries.values()
                if b.tier == tier and id(b) not in self.protected
                and (tier != GPU or b.holders == 0)]

    def _take_free_host(self) -> bool:
        """A page free without evicting anything: an empty one, else the oldest host copy's
        (forgotten).  host_free counts both."""
        if not self.host_free:
            return False
        copies = [b for b in self.entries.values() if b.host_copy]
        if self.host_free == len(copies):  # no empty page: the oldest copy's
            min(copies, key=lambda b: b.host_copy_stamp).host_copy = False
        self.host_free -= 1
        return True

    def _keep_host_copy(self, b: MBlock) -> None:
        """`b` was recalled to GPU from a host page: the page refills the reserve if it is
        short, else it stays `b`'s host copy (free, but remembering the bytes)."""
        if self.reserved < self.cfg.reserved_host_blocks:
            self.reserved += 1
            return
        self.host_free += 1
        b.host_copy = True
        b.host_copy_stamp = self._stamp()
        self.c["host_copies_kept"] += 1

    def _give_back_host(self) -> None:
        if self.reserved < self.cfg.reserved_host_blocks:
            self.reserved += 1
        else:
            self.host_free += 1

    def _drop(self, b: MBlock) -> None:
        assert b.key is not None and not b.copy and not b.host_copy
        del self.entries[b.key]

    def gpu_obtainable(self) -> int:
        return self.gpu_free + len([b for b in self.entries.values()
                                    if b.tier == GPU and b.holders == 0])

    # ------------------------------------------------------------------ pages

    def _take_gpu_page(self) -> None:
        if self.gpu_free:
            self.gpu_free -= 1
            return
        victim = min(self._candidates(GPU), key=lambda b: (b.priority, b.stamp))
        self.c["gpu_evictions"] += 1
        if victim.host_copy:  # onto its host copy: no copy
            victim.host_copy = False
            self.host_free -= 1
            victim.tier = HOST
            victim.stamp = self._stamp()
            self.c["host_offloads"] += 1
            self.c["offloads_saved_by_host_copy"] += 1
            if self.cfg.shared_tier and not (victim.published and self._publish_on_release):
                self._offer_publish(victim)
            return
        has_host = self.cfg.host_blocks + self.cfg.reserved_host_blocks > 0
        if has_host:
            if self._take_host_page():
                self.commands.append(("CopyGpuToHost", victim.key))
                victim.tier = HOST
                victim.stamp = self._stamp()
                self.c["host_offloads"] += 1
                if self.cfg.shared_tier and not (victim.published and self._publish_on_release):
                    self._offer_publish(victim)
                return
            self.c["offloads_skipped"] += 1
        if victim.copy:
            self._keep_copy(victim)
        else:
            self._drop(victim)

    @property
    def _publish_on_release(self) -> bool:
        return self.cfg.shared_tier and self.cfg.publish_on == "release"

    def _offer_publish(self, b: MBlock) -> None:
        if self._spill_mode_admits(b):
            self.commands.append(("PublishBlock", b.key))
            self.c["publishes_offered"] += 1
            b.published = True
        else:
            self.c["publishes_not_admitted"] += 1

    def _publish_released(self, req: MRequest) -> None:
        """publish_on="release": the request's committed content is offered now, in prefix
        order, once while it stays cached: from its host page (on host, or spilling), or
        copied from GPU into a free host page (given back at once); else at its eviction."""
        for i in range(req.committed):
            b = req.blocks[i]
            t = b if b.key is not None else self.entries.get(req.key(i, self.bs))
            if t is None or t.published:
                continue
            if t.tier in (HOST, SPILLING):
                self._offer_publish(t)
            elif t.tier == GPU and t.host_copy:
                self._offer_publish(t)  # from its host copy
            elif t.tier == GPU and self._take_free_host():
                self.commands.append(("CopyGpuToHost", t.key))
                self._offer_publish(t)
                self._give_back_host()  # (to the reserve first, as any page given back)

    def _keep_copy(self, b: MBlock) -> None:
        """Evicted with a valid disk copy: disk content again, at its place, no write."""
        b.tier = DISK
        b.copy = False
        self.c["spills_saved_by_disk_copy"] += 1

    def _file_on_disk(self, b: MBlock) -> None:
        """`b` (re)enters the disk order now, as the newest of its class."""
        b.tier = DISK
        self._file(b)

    def _file(self, b: MBlock) -> None:
        """`b`'s slot (its content on disk, or its disk copy) is filed now, newest of its
        class."""
        stamp = self._stamp()
        if is_live(b.expiry, self.now):
            assert b.expiry is not None
            b.retained_key = (b.expiry, -b.depth, stamp)
        else:
            b.retained_key = None
            b.disk_stamp = stamp

    def _give_up_prefetch(self, b: MBlock) -> None:
        b.prefetchers.clear()
        self._file_on_disk(b)

    def _reclaim(self) -> bool:
        prefetched = self._candidates(PREFETCHED)
        if not prefetched:
            return False
        self._give_up_prefetch(max(prefetched, key=lambda b: b.stamp))
        self.c["prefetches_reclaimed"] += 1
        return True

    def _take_host_page(self, for_prefetch: bool = False) -> bool:
        if self._take_free_host():
            return True
        if for_prefetch:  # one host victim at most, never a prefetched page
            candidates = self._candidates(HOST)
            return bool(candidates) and self._evict_host_victim(
                min(candidates, key=lambda b: (b.priority, b.stamp)))
        if self.cfg.reclaim_prefetched_first and self._reclaim():
            return True
        while True:
            candidates = self._candidates(HOST)
            if not candidates:
                return self._reclaim()
            victim = min(candidates, key=lambda b: (b.priority, b.stamp))
            if self._evict_host_victim(victim):
                return True

    def _disk_victim(self, may_displace_live: bool) -> MBlock | None:
        disk = self._candidates(DISK) + [b for b in self.entries.values() if b.copy]
        best_effort = [b for b in disk if b.retained_key is None]
        if best_effort:
            return min(best_effort, key=lambda b: b.disk_stamp)
        retained = [b for b in disk if b.retained_key is not None]
        if retained and may_displace_live:
            return min(retained, key=lambda b: b.retained_key or (0.0, 0, 0))
        return None

    def _spill_mode_admits(self, v: MBlock) -> bool:
        cfg = self.cfg
        if cfg.spill_mode is SpillMode.ALL:
            return True
        if cfg.spill_mode is SpillMode.RETAINED_ONLY:
            return is_live(v.expiry, self.now)
        return v.reuse >= cfg.spill_min_reuse

    def _evict_host_victim(self, v: MBlock) -> bool:
        now = self.now
        if v.copy:
            self._keep_copy(v)
            return True
        if self.cfg.disk_blocks and v.key in {key for key, *_ in self.staged.values()}:
            # Its write-through is in flight: dropped, on disk when that write lands.
            self.c["host_drops"] += 1
            self._drop(v)
            return True
        if self.cfg.disk_blocks:
            # Best-effort content never displaces content whose TTL is running.
            live_ok = not self.cfg.protect_unexpired and is_live(v.expiry, now)
            refusal = self._refusal(v)
            if refusal is None:
                self._spill(v, live_ok)
                if self.reserved:
                    self.reserved -= 1
                    return True
                return False
            self.c[refusal] += 1
        self.c["host_drops"] += 1
        self._drop(v)
        return True

    def _refusal(self, v: MBlock) -> str | None:
        """Why host victim (or write-through of) `v` may not be written now, or None."""
        cfg, now = self.cfg, self.now
        live_ok = not cfg.protect_unexpired and is_live(v.expiry, now)
        if not self._spill_mode_admits(v):
            return "gate_drops"
        if (cfg.drop_on_pressure and not is_live(v.expiry, now)
                and len(self.writes) >= cfg.write_queue_depth):
            return "pressure_drops"
        if self.disk_empty or self._disk_victim(live_ok) is not None:
            return None
        if self._disk_victim(True) is not None:
            return "admission_refusals"
        return "disk_busy_refusals"

    def _write_through(self, req: MRequest) -> None:
        """Released with a TTL: its retained content with no disk copy is written now, in
        prefix order, and stays where it is -- from host keeping the page, from GPU through
        a staging host page (its host copy's, else one taken as for a GPU victim); each only
        if the disk admits it and fewer than write_queue_depth writes are in flight.  What
        is skipped joins the backlog, retried oldest first after every write completes."""
        for i in range(req.committed):
            b = req.blocks[i]
            t = b if b.key is not None else self.entries.get(req.key(i, self.bs))
            if t is not None and self._write_through_one(t) == "skipped":
                self.c["write_throughs_skipped"] += 1
                assert t.key is not None
                self.wt_backlog[t.key] = None

    def stop_write_through_retries(self) -> None:
        """A close began: the backlog is dropped, and nothing is retried from now on."""
        self.wt_retries = False
        self.wt_backlog.clear()

    def _retry_write_throughs(self) -> None:
        if not self.wt_retries:
            return
        for key in list(self.wt_backlog):
            t = self.entries.get(key)
            outcome = "ignored" if t is None else self._write_through_one(t)
            if outcome == "skipped":
                if len(self.writes) >= self.cfg.write_queue_depth:
                    return
                continue
            del self.wt_backlog[key]
            if outcome == "written":
                self.c["write_throughs_retried"] += 1

    def _write_through_one(self, t: MBlock) -> str:
        now = self.now
        staged_keys = {key for key, *_ in self.staged.values()}
        if t.copy or not is_live(t.expiry, now) or t.key in staged_keys:
            return "ignored"
        if t.tier not in (GPU, HOST):
            return "ignored"
        if len(self.writes) >= self.cfg.write_queue_depth:
            return "skipped"
        live_ok = not self.cfg.protect_unexpired and is_live(t.expiry, now)
        if t.tier == HOST:
            if self._refusal(t) is not None:
                return "skipped"
            self._spill(t, live_ok)
            self.keep_host.add(self.next_transfer)
            self.c["write_throughs"] += 1
            return "written"
        # Never the last host page a GPU victim could have.
        if (self.host_free + len(self._candidates(HOST)) + len(self._candidates(PREFETCHED))
                < 2):
            return "skipped"
        if t.host_copy:  # its host copy is the staging page: no copy to make
            if self._refusal(t) is not None:
                return "skipped"
            t.host_copy = False
            self.host_free -= 1
        else:
            if not self._take_host_page():
                return "skipped"
            if self._refusal(t) is not None:
                self._give_back_host()
                return "skipped"
            self.commands.append(("CopyGpuToHost", t.key))
        self._take_slot(live_ok)
        self.next_transfer += 1
        self.writes[self.next_transfer] = None
        assert t.key is not None
        self.staged[self.next_transfer] = (t.key, t.expiry, t.depth, t.reuse)
        self.commands.append(("WriteSlot", t.key))
        self.c["spills"] += 1
        self.c["write_throughs"] += 1
        return "written"

    def _take_slot(self, live_ok: bool) -> None:
        if self.disk_empty:
            self.disk_empty -= 1
        else:
            displaced = self._disk_victim(live_ok)
            assert displaced is not None
            self.c["displacements"] += 1
            if displaced.tier == DISK:
                self._drop(displaced)
            else:  # a copy: the block stays where it is
                displaced.copy = False
                displaced.retained_key = None

    def _spill(self, v: MBlock, live_ok: bool) -> None:
        self._take_slot(live_ok)
        self.next_transfer += 1
        self.writes[self.next_transfer] = v
        v.tier = SPILLING
        self.commands.append(("WriteSlot", v.key))
        self.c["spills"] += 1

    # ------------------------------------------------------------------ the API

    def add_request(
        self, rid: str, tokens: Sequence[int], *, now: float, ttl_seconds: float | None = None,
        priority: int = 0, cache_salt: str | None = None, lora_id: int | None = None,
        remote_keys: Iterable[BlockHash] = (),
    ) -> MatchResult:
        self._check_now(now)
        if rid in self.requests:
            raise UsageError("request_id", "exists")
        remote_set = set(remote_keys)
        if remote_set and not self.cfg.shared_tier:
            raise UsageError("remote_keys", "no shared tier")
        if not tokens:
            raise UsageError("token_ids", "empty")
        if len(tokens) > self.cfg.gpu_blocks * self.bs:
            raise UsageError("token_ids", "does not fit")
        ttl = float(ttl_seconds) if ttl_seconds else None
        req = MRequest(rid, list(tokens), root_key(self.cfg.model_fingerprint, cache_salt,
                                                   lora_id), ttl, priority)
        matched = self._match(req)
        remote = []
        for i in range(len(matched), (len(tokens) - 1) // self.bs):
            key = req.key(i, self.bs)
            if key not in remote_set or key in self.entries:
                break
            remote.append(key)
        skipped = skipped_remote = 0
        if self.cfg.cost_aware_onboarding:
            cut, skipped, cut_remote, skipped_remote = self._cost_cut(matched, remote,
                                                                      len(tokens))
            if skipped:
                self.disk_drops += 1
            if skipped_remote:
                self.net_drops += 1
            if (skipped or skipped_remote) and (self.disk_drops >= PROBE_EVERY
                                                or self.net_drops >= PROBE_EVERY):
                # A probe: everything is read, so the tier not measured for so long is.
                self.disk_drops = self.net_drops = 0
                self.c["cost_probes"] += 1
                skipped = skipped_remote = 0
            else:
                matched, remote = cut, cut_remote
        needs = len(remote) + sum(1 for b in matched if b.tier in (
            HOST, SPILLING, DISK, PREFETCHING, PREFETCHED))
        released = sum(1 for b in matched if b.tier == GPU and b.holders == 0)
        if needs > self.gpu_obtainable() - released:
            raise OutOfBlocks(rid, needs, self.gpu_obtainable() - released)
        self._advance(now)
        self.protected = {id(b) for b in matched}
        hits = {GPU: 0, HOST: 0, DISK: 0}
        run_end = 0  # matched[:run_end] had their pages taken already
        for i, b in enumerate(matched):
            b.reuse += 1
            if b.tier == DISK and i >= run_end:
                # The first of a run of blocks only on disk: the run's GPU pages are taken
                # before any of its reads is issued (one eviction pass for the run).
                run_end = i
                while run_end < len(matched) and matched[run_end].tier == DISK:
                    self._take_gpu_page()
                    run_end += 1
            if b.tier == GPU:
                hits[GPU] += 1
            elif b.tier == READING:
                b.waiters.append(rid)
                req.pending += 1
                hits[DISK] += 1
                self.c["hit_blocks_disk_retained"] += is_live(b.expiry, now)
            elif b.tier == FETCHING:
                b.waiters.append(rid)
                req.pending += 1
                self.c["hit_blocks_remote"] += 1
            elif b.tier == PREFETCHING:
                self.c["hit_blocks_disk_retained"] += is_live(b.expiry, now)
                self._take_gpu_page()
                tid = next(t for t, r in self.prefetch_reads.items() if r is b)
                self.reads[tid] = self.prefetch_reads.pop(tid)
                b.tier = READING
                b.host_page = True
                b.prefetchers.clear()
                b.waiters.append(rid)
                req.pending += 1
                self.c["onboards"] += 1
                self.c["prefetches_taken_over"] += 1
                hits[DISK] += 1
            elif b.tier in (HOST, SPILLING, PREFETCHED):
                self._take_gpu_page()
                self.commands.append(("CopyHostToGpu", b.key))
                if b.tier == PREFETCHED:
                    self._keep_host_copy(b)
                    self._file(b)  # the slot is kept: a disk copy
                    b.copy = True
                    b.prefetchers.clear()
                    self.c["prefetch_hits"] += 1
                elif b.tier == HOST:
                    self._keep_host_copy(b)
                else:
                    for tid, w in self.writes.items():
                        if w is b:
                            self.writes[tid] = None
                b.tier = GPU
                self.c["host_recalls"] += 1
                hits[HOST] += 1
            else:
                assert b.tier == DISK
                self.c["hit_blocks_disk_retained"] += is_live(b.expiry, now)
                self.next_transfer += 1
                self.reads[self.next_transfer] = b
                self.commands.append(("ReadSlot", b.key))
                b.tier = READING
                b.retained_key = None
                b.waiters.append(rid)
                req.pending += 1
                self.c["onboards"] += 1
                hits[DISK] += 1
            b.holders += 1
            req.blocks.append(b)
        for key in remote:
            self._take_gpu_page()
            b = MBlock(key=key, depth=len(req.blocks), tier=FETCHING, holders=1, reuse=1,
                       waiters=[rid])
            self.entries[key] = b
            self.next_transfer += 1
            self.fetches[self.next_transfer] = b
            self.commands.append(("FetchBlock", key))
            req.pending += 1
            req.blocks.append(b)
            self.c["fetches"] += 1
            self.c["hit_blocks_remote"] += 1
        self.protected = set()
        if rid in self.queued:
            self._end_prefetch(rid)
        req.num_computed = len(req.blocks) * self.bs
        req.committed = len(req.blocks)
        self.requests[rid] = req
        self.c["requests_added"] += 1
        self.c["prefix_cache_queries"] += len(req.tokens)
        self.c["onboards_skipped_as_too_slow"] += skipped
        self.c["fetches_skipped_as_too_slow"] += skipped_remote
        if req.pending:
            self.c["requests_parked"] += 1
        self.c["hit_blocks_gpu"] += hits[GPU]
        self.c["hit_blocks_host"] += hits[HOST]
        self.c["hit_blocks_disk"] += hits[DISK]
        bs = self.bs
        return MatchResult(len(req.blocks) * bs, hits[GPU] * bs, hits[HOST] * bs,
                           hits[DISK] * bs, req.pending == 0, skipped * bs,
                           len(remote) * bs, skipped_remote * bs)

    def remote_candidates(self, tokens: Sequence[int], *, cache_salt: str | None = None,
                          lora_id: int | None = None) -> tuple[BlockHash, ...]:
        if not self.cfg.shared_tier:
            raise UsageError("shared_tier", "no shared tier")
        req = MRequest("?", list(tokens), root_key(self.cfg.model_fingerprint, cache_salt,
                                                   lora_id), None, 0)
        n = len(self._match(req))
        return tuple(req.key(i, self.bs) for i in range(n, (len(tokens) - 1) // self.bs))

    def _match(self, req: MRequest) -> list[MBlock]:
        matched: list[MBlock] = []
        for i in range((len(req.tokens) - 1) // self.bs):
            b = self.entries.get(req.key(i, self.bs))
            if b is None:
                break
            matched.append(b)
        return matched

    def _prefill_per_token(self, context: int) -> float | None:
        if not self.prefill:
            return None
        want = max(context, 1).bit_length() - 1
        return self.prefill[min(self.prefill, key=lambda b: (abs(b - want), b))]

    def _cost_cut(
        self, matched: list[MBlock], remote: list[BlockHash], context: int
    ) -> tuple[list[MBlock], int, list[BlockHash], int]:
        """Every candidate end of the match (the start of each run of disk hits, and of the
        remote run), by full enumeration; a tier with no rate reported costs nothing."""
        rate, per_token = self.disk_rate, self._prefill_per_token(context)
        net = self.net_rate if remote else None
        on_disk = [rate is not None and b.tier == DISK for b in matched]
        fetched = [net is not None] * len(remote)
        paid = on_disk + fetched
        if per_token is None or not any(paid):
            return matched, 0, remote, 0
        bb, n, local = self.cfg.block_bytes, len(paid), len(matched)

        def transfers(upto: int) -> float:
            disk, nets = sum(on_disk[:upto]), sum(fetched[: max(0, upto - local)])
            cost = disk * bb / rate if disk else 0.0  # type: ignore[operator]
            if nets:
                cost += nets * bb / net  # type: ignore[operator]
            return cost

        best, best_cost = n, transfers(n)
        for i in range(n):
            starts_disk = i < local and on_disk[i] and (i == 0 or not on_disk[i - 1])
            starts_remote = i == local and fetched[0] if remote else False
            if starts_disk or starts_remote:
                cost = transfers(i) + (n - i) * self.bs * per_token
                if cost < best_cost:
                    best, best_cost = i, cost
        kept = max(0, best - local)
        return (matched[:best], sum(1 for b in matched[best:] if b.tier == DISK),
                remote[:kept], len(remote) - kept)

    def report_disk_read(self, num_bytes: int, seconds: float) -> None:
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 1:
            raise UsageError("num_bytes", "bad")
        if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
            raise UsageError("seconds", "bad")
        rate = num_bytes / float(seconds)
        old = self.disk_rate
        self.disk_rate = rate if old is None else old + SMOOTHING * (rate - old)
        self.disk_drops = 0

    def report_fetch(self, num_bytes: int, seconds: float) -> None:
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 1:
            raise UsageError("num_bytes", "bad")
        if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
            raise UsageError("seconds", "bad")
        rate = num_bytes / float(seconds)
        old = self.net_rate
        self.net_rate = rate if old is None else old + SMOOTHING * (rate - old)
        self.net_drops = 0

    def report_prefill(self, num_tokens: int, seconds: float, *, context_tokens: int) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise UsageError("num_tokens", "bad")
        if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
            raise UsageError("seconds", "bad")
        if (isinstance(context_tokens, bool) or not isinstance(context_tokens, int)
                or context_tokens < 1):
            raise UsageError("context_tokens", "bad")
        per_token = float(seconds) / num_tokens
        bucket = context_tokens.bit_length() - 1
        old = self.prefill.get(bucket)
        self.prefill[bucket] = per_token if old is None else old + SMOOTHING * (per_token - old)

    def prefetch(
        self, rid: str, tokens: Sequence[int], *, now: float, cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> tuple[int, int, int, int]:
        """Returns (started, shared, cached, unfetched) tokens."""
        self._check_now(now)
        if rid in self.requests:
            raise UsageError("request_id", "exists")
        if not tokens:
            raise UsageError("token_ids", "empty")
        if len(tokens) > self.cfg.gpu_blocks * self.bs:
            raise UsageError("token_ids", "does not fit")
        req = MRequest(rid, list(tokens), root_key(self.cfg.model_fingerprint, cache_salt,
                                                   lora_id), None, 0)
        matched = self._match(req)
        self._advance(now)
        wanted = self.queued.setdefault(rid, [])
        started = shared = cached = unfetched = 0
        for i, b in enumerate(matched):
            if b.key is None or self.entries.get(b.key) is not b:
                break  # dropped by an eviction of this call
            if rid in b.prefetchers:
                shared += 1
            elif b.tier in (PREFETCHING, PREFETCHED):
                b.prefetchers.append(rid)
                wanted.append(b)
                shared += 1
            elif b.tier == DISK:
                self.protected = {id(b)}
                got = self._take_host_page(for_prefetch=True)
                self.protected = set()
                if not got:
                    self._file_on_disk(b)
                    unfetched = sum(1 for m in matched[i:] if m.tier == DISK and m.key
                                    is not None and self.entries.get(m.key) is m)
                    break
                self.next_transfer += 1
                self.prefetch_reads[self.next_transfer] = b
                self.commands.append(("PrefetchSlot", b.key))
                b.tier = PREFETCHING
                b.retained_key = None
                b.prefetchers.append(rid)
                wanted.append(b)
                self.c["prefetches"] += 1
                started += 1
            else:
                cached += 1
        bs = self.bs
        self.last_prefetch = (started * bs, shared * bs, cached * bs, unfetched * bs)
        return self.last_prefetch

    def _end_prefetch(self, rid: str) -> None:
        for b in reversed(self.queued.pop(rid)):
            if rid not in b.prefetchers:
                continue
            b.prefetchers.remove(rid)
            if not b.prefetchers and b.tier == PREFETCHED:
                self._give_back_host()
                self._give_up_prefetch(b)
                self.c["prefetches_cancelled"] += 1

    def append_tokens(self, rid: str, tokens: Sequence[int]) -> None:
        req = self._request(rid)
        if len(req.tokens) + len(tokens) > self.cfg.gpu_blocks * self.bs:
            raise UsageError("token_ids", "would not fit")
        req.tokens.extend(tokens)

    def allocate_nowait(self, rid: str, num_tokens: int, *, now: float) -> None:
        self._check_now(now)
        req = self._request(rid)
        if not req.num_computed <= num_tokens <= len(req.tokens):
            raise UsageError("num_tokens", "out of range")
        needed = -(-num_tokens // self.bs) - len(req.blocks)
        if needed > self.gpu_obtainable():
            raise OutOfBlocks(rid, needed, self.gpu_obtainable())
        self._advance(now)
        for _ in range(max(needed, 0)):
            self._take_gpu_page()
            b = MBlock(key=None, depth=len(req.blocks), holders=1)
            self.private.append(b)
            req.blocks.append(b)

    def commit(self, rid: str, n: int, *, now: float) -> None:
        self._check_now(now)
        req = self._request(rid)
        if not req.num_computed <= n <= min(len(req.tokens), len(req.blocks) * self.bs):
            raise UsageError("num_computed_tokens", "out of range")
        if req.pending:
            raise UsageError("request_id", "parked")
        self._advance(now)
        req.num_computed = n
        for i in range(req.committed, n // self.bs):
            key = req.key(i, self.bs)
            if key in self.entries:
                continue
            b = req.blocks[i]
            self.private.remove(b)
            b.key = key
            b.depth = i
            self.entries[key] = b
        req.committed = max(req.committed, n // self.bs)

    def release(self, rid: str, *, now: float) -> None:
        self._check_now(now)
        if rid in self.queued and rid not in self.requests:
            self._advance(now)
            self._end_prefetch(rid)
            return
        req = self._request(rid)
        self._advance(now)
        del self.requests[rid]
        if req.ttl:
            expiry = expiry_after(now, req.ttl)
            for i in range(req.committed):
                # A private duplicate stamps its cached twin.
                b = req.blocks[i]
                target = b if b.key is not None else self.entries.get(req.key(i, self.bs))
                if target is None or (target.expiry is not None and target.expiry >= expiry):
                    continue
                target.expiry = expiry
                if target.tier == DISK or target.copy:
                    target.retained_key = (expiry, -target.depth, self._stamp())
                if target.copy or target.tier in (DISK, SPILLING, READING, PREFETCHING,
                                                  PREFETCHED):
                    # Its slot header holds an earlier deadline: the new one is journaled.
                    self.commands.append(("PersistRetention", target.key))
        self._let_go(req, req.blocks)
        if self._publish_on_release:
            self._publish_released(req)
        if req.ttl and self.cfg.retention_write_through and self.cfg.disk_blocks:
            self._write_through(req)
        self.c["requests_released"] += 1

    def _let_go(self, req: MRequest, blocks: list[MBlock]) -> None:
        for b in reversed(blocks):
            if req.rid in b.waiters:
                b.waiters.remove(req.rid)
            b.holders -= 1
            if b.holders:
                continue
            b.priority = req.priority
            if b.tier == GPU:
                if b.key is not None:
                    b.stamp = self._stamp()
                else:
                    self.private.remove(b)
                    self.gpu_free += 1

    def is_ready(self, rid: str) -> bool:
        return self._request(rid).pending == 0

    def num_computed(self, rid: str) -> int:
        return self._request(rid).num_computed

    def advance(self, now: float) -> None:
        self._check_now(now)
        self._advance(now)

    def restore(self, blocks: Sequence[RestoredBlock], *, now: float) -> None:
        """Blocks left on disk by an earlier process, in the order they would be in had that
        process never stopped: best-effort content by the time it became best-effort (its
        write, or its deadline if that passed later), a deeper block first among equals;
        content whose deadline still runs by (deadline, deeper first, written first)."""
        self._check_now(now)
        if (self.requests or self.entries or self.writes or self.reads or self.prefetch_reads
                or self.queued or self.fetches):
            raise UsageError("restore", "only a fresh cache")
        self._advance(now)
        # A restored deadline is at most max_ttl_seconds away.
        cap = now + self.cfg.max_ttl_seconds
        blocks = [attrs.evolve(e, expiry=min(e.expiry, cap)) if e.expiry is not None else e
                  for e in blocks]
        expired = [e for e in blocks if not is_live(e.expiry, now)]
        running = [e for e in blocks if is_live(e.expiry, now)]
        expired.sort(key=lambda e: (max(e.written_at, -math.inf if e.expiry is None
                                        else e.expiry), e.written_at, e.sequence, -e.depth))
        running.sort(key=lambda e: (e.written_at, e.sequence))
        for e in expired + running:
            b = MBlock(key=e.key, depth=e.depth, tier=DISK, reuse=e.reuse_count,
                       expiry=e.expiry)
            stamp = self._stamp()
            if is_live(e.expiry, now):
                assert e.expiry is not None
                b.retained_key = (e.expiry, -e.depth, stamp)
            else:
                b.disk_stamp = stamp
            self.entries[e.key] = b
        self.disk_empty -= len(blocks)
        self.c["restored_blocks"] += len(blocks)

    # ------------------------------------------------------------------ completions

    def write_done(self, tid: int, ok: bool, now: float) -> None:
        self._check_now(now)
        if tid not in self.writes:
            raise UsageError("transfer", "unknown")
        self._advance(now)
        self._write_done(tid, ok, now)
        if ok and self.cfg.retention_write_through and self.cfg.disk_blocks:
            self._retry_write_throughs()

    def _write_done(self, tid: int, ok: bool, now: float) -> None:
        v = self.writes.pop(tid)
        staged = self.staged.pop(tid, None)
        keep = tid in self.keep_host
        self.keep_host.discard(tid)
        if ok:
            self.c["spills_completed"] += 1
            self.c["bytes_written"] += self.cfg.block_bytes
            if keep and v is not None:
                # A write-through from host: the block keeps its page, now with a copy.
                v.tier = HOST
                v.stamp = self._stamp()
                v.copy = True
                self._file(v)
                return
            self._give_back_host()
            if v is None:
                if staged is not None:
                    key, written, depth, reuse = staged
                    t = self.entries.get(key)
                    if t is None:
                        # The content left while its write was in flight: on disk now.
                        t = MBlock(key=key, depth=depth, tier=DISK, reuse=reuse,
                                   expiry=written)
                        self.entries[key] = t
                        self._file(t)
                        return
                    # The content adopts the slot if it is on GPU or host with no copy and
                    # a deadline at least the one the slot header holds.
                    if (t is not None and not t.copy and t.tier in (GPU, HOST)
                            and t.expiry is not None and written is not None
                            and t.expiry >= written):
                        t.copy = True
                        self._file(t)
                        if t.expiry > written:
                            self.commands.append(("PersistRetention", key))
                        return
                self.disk_empty += 1
                self.commands.append(("FreeSlot", None))
                return
            v.tier = DISK
            stamp = self._stamp()
            if is_live(v.expiry, now):
                assert v.expiry is not None
                v.retained_key = (v.expiry, -v.depth, stamp)
            else:
                v.disk_stamp = stamp
        else:
            self.c["spill_failures"] += 1
            self.disk_empty += 1
            self.commands.append(("FreeSlot", None))
            if v is None:
                self._give_back_host()
                return
            v.tier = HOST
            v.stamp = self._stamp()

    def read_done(self, tid: int, ok: bool, now: float) -> None:
        self._check_now(now)
        if tid in self.prefetch_reads:
            self._advance(now)
            self._prefetch_done(self.prefetch_reads.pop(tid), ok)
            return
        if tid in self.fetches:
            self._advance(now)
            self._fetch_done(self.fetches.pop(tid), ok)
            return
        if tid not in self.reads:
            raise UsageError("transfer", "unknown")
        self._advance(now)
        b = self.reads.pop(tid)
        if b.host_page:
            if ok:
                self.commands.append(("CopyHostToGpu", b.key))
            self._give_back_host()
            b.host_page = False
        if ok:
            self.c["onboards_completed"] += 1
            self.c["bytes_read"] += self.cfg.block_bytes
            b.tier = GPU
            self._file(b)  # the slot is kept: a disk copy
            b.copy = True
            for rid in b.waiters:
                self.requests[rid].pending -= 1
            b.waiters.clear()
            if b.holders == 0:
                b.stamp = self._stamp()
            return
        self.disk_empty += 1
        self.commands.append(("FreeSlot", None))
        self.c["onboard_failures"] += 1
        self._fail(b)

    def _fetch_done(self, b: MBlock, ok: bool) -> None:
        if ok:
            self.c["fetches_completed"] += 1
            self.c["bytes_fetched"] += self.cfg.block_bytes
            b.tier = GPU
            for rid in b.waiters:
                self.requests[rid].pending -= 1
            b.waiters.clear()
            if b.holders == 0:
                b.stamp = self._stamp()
            return
        self.c["fetch_failures"] += 1
        self._fail(b)

    def _fail(self, b: MBlock) -> None:
        """A read or fetch failed: the content is never served; its holders recompute."""
        b.failed = True
        self._drop(b)
        b.key = None
        self.private.append(b)
        for rid in list(b.waiters):
            req = self.requests[rid]
            pos = req.blocks.index(b)
            dropped = req.blocks[pos:]
            req.pending -= sum(1 for d in dropped if rid in d.waiters)
            del req.blocks[pos:]
            req.num_computed = min(req.num_computed, pos * self.bs)
            req.committed = min(req.committed, pos)
            self._let_go(req, dropped)
            self.c["requests_fallen_back"] += 1
        assert b.holders == 0
        self.private.remove(b)
        self.gpu_free += 1

    def _prefetch_done(self, b: MBlock, ok: bool) -> None:
        if ok:
            self.c["prefetches_completed"] += 1
            self.c["bytes_read"] += self.cfg.block_bytes
            b.tier = PREFETCHED
            b.stamp = self._stamp()
            if not b.prefetchers:
                self._give_back_host()
                self._give_up_prefetch(b)
                self.c["prefetches_cancelled"] += 1
            return
        self.c["prefetch_failures"] += 1
        self.disk_empty += 1
        self.commands.append(("FreeSlot", None))
        self._give_back_host()
        b.prefetchers.clear()
        self._drop(b)

    # ------------------------------------------------------------------ observation

    def cached(self) -> dict[BlockHash, tuple[str, int, int, float | None, bool, bool]]:
        """key -> (tier, holders, reuse count, expiry, disk copy, host copy) for every cached
        block."""
        return {k: (b.tier, b.holders, b.reuse, b.expiry, b.copy, b.host_copy)
                for k, b in self.entries.items()}

    def statistics(self) -> CacheStatistics:
        c = self.c
        bs = self.bs
        tiers = [b.tier for b in self.entries.values()]
        by_state = {s: 0 for s in BlockState}
        for b in self.entries.values():
            if b.tier == GPU:
                by_state[BlockState.ON_GPU if b.holders else BlockState.RELEASED] += 1
            else:
                by_state[{HOST: BlockState.ON_HOST, SPILLING: BlockState.SPILLING,
                          DISK: BlockState.ON_DISK, READING: BlockState.ONBOARDING,
                          PREFETCHING: BlockState.PREFETCHING,
                          PREFETCHED: BlockState.PREFETCHED,
                          FETCHING: BlockState.FETCHING}[b.tier]] += 1
        by_state[BlockState.ON_GPU] += len(self.private)
        cfg = self.cfg
        total = cfg.gpu_blocks + cfg.host_blocks + cfg.reserved_host_blocks + cfg.disk_blocks
        by_state[BlockState.FREE] = total - sum(by_state.values())
        return CacheStatistics(
            requests_added=c["requests_added"],
            prefix_cache_queries=c["prefix_cache_queries"],
            prefix_cache_hits=(c["hit_blocks_gpu"] + c["hit_blocks_host"] + c["hit_blocks_disk"]
                               + c["hit_blocks_remote"]) * bs,
            requests_released=c["requests_released"],
            requests_parked=c["requests_parked"],
            parked_requests=sum(1 for r in self.requests.values() if r.pending),
            requests_fallen_back=c["requests_fallen_back"],
            hit_blocks_gpu=c["hit_blocks_gpu"],
            hit_blocks_host=c["hit_blocks_host"],
            hit_blocks_disk=c["hit_blocks_disk"],
            hit_blocks_disk_retained=c["hit_blocks_disk_retained"],
            hit_tokens_gpu=c["hit_blocks_gpu"] * bs,
            hit_tokens_host=c["hit_blocks_host"] * bs,
            hit_tokens_disk=c["hit_blocks_disk"] * bs,
            hit_tokens_remote=c["hit_blocks_remote"] * bs,
            gpu_evictions=c["gpu_evictions"],
            host_offloads=c["host_offloads"],
            host_recalls=c["host_recalls"],
            offloads_skipped=c["offloads_skipped"],
            host_copies_kept=c["host_copies_kept"],
            offloads_saved_by_host_copy=c["offloads_saved_by_host_copy"],
            host_drops=c["host_drops"],
            spills=c["spills"],
            spills_completed=c["spills_completed"],
            spill_failures=c["spill_failures"],
            spills_saved_by_disk_copy=c["spills_saved_by_disk_copy"],
            bytes_written=c["bytes_written"],
            writes_in_flight=len(self.writes),
            onboards=c["onboards"],
            onboards_completed=c["onboards_completed"],
            onboard_failures=c["onboard_failures"],
            bytes_read=c["bytes_read"],
            reads_in_flight=len(self.reads),
            gate_drops=c["gate_drops"],
            pressure_drops=c["pressure_drops"],
            admission_refusals=c["admission_refusals"],
            disk_busy_refusals=c["disk_busy_refusals"],
            displacements=c["displacements"],
            expirations=c["expirations"],
            restored_blocks=c["restored_blocks"],
            io_errors=c["spill_failures"] + c["onboard_failures"] + c["prefetch_failures"],
            prefetches=c["prefetches"],
            prefetches_completed=c["prefetches_completed"],
            prefetch_failures=c["prefetch_failures"],
            prefetch_hits=c["prefetch_hits"],
            prefetches_taken_over=c["prefetches_taken_over"],
            prefetches_cancelled=c["prefetches_cancelled"],
            prefetches_reclaimed=c["prefetches_reclaimed"],
            prefetch_reads_in_flight=len(self.prefetch_reads),
            prefetched_blocks=tiers.count(PREFETCHED),
            prefetching_requests=len(self.queued),
            onboards_skipped_as_too_slow=c["onboards_skipped_as_too_slow"],
            onboard_tokens_skipped_as_too_slow=c["onboards_skipped_as_too_slow"] * bs,
            cost_probes=c["cost_probes"],
            cached_blocks=len(self.entries),
            gpu_free_pages=self.gpu_free,
            gpu_evictable_blocks=sum(1 for b in self.entries.values()
                                     if b.tier == GPU and b.holders == 0),
            host_free_pages=self.host_free,
            host_copy_pages=sum(1 for b in self.entries.values() if b.host_copy),
            host_reserved_pages=self.reserved,
            host_cached_blocks=tiers.count(HOST),
            disk_empty_slots=self.disk_empty,
            disk_cached_blocks=tiers.count(DISK),
            disk_retained_blocks=sum(1 for b in self.entries.values()
                                     if (b.tier == DISK or b.copy)
                                     and b.retained_key is not None),
            disk_copy_blocks=sum(1 for b in self.entries.values() if b.copy),
            blocks_by_state=tuple((s.name, by_state[s]) for s in BlockState),
            hit_blocks_remote=c["hit_blocks_remote"],
            fetches=c["fetches"],
            fetches_completed=c["fetches_completed"],
            fetch_failures=c["fetch_failures"],
            bytes_fetched=c["bytes_fetched"],
            fetches_in_flight=len(self.fetches),
            fetches_skipped_as_too_slow=c["fetches_skipped_as_too_slow"],
            publishes_offered=c["publishes_offered"],
            publishes_not_admitted=c["publishes_not_admitted"],
            write_throughs=c["write_throughs"],
            write_throughs_skipped=c["write_throughs_skipped"],
            write_throughs_retried=c["write_throughs_retried"],
        )
