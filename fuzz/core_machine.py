"""Machine 1: the pure core against the executable reference model of ``specs/``.

No I/O, no threads: the machine plays the actors itself.  Hypothesis drives the real
:class:`~statekv.KVCacheManager` and :class:`~specs.reference_model.ReferenceCache` with
the same operations -- requests with shared prefixes, salts, priorities and TTLs; allocation,
commits and decode; releases and cancellations of parked requests; writes and reads that land
or fail in an order it picks (oldest or newest of a kind, by transfer id); the clock -- and
after every step checks that

* both succeed or fail alike, emit the same commands (kinds, and keys of disk transfers),
  match the same prefixes by tier, agree on readiness, computed tokens, every counter of
  ``statistics()`` and which content is cached on which tier with which retention stamp;
* the command stream keeps its contract (:mod:`fuzz.contract`): one transfer per slot, a read
  names its slot's content, nothing touches a GPU page a read is filling;
* no GPU page with a read in flight is on the free list, no slot with a transfer in flight is
  on the empty list, and a ready request holds no page a read is still filling;
* no host page a prefetch read is filling is on a host free list;
* ``check_invariants()`` holds.

Prefetch races (fuzz/README.md, race table): a queued request prefetches content the machine
pushed to disk, then leaves while its reads are in flight, is admitted before or after they
land, loses its pages to a GPU eviction, or prefetches while spills in flight displace the
very blocks it wants.  The cost rule reports disk and prefill rates so that admissions also
run the cost-aware cut.

Fetch races (the shared tier, issue 15): another replica published a prompt (the cluster may
lose a block of it before the fetch); a request matches past the local tiers and fetches it;
then its request is released while the fetch is in flight, the fetch fails (missing, evicted
between lookup and fetch, corrupt: the core sees one failure kind), or a second request
joins the fetch in flight before it lands or fails.  Blocks this cache offloads to host are
published to the emulated cluster, so later requests fetch them back.

Restarts (issue 23): the machine keeps the disk image its commands describe (what a slot
store and its journals would hold) and, in the `restart` rule, lets every transfer land,
advances the clock by a time the process was down, and restores that image into a fresh core
and a fresh reference model, which are compared step by step from there: displacement of
restored content -- retained and live, expired while down, best-effort -- against the spec.

This is the fast machine (thousands of steps per second): it explores the decision logic,
the system machine (:mod:`fuzz.system_machine`) the actors and the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition

from fuzz.contract import CommandContract
from fuzz.spy import command_kinds
from fuzz.steps import Counts, fuzz_rule, note
from fuzz.tracefile import new_sink
from specs.reference_model import ReferenceCache, block_keys, in_batches, observed
from statekv import CacheConfig, KVCacheManager, OutOfBlocks, SpillMode, UsageError
from statekv.ids import BlockHash, SlotId, TransferId
from statekv.manager import PrefetchStarted, RestoredBlock
from statekv.messages import (
    Completion,
    FetchBlock,
    FreeSlot,
    PersistRetention,
    PrefetchSlot,
    PublishBlock,
    ReadSlot,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    WriteSlot,
    per_block,
)
from statekv.trace import TraceSink

T = TypeVar("T")


# A few documents that prompts share prefixes of, so that matches happen often; the second
# shares the first's first two blocks (block size 2), the third shares nothing.
DOCUMENTS = (
    (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
    (1, 2, 3, 4, 9, 9, 9, 9),
    (5, 5, 5, 5, 5),
)
SALTS = (None, None, "tenant-b")
TTLS = (None, 0, 1.0, 5.0, 30.0)
CLOCK_STEPS = (0.5, 1.0, 5.0, 30.0)
DOWN_TIMES = (0.0, 10.0, 100.0, 100_000.0)
"""How long the process is down at a restart: deadlines pass on both sides of it."""


@st.composite
def core_configs(draw: st.DrawFn) -> CacheConfig:
    disk = draw(st.integers(0, 8))
    host = draw(st.integers(1 if disk else 0, 3))
    return CacheConfig(
        block_size=draw(st.sampled_from([2, 2, 4])),
        gpu_blocks=draw(st.integers(4, 8)),
        host_blocks=host,
        reserved_host_blocks=draw(st.integers(0, 2)) if disk else 0,
        disk_blocks=disk,
        # Half the caches spill everything: the gated modes drop most victims, and disk
        # round trips are where the races are.
        spill_mode=draw(st.sampled_from([SpillMode.ALL, SpillMode.ALL, SpillMode.RETAINED_ONLY,
                                         SpillMode.REUSED])),
        spill_min_reuse=draw(st.integers(1, 2)),
        protect_unexpired=draw(st.booleans()),
        drop_on_pressure=draw(st.booleans()),
        write_queue_depth=draw(st.integers(1, 3)),
        priority_levels=draw(st.integers(1, 3)),
        max_batch_blocks=draw(st.sampled_from([1, 2, 16])),
        cost_aware_onboarding=draw(st.booleans()),
        reclaim_prefetched_first=draw(st.booleans()),
        shared_tier=draw(st.booleans()),
        retention_write_through=draw(st.booleans()),
        publish_on=draw(st.sampled_from(["eviction", "release"])),
    )


@attrs.frozen
class RequestSpec:
    """What one new request asks for (precomputed, so that a rule draws it in one choice)."""

    prompt: tuple[int, ...]
    ttl: float | None = None
    priority: int = 0
    salt: str | None = None


def _prompts() -> list[tuple[int, ...]]:
    """Prompts cut from the documents, plus short private tails; simplest first, so that
    shrinking (towards index 0) simplifies the prompt."""
    out: list[tuple[int, ...]] = []
    for tail in ((), (0,), (1, 2), (3, 3, 3)):
        for cut in range(1, 13):
            for doc in DOCUMENTS:
                prompt = doc[:cut] + tail
                if prompt not in out:
                    out.append(prompt)
    return out


PROMPTS = _prompts()
REQUESTS = [
    RequestSpec(prompt, ttl, priority, salt)
    for salt in (None, "tenant-b")
    for priority in (0, 1, 2)
    for ttl in TTLS
    for prompt in PROMPTS
]
"""Every request a rule may add, as one sampled choice (cheap to draw, shrinks well)."""
requests = st.sampled_from(REQUESTS)


@attrs.frozen
class ChurnSpec:
    """A request of fresh tokens: `blocks` full blocks (None: as many as the GPU holds)."""

    blocks: int | None
    ttl: float | None = None
    land: bool = False


churns = st.sampled_from([
    ChurnSpec(blocks, ttl, land)
    for land in (False, True)
    for ttl in (None, 2.0, 10.0)
    for blocks in (1, 2, 4, None)
])


@attrs.frozen
class RequestAction:
    """Something the serving loop does to live request number `pick` (modulo how many)."""

    kind: str
    """"compute" (1 + `amount` more tokens, then commit if ready), "decode" (append token
    `amount`), "release", or "cancel" (release a parked request, if any is parked)."""
    pick: int
    amount: int = 0


request_actions = st.sampled_from(
    [RequestAction("compute", pick, extra) for extra in (0, 1, 3, 8) for pick in range(4)]
    + [RequestAction("release", pick) for pick in range(4)]
    + [RequestAction("decode", pick, token) for token in range(3) for pick in range(4)]
    + [RequestAction("cancel", pick) for pick in range(4)]
)


@attrs.frozen
class TransferAction:
    """Which pending disk transfer reports next, and how."""

    kind: str
    """"write" or "read": the oldest (or newest) of that kind reports, or, when none of that
    kind is pending, the oldest of the other kind; "drain": every transfer lands, writes
    first, oldest first."""
    newest: bool = False
    ok: bool = True


transfer_actions = st.sampled_from(
    [TransferAction(kind, newest, ok)
     for ok in (True, False) for newest in (False, True) for kind in ("write", "read")]
    + [TransferAction("drain")]
)


@attrs.frozen
class PrefetchRace:
    """A queued request's prefetch of a prompt pushed down to disk, and what happens next."""

    kind: str
    """"leave" (the request leaves while its reads are in flight), "admit_early" (admitted
    while they are in flight: the reads become its onboards), "admit" (admitted after they
    land: host hits), "evict" (a GPU eviction reclaims the prefetched pages, then it is
    admitted), "displace" (spills in flight displace disk content while it prefetches)."""
    pick: int


prefetch_races = st.sampled_from(
    [PrefetchRace(kind, pick) for pick in range(4)
     for kind in ("leave", "admit_early", "admit", "evict", "displace")]
)


@attrs.frozen
class CostReport:
    """One disk read and one prefill reported (rates chosen to land on both sides of the
    read/recompute boundary for the machine's small blocks)."""

    disk_bytes_per_second: float
    prefill_seconds_per_token: float
    context_tokens: int


@attrs.frozen
class FetchRace:
    """A prompt another replica published is fetched from the shared tier; then the race."""

    kind: str
    """"land" (the fetches land), "release" (the request is released while its fetches are
    in flight, then they land or fail), "fail" (the first fetch fails: its request
    recomputes from there), "evicted" (the cluster lost a block between lookup and fetch:
    that fetch fails, the others land), "joined" (a second request matches the blocks in
    flight, then the first fetch fails)."""
    pick: int


fetch_races = st.sampled_from(
    [FetchRace(kind, pick) for pick in range(4)
     for kind in ("land", "release", "fail", "evicted", "joined")]
)


cost_reports = st.sampled_from([
    CostReport(rate, per_token, context)
    for rate in (1e2, 1e4, 1e9) for per_token in (1e-6, 1e-3) for context in (4, 16)
])


class CoreVsSpec(RuleBasedStateMachine):
    """The real core and the reference model, step by step."""

    def __init__(self) -> None:
        super().__init__()
        Counts.examples += 1
        self.real: KVCacheManager | None = None
        self.model: ReferenceCache
        self.trace: TraceSink | None = None
        self.contract = CommandContract()
        self.now = 0.0
        self.writes: list[TransferId] = []
        self.reads: list[TransferId] = []
        self.live: list[str] = []
        self.next_id = 0
        self.next_token = 0
        self.served: list[list[int]] = []
        self.queued: list[tuple[str, list[int]]] = []
        self.queued_tokens: dict[str, tuple[int, ...]] = {}
        self.pending_reads: dict[str, int] = {}
        """A queued request's prefetch reads in flight, as last seen: only its own asks may
        raise the count (the serving loop stops looking once it is 0)."""
        self.cluster: set[BlockHash] = set()
        """Keys the emulated shared tier holds (this cache's publishes and other replicas')."""
        self.fetches: dict[TransferId, BlockHash] = {}
        """Fetches issued, by transfer (they also wait in `reads`, and report like reads)."""
        self.disk_image: dict[SlotId, RestoredBlock] = {}
        """What a slot store would hold, from the commands: landed writes with the metadata
        their headers store, lengthened deadlines applied, freed or overwritten slots gone."""
        self.writing: dict[TransferId, RestoredBlock] = {}
        """Writes in flight, as they would land."""
        self.sequence = 0

    @property
    def core(self) -> KVCacheManager:
        assert self.real is not None
        return self.real

    @initialize(config=core_configs())
    def build(self, config: CacheConfig) -> None:
        self.trace = new_sink()
        self.real = KVCacheManager(config, trace=self.trace)
        self.model = ReferenceCache(config)
        self.contract.max_batch_blocks = config.max_batch_blocks

    # -------------------------------------------------------------- both sides, compared

    def both(self, real: Callable[[], T], model: Callable[[], Any]) -> T | None:
        """Run one operation on both; they must succeed or fail alike."""
        Counts.operations += 1
        try:
            out = real()
        except (OutOfBlocks, UsageError) as exc:
            try:
                model()
            except type(exc):
                return None
            raise AssertionError(f"real raised {exc!r}, the model did not") from None
        model()
        self.collect_commands()
        return out

    def collect_commands(self) -> None:
        real = self.core.take_commands()
        model = self.model.commands
        self.model.commands = []
        real_kinds = command_kinds(real)
        model_kinds = in_batches(model, self.model.cfg.max_batch_blocks)
        assert real_kinds == model_kinds, (real_kinds, model_kinds)
        self.contract.commands(real)
        for c in per_block(real):
            self._image_command(c)
            if isinstance(c, WriteSlot):
                self.writes.append(c.transfer)
            elif isinstance(c, ReadSlot | PrefetchSlot):
                # A prefetch reports like a read; the model tells the two apart by id.
                self.reads.append(c.transfer)
            elif isinstance(c, FetchBlock):
                self.reads.append(c.transfer)
                self.fetches[c.transfer] = c.key
            elif isinstance(c, PublishBlock):
                self.cluster.add(c.key)

    def _image_command(self, c: object) -> None:
        """The disk image follows the command stream as a slot store and its journals would."""
        if isinstance(c, WriteSlot):
            self.disk_image.pop(c.slot, None)  # the index forgets a slot before its write
            if c.parent is not None:
                self.sequence += 1
                self.writing[c.transfer] = RestoredBlock(
                    key=c.key, parent_key=c.parent, slot=c.slot, depth=c.depth,
                    reuse_count=c.reuse_count, expiry=c.expiry, written_at=c.issued_at,
                    sequence=self.sequence)
        elif isinstance(c, FreeSlot):
            self.disk_image.pop(c.slot, None)
        elif isinstance(c, PersistRetention):
            for held in (*self.writing.values(), self.disk_image.get(c.slot)):
                if held is not None and held.slot == c.slot and held.key == c.key:
                    updated = attrs.evolve(held, expiry=c.expiry)
                    if held is self.disk_image.get(c.slot):
                        self.disk_image[c.slot] = updated
                    else:
                        self.writing = {t: updated if w is held else w
                                        for t, w in self.writing.items()}

    def _image_write_done(self, tid: TransferId, ok: bool) -> None:
        landed = self.writing.pop(tid, None)
        if landed is not None and ok:
            self.disk_image[landed.slot] = landed

    def complete(self, tid: TransferId, completion: Completion, ok: bool) -> None:
        self.contract.completion(completion)
        if isinstance(completion, SlotWritten | SlotWriteFailed):
            self._image_write_done(tid, ok)
        if isinstance(completion, SlotWritten | SlotWriteFailed):
            self.both(lambda: self.core.handle(completion, now=self.now),
                      lambda: self.model.write_done(tid, ok, self.now))
        else:
            self.both(lambda: self.core.handle(completion, now=self.now),
                      lambda: self.model.read_done(tid, ok, self.now))

    # -------------------------------------------------------------- requests
    #
    # Every rule draws at most one choice: Hypothesis spends most of a step's time per
    # choice drawn, and one sampled record prints as readably as several arguments.

    @fuzz_rule(spec=requests)
    def add_request(self, spec: RequestSpec) -> None:
        self._add(list(spec.prompt), spec.ttl, spec.priority, spec.salt)

    def _remote_keys(self, prompt: list[int], salt: str | None) -> tuple[BlockHash, ...]:
        """What the remote fetcher's lookup would find: the candidates past the local match
        that the emulated cluster holds (both sides must name the same candidates)."""
        if not self.core.config.shared_tier:
            return ()
        try:
            candidates = self.core.remote_candidates(prompt, cache_salt=salt)
        except UsageError:
            return ()
        assert candidates == self.model.remote_candidates(prompt, cache_salt=salt)
        return tuple(k for k in candidates if k in self.cluster)

    def _add(
        self, prompt: list[int], ttl: float | None, priority: int, salt: str | None,
        rid: str | None = None,
    ) -> str | None:
        if rid is None:
            rid = f"r{self.next_id}"
            self.next_id += 1
        priority = min(priority, self.core.config.priority_levels - 1)
        Counts.operations += 1
        keys = self._remote_keys(prompt, salt)
        try:
            match = self.core.add_request(
                rid, prompt, now=self.now, ttl_seconds=ttl, priority=priority, cache_salt=salt,
                remote_keys=keys,
            )
        except (OutOfBlocks, UsageError) as exc:
            try:
                self.model.add_request(rid, prompt, now=self.now, ttl_seconds=ttl,
                                       priority=priority, cache_salt=salt, remote_keys=keys)
            except type(exc):
                return None
            raise AssertionError(f"real raised {exc!r}, the model did not") from None
        expected = self.model.add_request(rid, prompt, now=self.now, ttl_seconds=ttl,
                                          priority=priority, cache_salt=salt, remote_keys=keys)
        got = (match.matched_tokens, match.gpu_tokens, match.host_tokens, match.disk_tokens,
               match.ready, match.skipped_disk_tokens, match.remote_tokens,
               match.skipped_remote_tokens)
        assert got == (expected.matched_tokens, expected.gpu_tokens, expected.host_tokens,
                       expected.disk_tokens, expected.ready, expected.skipped_disk_tokens,
                       expected.remote_tokens, expected.skipped_remote_tokens)
        self.collect_commands()
        self.live.append(rid)
        return rid

    # -------------------------------------------------------------- prefetch

    def _prefetch(self, prompt: list[int]) -> str | None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        # One tuple for every call of this queued request, as a serving loop keeps it: a
        # repeat call with the same tuple takes the record of the first (QueuedRecord).
        tokens = tuple(prompt)
        got = self._ask_prefetch(rid, tokens)
        if got is None:
            return None
        self.queued.append((rid, prompt))
        self.queued_tokens[rid] = tokens
        return rid

    def _prefetch_again(self, rid: str) -> None:
        """A queued request asks again (each step, in a serving loop) with its tuple."""
        self._ask_prefetch(rid, self.queued_tokens[rid])

    def _ask_prefetch(self, rid: str, tokens: tuple[int, ...]) -> PrefetchStarted | None:
        """One prefetch call on both, its counts compared.  While the core says no prefetch
        could start (prefetch_could_start), the call must start no read and evict nothing:
        the serving loop skips a stalled request's ask then."""
        could = self.core.prefetch_could_start()
        moved = len(self.reads), len(self.writes)
        host_moves = self._host_moves()
        got = self.both(lambda: self.core.prefetch(rid, tokens, now=self.now),
                        lambda: self.model.prefetch(rid, tokens, now=self.now))
        if got is None:
            return None
        assert (got.started_tokens, got.shared_tokens, got.cached_tokens,
                got.unfetched_tokens) == self.model.last_prefetch
        if not could:
            assert got.started_tokens == 0 and moved == (len(self.reads), len(self.writes))
            assert self._host_moves() == host_moves
        self.pending_reads[rid] = self.core.prefetch_reads_pending(rid)
        return got

    def _host_moves(self) -> tuple[int, ...]:
        """The counters a prefetch moves when it takes a host page: a victim dropped or
        spilled, a read started."""
        s = self.core.statistics()
        return s.host_drops, s.spills, s.spills_saved_by_disk_copy, s.prefetches

    def _admit(self, rid: str, prompt: list[int]) -> None:
        self.queued.remove((rid, prompt))
        if self._add(prompt, None, 0, None, rid=rid) is None:
            self.queued.append((rid, prompt))  # not admitted: still queued, nothing changed
        else:
            del self.queued_tokens[rid]
            self.pending_reads.pop(rid, None)

    def _leave(self, rid: str, prompt: list[int]) -> None:
        self.queued.remove((rid, prompt))
        del self.queued_tokens[rid]
        self.pending_reads.pop(rid, None)
        self.both(lambda: self.core.release(rid, now=self.now),
                  lambda: self.model.release(rid, now=self.now))

    def _push_to_disk(self, prompt: list[int], *, land: bool, ttl: float | None = None) -> None:
        """Serve `prompt` (with `ttl`: a retained-only cache spills it, and drops the fresh
        content after it, freeing host pages), then two GPU-sized fresh requests: its blocks
        go down the tiers (every transfer landing in between when `land`)."""
        self._serve(prompt, ttl, 0)
        cfg = self.core.config
        for _ in range(2):
            self.next_token += 1
            full = cfg.gpu_blocks * cfg.block_size - 1
            self._serve([100 + self.next_token * 64 + i for i in range(full)], None, 0)
            if land:
                self._drain_writes()

    @fuzz_rule(spec=requests)
    def prefetch(self, spec: RequestSpec) -> None:
        """A request joins the queue and asks for its blocks ahead of admission."""
        self._prefetch(list(spec.prompt))

    @fuzz_rule(race=prefetch_races)
    def prefetch_race(self, race: PrefetchRace) -> None:
        """A prompt pushed down to disk is prefetched by a queued request; then the race."""
        prompt = list(PROMPTS[(race.pick * 7 + 11) % len(PROMPTS)])
        ttl = 30.0 if race.pick % 2 else None
        if race.kind == "displace":
            # Spills still in flight when the prefetch takes host pages: evicting a host
            # victim to make room may displace disk blocks of the same prefix.
            self._push_to_disk(prompt, land=False, ttl=ttl)
            rid = self._prefetch(prompt)
            if rid is not None and race.pick % 2:
                self._admit(rid, prompt)
            return
        self._push_to_disk(prompt, land=True, ttl=ttl)
        rid = self._prefetch(prompt)
        if rid is None:
            return
        if race.kind == "leave":
            self._leave(rid, prompt)  # reads still in flight
        elif race.kind == "admit_early":
            self._admit(rid, prompt)
        else:
            self._drain()
            if race.kind == "evict":
                self.next_token += 1
                cfg = self.core.config
                self._serve([100 + self.next_token * 64 + i
                             for i in range(cfg.gpu_blocks * cfg.block_size - 1)], None, 0)
            self._admit(rid, prompt)

    @precondition(lambda self: self.core.config.shared_tier)
    @fuzz_rule(race=fetch_races)
    def fetch_race(self, race: FetchRace) -> None:
        """Another replica published a prompt; a request here fetches it; then the race."""
        prompt = list(PROMPTS[(race.pick * 5 + 7) % len(PROMPTS)])
        salt = SALTS[race.pick % len(SALTS)]
        keys = block_keys(prompt, self.core.config.block_size, salt=salt)
        self.cluster.update(keys)
        before = set(self.fetches)
        rid = self._add(prompt, None, 0, salt)
        mine = [t for t in self.fetches if t not in before and t in self.reads]
        if rid is None or not mine:
            return
        if race.kind == "evicted":
            # The cluster lost the block after the lookup: its fetch fails, the rest land.
            lost = mine[race.pick % len(mine)]
            self.cluster.discard(self.fetches[lost])
            for tid in mine:
                self._report_read(tid, tid != lost)
            return
        if race.kind == "release":
            self._release(rid)
            for i, tid in enumerate(mine):
                self._report_read(tid, (i + race.pick) % 2 == 0)
            return
        if race.kind == "joined":
            self._add(prompt, None, 0, salt)
        ok = race.kind == "land"
        for i, tid in enumerate(mine):
            self._report_read(tid, ok or i > 0)

    def _report_read(self, tid: TransferId, ok: bool) -> None:
        """The read or fetch `tid` (still pending) lands or fails."""
        if tid not in self.reads:
            return
        self.reads.remove(tid)
        completion = (SlotRead(transfer=tid) if ok
                      else SlotReadFailed(transfer=tid, cause="missing"))
        self.complete(tid, completion, ok)

    @precondition(lambda self: self.queued)
    @fuzz_rule(pick=st.integers(0, 11))
    def queued_request_moves(self, pick: int) -> None:
        """A queued request is admitted, leaves the queue, or asks again for its blocks
        (pick modulo 3)."""
        rid, prompt = self.queued[(pick // 3) % len(self.queued)]
        if pick % 3 == 2:
            self._prefetch_again(rid)
        elif pick % 3:
            self._leave(rid, prompt)
        else:
            self._admit(rid, prompt)

    @fuzz_rule(report=cost_reports)
    def report_costs(self, report: CostReport) -> None:
        """The reader reports a read, the serving loop a prefill (cost-aware onboarding)."""
        nbytes = self.core.config.block_bytes
        seconds = nbytes / report.disk_bytes_per_second
        self.both(lambda: self.core.report_disk_read(nbytes, seconds),
                  lambda: self.model.report_disk_read(nbytes, seconds))
        # The network is as fast as the disk here, and ten times faster.
        fetched = seconds / (1 + 9 * (report.context_tokens > 4))
        self.both(lambda: self.core.report_fetch(nbytes, fetched),
                  lambda: self.model.report_fetch(nbytes, fetched))
        tokens = report.context_tokens // 2
        spent = tokens * report.prefill_seconds_per_token
        self.both(lambda: self.core.report_prefill(tokens, spent,
                                                   context_tokens=report.context_tokens),
                  lambda: self.model.report_prefill(tokens, spent,
                                                    context_tokens=report.context_tokens))

    def _serve(
        self, prompt: list[int], ttl: float | None, priority: int, salt: str | None = None
    ) -> None:
        """Add, compute and release one request (released unserved if it is parked)."""
        rid = self._add(prompt, ttl, priority, salt)
        if rid is None:
            return
        self.served.append(prompt)
        if self.core.is_ready(rid):
            self._compute(rid, 100)
        self._release(rid)

    @fuzz_rule(spec=requests)
    def serve_whole_request(self, spec: RequestSpec) -> None:
        self._serve(list(spec.prompt), spec.ttl, spec.priority, spec.salt)

    @fuzz_rule(spec=requests)
    def comes_back_after_eviction(self, spec: RequestSpec) -> None:
        """A conversation whose KV was pushed down to disk comes back: serve it, serve two
        GPU-sized fresh requests landing every transfer, then ask for it again (kept, and
        parked while its blocks are read back)."""
        prompt = list(spec.prompt)
        self._serve(prompt, spec.ttl, spec.priority, spec.salt)
        cfg = self.core.config
        for _ in range(2):
            self.next_token += 1
            full = cfg.gpu_blocks * cfg.block_size - 1
            self._serve([100 + self.next_token * 64 + i for i in range(full)], None, 0)
            self._drain()
        self._add(prompt, spec.ttl, spec.priority, spec.salt)

    @precondition(lambda self: self.served)
    @fuzz_rule(pick=st.integers(0, 63))
    def revisit(self, pick: int) -> None:
        """Ask again for a prompt served before (a multi-round chat's next turn): kept
        (pick odd) or served whole, with a TTL when pick % 4 >= 2."""
        prompt = self.served[(pick // 4) % len(self.served)]
        ttl = 5.0 if pick % 4 >= 2 else None
        if pick % 2:
            self._add(prompt, ttl, 0, None)
        else:
            self._serve(prompt, ttl, 0)

    @fuzz_rule(spec=churns)
    def churn(self, spec: ChurnSpec) -> None:
        """Serve a request of never-seen tokens: it pushes older content down the tiers.
        With `land`, every transfer then lands: repeated, it fills the disk."""
        self.next_token += 1
        cfg = self.core.config
        full = cfg.gpu_blocks * cfg.block_size - 1
        size = full if spec.blocks is None else min(spec.blocks * cfg.block_size + 1, full)
        self._serve([100 + self.next_token * 64 + i for i in range(size)], spec.ttl, 0)
        if spec.land:
            self._drain()

    @precondition(lambda self: self.live)
    @fuzz_rule(action=request_actions)
    def act_on_a_request(self, action: RequestAction) -> None:
        """Compute, decode, release or cancel one of the live requests."""
        if action.kind == "cancel":
            parked = [rid for rid in self.live if not self.core.is_ready(rid)]
            if parked:
                self._release(parked[action.pick % len(parked)])
            return
        rid = self.live[action.pick % len(self.live)]
        if action.kind == "compute":
            self._compute(rid, action.amount)
        elif action.kind == "release":
            self._release(rid)
        else:
            token = action.amount
            self.both(lambda: self.core.append_tokens(rid, [token]),
                      lambda: self.model.append_tokens(rid, [token]))

    def _compute(self, rid: str, extra: int) -> None:
        """Allocate pages for 1 + `extra` more known tokens, then commit them if ready."""
        status = self.core.request_status(rid)
        target = min(status.num_tokens, status.num_computed_tokens + 1 + extra)
        self.both(lambda: self.core.allocate_nowait(rid, target, now=self.now),
                  lambda: self.model.allocate_nowait(rid, target, now=self.now))
        if self.core.is_ready(rid) and \
                len(self.core.block_table(rid)) * self.core.config.block_size >= target:
            self.both(lambda: self.core.commit(rid, target, now=self.now),
                      lambda: self.model.commit(rid, target, now=self.now))

    def _release(self, rid: str) -> None:
        self.live.remove(rid)
        self.both(lambda: self.core.release(rid, now=self.now),
                  lambda: self.model.release(rid, now=self.now))

    # -------------------------------------------------------------- transfers

    @precondition(lambda self: self.writes or self.reads)
    @fuzz_rule(action=transfer_actions)
    def complete_a_transfer(self, action: TransferAction) -> None:
        """A pending write or read lands or fails (picked by transfer id), or all land."""
        if action.kind == "drain":
            self._drain()
            return
        wanted = self.reads if action.kind == "read" else self.writes
        pending = wanted or self.writes or self.reads
        tid = pending.pop(-1 if action.newest and pending is wanted else 0)
        completion: Completion
        if pending is self.reads:
            completion = (SlotRead(transfer=tid) if action.ok
                          else SlotReadFailed(transfer=tid, cause="short read"))
        else:
            completion = (SlotWritten(transfer=tid) if action.ok
                          else SlotWriteFailed(transfer=tid, cause="EIO"))
        self.complete(tid, completion, action.ok)

    def _drain_writes(self) -> None:
        while self.writes:
            tid = self.writes.pop(0)
            self.complete(tid, SlotWritten(transfer=tid), True)

    def _drain(self) -> None:
        """Every transfer in flight lands, oldest first (writes, then reads)."""
        while self.writes or self.reads:
            if self.writes:
                tid = self.writes.pop(0)
                self.complete(tid, SlotWritten(transfer=tid), True)
            else:
                tid = self.reads.pop(0)
                self.complete(tid, SlotRead(transfer=tid), True)

    @fuzz_rule(down=st.sampled_from(DOWN_TIMES))
    def restart(self, down: float) -> None:
        """The process stops after its transfers landed and a new one opens the directory
        `down` seconds later: a fresh core and a fresh reference model restore what the
        slots hold (retained and still live, retained but expired while down, best-effort),
        and from here on every displacement is compared step by step."""
        self._drain()
        blocks = sorted(self.disk_image.values(), key=lambda b: b.slot)
        config = self.core.config
        self.now += down
        self.real = KVCacheManager(config, trace=self.trace)
        self.model = ReferenceCache(config)
        self.contract = CommandContract(config.max_batch_blocks)
        self.contract.slot_content = {b.slot: b.key for b in blocks}
        self.live.clear()
        self.queued.clear()
        self.queued_tokens.clear()
        self.pending_reads.clear()
        self.fetches.clear()
        self.both(lambda: self.core.restore(blocks, now=self.now),
                  lambda: self.model.restore(blocks, now=self.now))
        note(f"restarted after {down} s with {len(blocks)} blocks on disk")

    @fuzz_rule(dt=st.sampled_from(CLOCK_STEPS))
    def advance_clock(self, dt: float) -> None:
        self.now += dt
        self.both(lambda: self.core.advance(self.now), lambda: self.model.advance(self.now))

    # -------------------------------------------------------------- invariants

    @invariant()
    def agrees_with_the_spec(self) -> None:
        real = self.real
        if real is None:
            return
        real.check_invariants()
        assert real.statistics() == self.model.statistics()
        real_cached = observed(real.cached_blocks())
        assert real_cached == self.model.cached()
        contract = self.contract
        reading = contract.read_pages
        for rid in self.live:
            ready = real.is_ready(rid)
            assert ready == self.model.is_ready(rid)
            assert real.request_status(rid).num_computed_tokens == self.model.num_computed(rid)
            if ready and reading:
                pending = [p for p in real.block_table(rid) if p in reading]
                assert not pending, f"{rid} is ready but reads still fill pages {pending}"
        if reading:
            free = [p for p in real._gpu.empty if p in reading]
            assert not free, f"GPU pages {free} are free while reads fill them"
        if contract.busy:
            empty = [s for s in real._disk.slots.empty if s in contract.busy]
            assert not empty, f"slots {empty} are empty while transfers use them"
        for rid in self.queued_tokens:
            in_flight = real.prefetch_reads_pending(rid)
            assert in_flight <= self.pending_reads.get(rid, 0), (rid, in_flight)
            self.pending_reads[rid] = in_flight
        if contract.prefetch_pages:
            host = real._host
            free = [p for p in (*host.empty, *host.reserved) if p in contract.prefetch_pages]
            assert not free, f"host pages {free} are free while prefetches fill them"

    def teardown(self) -> None:
        real = self.real
        if real is None:
            return
        stats = real.statistics()
        for name in ("spills", "onboards", "onboard_failures", "spill_failures",
                     "displacements", "expirations", "gate_drops", "pressure_drops",
                     "admission_refusals", "requests_fallen_back", "host_recalls",
                     "offloads_skipped", "disk_busy_refusals", "prefetches",
                     "prefetch_hits", "prefetches_taken_over", "prefetches_cancelled",
                     "prefetches_reclaimed", "prefetch_failures",
                     "onboards_skipped_as_too_slow", "fetches", "fetch_failures",
                     "hit_blocks_remote", "fetches_skipped_as_too_slow", "publishes_offered"):
            if getattr(stats, name):
                note(f"reached {name}")
