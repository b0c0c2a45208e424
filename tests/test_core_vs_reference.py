"""The real core against the executable reference model, step by step (pure, no I/O).

Hypothesis drives both with the same operations -- requests with shared prefixes, salts and
TTLs, allocation, commits, decode, releases, completions and failures of disk transfers in
an order it chooses, and the clock -- and after every step compares everything a caller can
observe, then runs ``check_invariants()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from fuzz.spy import command_kinds
from specs.reference_model import ReferenceCache, in_batches, observed
from statekv import CacheConfig, KVCacheManager, OutOfBlocks, SpillMode, UsageError
from statekv.ids import BlockHash, SlotId, TransferId
from statekv.lifecycle import BlockState
from statekv.manager import RestoredBlock
from statekv.messages import (
    FetchBlock,
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
from tests.harness import block_keys

T = TypeVar("T")


# A few documents that prompts share prefixes of, so that matches happen often.
DOCUMENTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5]]


@st.composite
def configs(draw: st.DrawFn) -> CacheConfig:
    disk = draw(st.integers(0, 8))
    host = draw(st.integers(1 if disk else 0, 3))
    return CacheConfig(
        block_size=draw(st.sampled_from([2, 2, 4])),
        gpu_blocks=draw(st.integers(4, 8)),
        host_blocks=host,
        reserved_host_blocks=draw(st.integers(0, 2)) if disk else 0,
        disk_blocks=disk,
        spill_mode=draw(st.sampled_from(list(SpillMode))),
        spill_min_reuse=draw(st.integers(1, 2)),
        protect_unexpired=draw(st.booleans()),
        cost_aware_onboarding=draw(st.booleans()),
        reclaim_prefetched_first=draw(st.booleans()),
        drop_on_pressure=draw(st.booleans()),
        write_queue_depth=draw(st.integers(1, 3)),
        priority_levels=draw(st.integers(1, 3)),
        shared_tier=draw(st.booleans()),
        retention_write_through=draw(st.booleans()),
        publish_on=draw(st.sampled_from(["eviction", "release"])),
    )


prompts = st.builds(
    lambda doc, cut, tail: DOCUMENTS[doc][:cut] + tail,
    st.integers(0, len(DOCUMENTS) - 1),
    st.integers(1, 12),
    st.lists(st.integers(0, 3), max_size=3),
)


class CoreMatchesReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.real: KVCacheManager
        self.model: ReferenceCache
        self.now = 0.0
        self.writes: list[TransferId] = []
        self.reads: list[TransferId] = []
        self.live: list[str] = []
        self.next_id = 0
        self.next_token = 0
        self.served: list[list[int]] = []
        self.queued: list[tuple[str, list[int]]] = []
        self.cluster: set[BlockHash] = set()
        """Keys the emulated shared tier holds: what was published, by this cache or
        another replica."""

    @initialize(config=configs())
    def build(self, config: CacheConfig) -> None:
        self.real = KVCacheManager(config)
        self.model = ReferenceCache(config)
        self.config = config
        self.issued: dict[TransferId, WriteSlot] = {}
        self.on_slot: dict[SlotId, WriteSlot] = {}
        """The write whose bytes each slot holds (the emulated disk)."""

    # -------------------------------------------------------------- both sides, compared

    def both(self, real: Callable[[], T], model: Callable[[], Any]) -> T | None:
        """Run one operation on both; they must succeed or fail alike."""
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
        real = self.real.take_commands()
        model = self.model.commands
        self.model.commands = []
        assert command_kinds(real) == in_batches(model, self.model.cfg.max_batch_blocks)
        for c in per_block(real):
            if isinstance(c, WriteSlot):
                self.writes.append(c.transfer)
                self.issued[c.transfer] = c
            elif isinstance(c, ReadSlot | PrefetchSlot | FetchBlock):
                # Prefetch reads and fetches complete the same way (the model tells them
                # apart).
                self.reads.append(c.transfer)
            elif isinstance(c, PublishBlock):
                self.cluster.add(c.key)

    # -------------------------------------------------------------- rules

    @rule(
        prompt=prompts,
        ttl=st.sampled_from([None, 0, 1.0, 5.0, 30.0]),
        priority=st.integers(0, 2),
        salt=st.sampled_from([None, None, "tenant-b"]),
    )
    def add_request(
        self, prompt: list[int], ttl: float | None, priority: int, salt: str | None,
        remote: bool = False,
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        priority = min(priority, self.real.config.priority_levels - 1)
        keys: tuple[BlockHash, ...] = ()
        if remote and self.config.shared_tier:
            # The remote fetcher's lookup: the candidates the cluster holds.
            try:
                candidates = self.real.remote_candidates(prompt, cache_salt=salt)
            except UsageError:
                candidates = ()
            else:
                assert candidates == self.model.remote_candidates(prompt, cache_salt=salt)
            keys = tuple(k for k in candidates if k in self.cluster)
        try:
            match = self.real.add_request(
                rid, prompt, now=self.now, ttl_seconds=ttl, priority=priority, cache_salt=salt,
                remote_keys=keys,
            )
        except (OutOfBlocks, UsageError) as exc:
            try:
                self.model.add_request(rid, prompt, now=self.now, ttl_seconds=ttl,
                                       priority=priority, cache_salt=salt, remote_keys=keys)
            except type(exc):
                return
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
        self.queued = [q for q in self.queued if q[0] != rid]

    @precondition(lambda self: self.config.shared_tier)
    @rule(prompt=prompts, salt=st.sampled_from([None, "tenant-b"]), keep=st.booleans(),
          forget=st.integers(0, 1000))
    def add_from_shared_tier(self, prompt: list[int], salt: str | None, keep: bool,
                             forget: int) -> None:
        """Another replica published the prompt's blocks (the cluster may have lost one
        since); this cache is asked for the prompt, matching past its local tiers."""
        keys = block_keys(prompt, self.config.block_size, salt=salt)
        self.cluster.update(keys)
        if keys and forget < 300:
            self.cluster.discard(keys[forget % len(keys)])
        before = set(self.live)
        self.add_request(prompt, None, 0, salt, remote=True)
        added = [rid for rid in self.live if rid not in before]
        if added and not keep:
            self.release(self.live.index(added[0]))  # release during the fetch

    @rule(prompt=prompts, revisit=st.booleans(), pick=st.integers(0, 1000))
    def prefetch(self, prompt: list[int], revisit: bool, pick: int) -> None:
        """A request joins the queue and asks for its disk blocks ahead of admission."""
        if revisit and self.served:
            prompt = self.served[pick % len(self.served)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        got = self.both(lambda: self.real.prefetch(rid, prompt, now=self.now),
                        lambda: self.model.prefetch(rid, prompt, now=self.now))
        if got is None:
            return
        self.queued.append((rid, prompt))
        self.model_prefetch_checked(got)

    @precondition(lambda self: self.served and self.real.config.disk_blocks > 0)
    @rule(pick=st.integers(0, 1000), churn_first=st.booleans())
    def prefetch_from_disk(self, pick: int, churn_first: bool) -> None:
        """Prefetch a served prompt that has a block on disk (pushed there first if asked):
        the case prefetch is for, and the races around it (reclaim, cancel, take-over)."""
        if churn_first:
            self.fill_disk(None)
        on_disk = {b.key for b in self.real.cached_blocks() if b.state is BlockState.ON_DISK}
        if not on_disk:
            return
        for i in range(len(self.served)):
            prompt = self.served[(pick + i) % len(self.served)]
            keys = block_keys(prompt, self.config.block_size)
            if any(k in on_disk for k in keys[: (len(prompt) - 1) // self.config.block_size]):
                self.prefetch(prompt, False, 0)
                return

    def model_prefetch_checked(self, got: Any) -> None:
        # `both` ran the model already; compare what the last call reported.
        assert (got.started_tokens, got.shared_tokens, got.cached_tokens,
                got.unfetched_tokens) == self.model.last_prefetch

    @precondition(lambda self: self.queued)
    @rule(pick=st.integers(0, 1000), admit=st.booleans())
    def leave_or_admit_queued(self, pick: int, admit: bool) -> None:
        """A queued request is admitted (its prefetch taken over) or leaves the queue."""
        rid, prompt = self.queued.pop(pick % len(self.queued))
        if admit:
            self.add_request_as(rid, prompt)
        else:
            self.both(lambda: self.real.release(rid, now=self.now),
                      lambda: self.model.release(rid, now=self.now))

    def add_request_as(self, rid: str, prompt: list[int]) -> None:
        try:
            match = self.real.add_request(rid, prompt, now=self.now)
        except (OutOfBlocks, UsageError) as exc:
            try:
                self.model.add_request(rid, prompt, now=self.now)
            except type(exc):
                self.queued.append((rid, prompt))  # still queued, nothing changed
                return
            raise AssertionError(f"real raised {exc!r}, the model did not") from None
        expected = self.model.add_request(rid, prompt, now=self.now)
        assert (match.matched_tokens, match.host_tokens, match.disk_tokens,
                match.skipped_disk_tokens) == (expected.matched_tokens, expected.host_tokens,
                                               expected.disk_tokens,
                                               expected.skipped_disk_tokens)
        self.collect_commands()
        self.live.append(rid)

    @rule(
        mib_per_s=st.sampled_from([0.001, 1.0, 1000.0]),
        us_per_token=st.sampled_from([0.1, 10.0, 1000.0]),
        context=st.integers(1, 64),
    )
    def report_costs(self, mib_per_s: float, us_per_token: float, context: int) -> None:
        """The actors report a read and the serving loop a prefill (cost-aware onboarding)."""
        nbytes = self.config.block_bytes * 4
        seconds = nbytes / (mib_per_s * 2**20)
        self.both(lambda: self.real.report_disk_read(nbytes, seconds),
                  lambda: self.model.report_disk_read(nbytes, seconds))
        self.both(lambda: self.real.report_fetch(nbytes, seconds / 2),
                  lambda: self.model.report_fetch(nbytes, seconds / 2))
        tokens = max(1, context // 2)
        self.both(
            lambda: self.real.report_prefill(tokens, tokens * us_per_token * 1e-6,
                                             context_tokens=context),
            lambda: self.model.report_prefill(tokens, tokens * us_per_token * 1e-6,
                                              context_tokens=context),
        )

    @rule(
        prompt=prompts,
        ttl=st.sampled_from([None, 1.0, 5.0, 30.0]),
        priority=st.integers(0, 2),
    )
    def serve_whole_request(self, prompt: list[int], ttl: float | None, priority: int) -> None:
        """Add, compute and release one request in a single step (fills the cache fast)."""
        before = set(self.live)
        self.add_request(prompt, ttl, priority, None, remote=True)
        added = [rid for rid in self.live if rid not in before]
        if not added:
            return
        rid = added[0]
        self.served.append(prompt)
        if self.real.is_ready(rid):
            self.compute(self.live.index(rid), 100)
        self.release(self.live.index(rid))

    @precondition(lambda self: self.served)
    @rule(pick=st.integers(0, 1000), ttl=st.sampled_from([None, 5.0]), keep=st.booleans())
    def revisit(self, pick: int, ttl: float | None, keep: bool) -> None:
        """Ask again for a prompt served before (a multi-round chat's next turn)."""
        prompt = self.served[pick % len(self.served)]
        if keep:
            self.add_request(prompt, ttl, 0, None)
        else:
            self.serve_whole_request(prompt, ttl, 0)

    @rule(length=st.integers(1, 4), then_drain=st.booleans())
    def churn(self, length: int, then_drain: bool) -> None:
        """Serve a request of never-seen tokens: it pushes older content down the tiers."""
        self.next_token += 1
        size = min(length * self.real.config.block_size + 1,
                   self.real.config.gpu_blocks * self.real.config.block_size)
        prompt = [100 + self.next_token * 16 + i for i in range(size)]
        self.serve_whole_request(prompt, None, 0)
        if then_drain and (self.writes or self.reads):
            self.drain()

    @precondition(lambda self: self.real.config.disk_blocks > 0)
    @rule(ttl=st.sampled_from([None, 2.0, 10.0]))
    def fill_disk(self, ttl: float | None) -> None:
        """Churn (with a TTL or not) until no disk slot is empty, or give up after a while."""
        for _ in range(2 * self.real.config.disk_blocks):
            if self.real.statistics().disk_empty_slots == 0:
                break
            self.next_token += 1
            size = self.real.config.gpu_blocks * self.real.config.block_size - 1
            prompt = [100 + self.next_token * 64 + i for i in range(size)]
            self.serve_whole_request(prompt, ttl, 0)
            if self.writes or self.reads:
                self.drain()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000), extra=st.integers(0, 8))
    def compute(self, pick: int, extra: int) -> None:
        """Allocate pages for (part of) the known tokens, then commit them if ready."""
        rid = self.live[pick % len(self.live)]
        status = self.real.request_status(rid)
        target = min(status.num_tokens, status.num_computed_tokens + 1 + extra)
        self.both(lambda: self.real.allocate_nowait(rid, target, now=self.now),
                  lambda: self.model.allocate_nowait(rid, target, now=self.now))
        if self.real.is_ready(rid) and len(self.real.block_table(rid)) * \
                self.real.config.block_size >= target:
            self.both(lambda: self.real.commit(rid, target, now=self.now),
                      lambda: self.model.commit(rid, target, now=self.now))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000), token=st.integers(0, 3))
    def decode(self, pick: int, token: int) -> None:
        rid = self.live[pick % len(self.live)]
        self.both(lambda: self.real.append_tokens(rid, [token]),
                  lambda: self.model.append_tokens(rid, [token]))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick: int) -> None:
        rid = self.live.pop(pick % len(self.live))
        self.both(lambda: self.real.release(rid, now=self.now),
                  lambda: self.model.release(rid, now=self.now))

    @precondition(lambda self: self.writes)
    @rule(ok=st.booleans())
    def complete_oldest_write(self, ok: bool) -> None:
        tid = self.writes.pop(0)
        event = SlotWritten(transfer=tid) if ok else SlotWriteFailed(transfer=tid, cause="EIO")
        self.both(lambda: self.real.handle(event, now=self.now),
                  lambda: self.model.write_done(tid, ok, self.now))
        if ok:
            write = self.issued[tid]
            self.on_slot[write.slot] = write

    @precondition(lambda self: not self.live and not self.writes and not self.reads
                  and not self.queued)
    @rule(downtime=st.sampled_from([0.0, 1.0, 10.0, 60.0]))
    def restart(self, downtime: float) -> None:
        """The process stops and a new one restores what is on disk (an index rebuild
        gives both sides the same entries: the slots whose content the index held)."""
        on_disk = {b.key for b in self.real.cached_blocks() if b.state is BlockState.ON_DISK}
        entries = [
            RestoredBlock(key=w.key, parent_key=w.parent, slot=w.slot, depth=w.depth,
                          reuse_count=w.reuse_count, expiry=w.expiry, written_at=w.issued_at,
                          sequence=w.transfer)
            for w in self.on_slot.values() if w.key in on_disk and w.parent is not None
        ]
        assert len(entries) == len(on_disk)
        self.now += downtime
        self.real = KVCacheManager(self.config)
        self.model = ReferenceCache(self.config)
        self.issued = {}
        self.on_slot = {e.slot: w for e in entries for w in self.on_slot.values()
                        if w.slot == e.slot}
        self.both(lambda: self.real.restore(entries, now=self.now),
                  lambda: self.model.restore(entries, now=self.now))
        event(f"restored {min(len(entries), 3)}+ blocks")

    @precondition(lambda self: self.writes or self.reads)
    @rule()
    def drain(self) -> None:
        """Every transfer in flight lands, oldest first (writes, then reads)."""
        while self.writes:
            self.complete_oldest_write(True)
        while self.reads:
            self.complete_a_read(True, False)

    @precondition(lambda self: self.reads)
    @rule(ok=st.booleans(), newest=st.booleans())
    def complete_a_read(self, ok: bool, newest: bool) -> None:
        tid = self.reads.pop(-1 if newest else 0)
        event = SlotRead(transfer=tid) if ok else SlotReadFailed(transfer=tid, cause="EIO")
        self.both(lambda: self.real.handle(event, now=self.now),
                  lambda: self.model.read_done(tid, ok, self.now))

    @rule(dt=st.sampled_from([0.5, 1.0, 5.0, 30.0]))
    def advance_clock(self, dt: float) -> None:
        self.now += dt
        self.both(lambda: self.real.advance(self.now), lambda: self.model.advance(self.now))

    def teardown(self) -> None:
        if hasattr(self, "real"):
            stats = self.real.statistics()
            for name in ("spills", "onboards", "onboard_failures", "spill_failures",
                         "displacements", "expirations", "gate_drops", "pressure_drops",
                         "admission_refusals", "requests_fallen_back", "host_recalls",
                         "offloads_skipped", "disk_busy_refusals", "hit_blocks_gpu",
                         "prefetches", "prefetch_hits", "prefetches_taken_over",
                         "prefetches_cancelled", "prefetches_reclaimed", "prefetch_failures",
                         "onboards_skipped_as_too_slow", "fetches", "fetch_failures",
                         "fetches_skipped_as_too_slow", "publishes_offered",
                         "hit_blocks_remote", "host_copies_kept",
                         "offloads_saved_by_host_copy"):
                if getattr(stats, name):
                    event(f"reached {name}")

    # -------------------------------------------------------------- invariants

    @invariant()
    def structures_hold(self) -> None:
        if hasattr(self, "real"):
            self.real.check_invariants()

    @invariant()
    def observations_agree(self) -> None:
        if not hasattr(self, "real"):
            return
        assert self.real.statistics() == self.model.statistics()
        real_cached = observed(self.real.cached_blocks())
        assert real_cached == self.model.cached()
        for rid in self.live:
            assert self.real.is_ready(rid) == self.model.is_ready(rid)
            assert self.real.request_status(rid).num_computed_tokens == \
                self.model.num_computed(rid)


TestCoreMatchesReference = CoreMatchesReference.TestCase
TestCoreMatchesReference.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
