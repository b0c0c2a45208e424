"""Machine 2: the whole system -- real actors, real files, real torch copies -- against the spec.

Each example opens a :class:`~io_actors.embed.BlockingCache` (its trio loop in a thread of its
own, the writer and reader pools on threads of their own) over a real slot store in a fresh
temporary directory, with torch copies on the device (CUDA in the GPU profile), through a
:class:`fuzz.driver.Driver`.  Two seams are the harness's:

* the **completion gate** (:class:`fuzz.gate.FuzzGate`): every transfer does its real I/O,
  then its completion waits; a rule releases the oldest or newest pending write or read, by
  transfer id, so Hypothesis decides the order in which the core learns about them;
* the **store** (:class:`fuzz.store.FuzzStore`): a rule arms a fault -- EIO on open, read or
  write, ENOSPC, short or torn transfers, a bit flip on disk, a slow call -- for the next
  write or read the core issues, or stalls the disk: every later write blocks in the store
  until a rule unstalls it (a disk that stopped answering; the writer queue fills and spills
  back up behind it).

The rules play the serving loop: requests with shared prefixes, salts, TTLs and priorities;
compute (allocate, write KV into the pages, commit); decode; release; cancel while parked;
churn and bursts of spills; fill the disk; advance the clock (TTLs run out while transfers
are in flight); drain; and close without draining, with whatever is in flight, then start
over with a fresh cache.

After every step the machine waits until the system is quiet -- every job handed to a pool is
either reported, or held at the gate, or stalled in the store, read from the pools'
``statistics()``, the scheduler's ``spill_backlog`` and the gate's and store's counts (never
``wait_all_tasks_blocked``, which cannot see worker threads) -- then runs every check of
:meth:`fuzz.driver.Driver.check`, and checks that every store call that failed is a failed
completion, counted or still held at the gate.  Every serving-loop call is watched
(:class:`fuzz.driver.Watchdog`): none may wait on disk I/O, even with the disk stalled and
the writer queue full.  Teardown drains,
releases every request and runs :meth:`~fuzz.driver.Driver.check_nothing_leaks`.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import ClassVar

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition

from fuzz.core_machine import (
    CLOCK_STEPS,
    ChurnSpec,
    CostReport,
    PrefetchRace,
    RequestSpec,
    churns,
    cost_reports,
    prefetch_races,
    requests,
)
from fuzz.driver import CLOSE_TIMEOUT, Driver, LiveRequest, SystemSpec, system_specs
from fuzz.gate import FuzzGate
from fuzz.memory_probe import MemoryProbe
from fuzz.steps import Counts, fuzz_rule, note
from fuzz.store import READ_FAULTS, WRITE_FAULTS
from fuzz.waiters import Waiters
from io_actors.actors.scheduler import CloseReport
from io_actors.storage.faults import Fault, Op
from io_actors.tracing.recorder import TraceRecorder
from statekv.ids import BlockHash, TransferId
from statekv.messages import (
    Command,
    PrefetchSlots,
    ReadSlots,
    WriteSlots,
    is_read,
)
from statekv.stats import CacheStatistics

SILENT_WRITE_FAULTS = (Fault.BIT_FLIP, Fault.TORN_WRITE_SILENT)
"""Writes reported done whose bytes on disk are not what was written: only the checksum of
the read that follows stands between them and the model."""
SETTLE_TIMEOUT = 30.0
"""Seconds the system may take to become quiet after a step before the step fails."""


def writer_pipeline(waiting: int, depth: int) -> tuple[int, int]:
    """Where `waiting` writes that no thread has taken rest while every writer thread is
    stalled: ``(writer.queued, spill_backlog)``.  The pool's pump holds the first (waiting
    for a free thread), the queue the next `depth`, the spill feeder the next (waiting in
    submit() for room; the pool counts it as queued), the backlog the rest."""
    queued = min(waiting, depth + 2)
    return queued, waiting - queued


class SystemMachine(RuleBasedStateMachine):
    """The real system, with completion order and faults chosen by Hypothesis."""

    device: ClassVar[str] = "cpu"
    """Where the KV pools live ("cuda" in the GPU profile)."""
    backend: ClassVar[str] = "posix"
    """The slot store under the fault layer ("kvikio" in the GPU profile, when installed)."""
    def __init__(self) -> None:
        super().__init__()
        Counts.examples += 1
        self.driver: Driver | None = None
        self.memory_probe: MemoryProbe | None = None
        """What the leak check measures (None: the CUDA allocator's count where the pools are
        on CUDA, nothing on the CPU; tests plant :func:`fuzz.memory_probe.live_pool_bytes`)."""
        self.trace: TraceRecorder | None = None
        self.changed = threading.Condition()
        self.gate = FuzzGate(self.notify)
        self.arm_write: Fault | None = None
        self.arm_read: Fault | None = None
        self.arm_write_at = self.arm_read_at = 0
        """Which transfer of the next batch an armed fault goes to (the last, if fewer)."""
        self.stall_writes = False
        self.write_batches: set[TransferId] = set()
        self.read_batches: set[TransferId] = set()
        """Names of the batches dispatched (pruned to those in flight by quiet())."""
        self.batch_blocks: dict[TransferId, int] = {}
        """Block transfers of each write batch in flight, by name."""
        self.faults_by_key: dict[tuple[Op, BlockHash], Fault] = {}
        """Faults for the transfers of one content (corrupt_and_read_back), by operation."""
        self._waiters: Waiters | None = None

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    @initialize(spec=system_specs())
    def open(self, spec: SystemSpec) -> None:
        self._open(spec, memory_baseline=None)

    def _open(self, spec: SystemSpec, *, memory_baseline: int | None) -> None:
        self.driver = Driver(spec, device=self.device, backend=self.backend, gate=self.gate,
                             on_commands=self.on_commands, notify=self.notify,
                             rescue=self.gate.open, memory_probe=self.memory_probe,
                             memory_baseline=memory_baseline)
        self.trace = self.driver.trace
        self._waiters = Waiters(self.driver, self.notify)
        note(f"writers={spec.writers} readers={spec.readers}")

    @property
    def d(self) -> Driver:
        assert self.driver is not None
        return self.driver

    @property
    def waiters(self) -> Waiters:
        assert self._waiters is not None
        return self._waiters

    def on_commands(self, commands: list[Command]) -> None:
        """Called as the scheduler takes commands, before it executes any: an armed fault goes
        to the next transfer of its kind, and every write stalls while the disk is stalled,
        by transfer identity."""
        store = self.d.fuzz_store
        for batch in commands:
            if isinstance(batch, WriteSlots):
                self.write_batches.add(batch.transfer)
                self.batch_blocks[batch.transfer] = len(batch.writes)
            elif isinstance(batch, ReadSlots | PrefetchSlots):
                self.read_batches.add(batch.transfer)
        for batch in commands:
            # A fault for one content's transfer (read_back_with_fault) goes to it, whichever
            # batch carries it.
            if isinstance(batch, WriteSlots | ReadSlots | PrefetchSlots):
                op = Op.WRITE if isinstance(batch, WriteSlots) else Op.READ
                transfers = batch.writes if isinstance(batch, WriteSlots) else batch.reads
                for one in transfers:
                    fault = self.faults_by_key.pop((op, one.key), None)
                    if fault is not None:
                        store.assign(op, one.slot, one.key, fault)
            if isinstance(batch, WriteSlots):
                if self.arm_write is not None:
                    cmd = batch.writes[min(self.arm_write_at, len(batch.writes) - 1)]
                    store.assign(Op.WRITE, cmd.slot, cmd.key, self.arm_write)
                    self.arm_write = None
                if self.stall_writes:
                    for cmd in batch.writes:
                        store.stall(Op.WRITE, cmd.slot, cmd.key)
            elif isinstance(batch, ReadSlots | PrefetchSlots) and self.arm_read is not None:
                read = batch.reads[min(self.arm_read_at, len(batch.reads) - 1)]
                store.assign(Op.READ, read.slot, read.key, self.arm_read)
                self.arm_read = None

    # -------------------------------------------------------------- quiescence

    def quiet(self) -> bool:
        """Whether nothing can move until the harness acts (see the module docstring)."""
        d = self.d
        stats = d.api.statistics()
        core, writer, reader = stats.cache, stats.writer, stats.reader
        assert writer is not None and reader is not None
        w_jobs_held, r_jobs_held = self.gate.jobs()
        passed = self.gate.passed()
        # Batches dispatched whose completion the core has not applied (the scheduler knows
        # every transfer in flight; a batch is named by its first).
        in_flight = set(d.api.transfers_in_flight())
        self.write_batches &= in_flight
        self.read_batches &= in_flight
        for name in set(self.batch_blocks) - self.write_batches:
            del self.batch_blocks[name]
        reads = core.reads_in_flight + core.prefetch_reads_in_flight
        if reads + core.writes_in_flight != len(in_flight):
            return False
        if not (len(self.read_batches) == reader.in_flight == r_jobs_held
                and reader.queued == 0):
            return False
        # Every completion the gate let through is counted by its pool.
        if (writer.completed + writer.failed != passed["written"] + passed["write failed"]
                or reader.completed + reader.failed != passed["read"] + passed["read failed"]):
            return False
        stalled = d.fuzz_store.stalled
        # Every job a writer thread took is held at the gate or stalled in the store.
        if writer.in_flight - w_jobs_held != stalled:
            return False
        waiting = len(self.write_batches) - w_jobs_held - stalled
        # Jobs wait for a thread only while every thread is stalled.
        if waiting and stalled < writer.workers:
            return False
        if not self.writes_placed(waiting):
            return False
        with d.frozen():
            missed = self.waiters.missed()
            # Registrations leave with the state change that lets them go, under one lock:
            # one left behind is a waiter nobody will wake.
            assert not missed, f"waiters of {missed} were never woken: the requests are " \
                "ready or gone"
            return self.waiters.all_woken()

    def writes_placed(self, waiting: int) -> bool:
        """Whether the `waiting` writes no thread has taken are where they rest (see
        :func:`writer_pipeline`), read from the scheduler's hand-over and backlog and the
        writer queue's own channel -- not from the counters that check_counters checks."""
        scheduler = self.d.api._scheduler
        pool = scheduler._writer
        assert pool is not None
        depth = self.d.spec.write_queue_depth
        channel = pool._send.statistics()
        feeding = waiting >= depth + 2
        return (not scheduler._handover
                and channel.current_buffer_used == min(max(waiting - 1, 0), depth)
                and channel.tasks_waiting_send == feeding
                # The feeder takes its job off the backlog before submit(); where it keeps
                # it is not this check's business (check_counters counts the backlog).
                and len(scheduler._spill_backlog) - max(waiting - depth - 2, 0)
                in ((0, 1) if feeding else (0,)))

    def settle(self) -> None:
        """Wait until the system is quiet; a crashed actor or a hang fails the step."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        wait = 0.00005
        while not self.quiet():
            self.d.raise_if_crashed()
            if time.monotonic() > deadline:
                # A counter that disagrees keeps the system from looking quiet: name it.
                self.check_counters()
                raise AssertionError(
                    f"the system did not settle in {SETTLE_TIMEOUT}s: "
                    f"{self.d.api.statistics()}, gate {self.gate.counts()}, "
                    f"stalled {self.d.fuzz_store.stalled}"
                )
            with self.changed:
                self.changed.wait(wait)
            wait = min(wait * 2, 0.002)
        self.d.raise_if_crashed()

    def check_counters(self) -> None:
        """Every counter of ``statistics()`` that the model does not own, against the
        harness's own count (the core's counters are compared with the model's in
        :meth:`fuzz.driver.Driver.check`): the pools' threads, queues, completions and
        failures, the spill backlog, the slots discarded.  Called when the system is quiet.
        """
        d = self.d
        stats = d.api.statistics()
        core, writer, reader = stats.cache, stats.writer, stats.reader
        assert writer is not None and reader is not None
        # Pools count jobs (a batch is one) in their queues and threads, and block transfers
        # in their completions; the gate holds a batch's completion as one.
        w_held, r_held = self.gate.jobs()
        passed = self.gate.passed()
        stalled = d.fuzz_store.stalled
        spec = d.spec
        assert (writer.workers, reader.workers) == (spec.writers, spec.readers), stats
        assert writer.in_flight == w_held + stalled, (
            f"writer in flight {writer.in_flight}: {w_held} held at the gate, {stalled} "
            f"stalled in the store")
        assert (reader.in_flight, reader.queued) == (r_held, 0), (
            f"reader {reader}: {r_held} read jobs held at the gate, none can wait for a thread")
        waiting = len(self.write_batches) - w_held - stalled
        assert waiting >= 0, f"{len(self.write_batches)} write batches in flight, {w_held} " \
            f"held, {stalled} stalled"
        queued, backlog = writer_pipeline(waiting, spec.write_queue_depth)
        assert (writer.queued, stats.spill_backlog) == (queued, backlog), (
            f"{waiting} write jobs wait for a thread (queue depth {spec.write_queue_depth}): "
            f"{queued} queued in the pool and {backlog} backed up expected, the statistics "
            f"say {writer.queued} and {stats.spill_backlog}")
        assert (writer.completed, writer.failed, reader.completed, reader.failed) == (
            passed["written"], passed["write failed"], passed["read"], passed["read failed"]
        ), f"pools {writer} {reader}, completions through the gate {passed}"
        assert (writer.completed, writer.failed, reader.completed, reader.failed) == (
            core.spills_completed, core.spill_failures,
            core.onboards_completed + core.prefetches_completed,
            core.onboard_failures + core.prefetch_failures,
        ), f"pools {writer} {reader} vs the core's {core}"
        assert writer.dropped_at_close == reader.dropped_at_close == 0, stats
        assert stats.slots_discarded == d.fuzz_store.discards, (
            f"{stats.slots_discarded} slots discarded, the store saw {d.fuzz_store.discards}")

    # -------------------------------------------------------------- rules: requests
    #
    # Every rule draws at most one choice (see fuzz.core_machine).

    @fuzz_rule(spec=requests)
    def add_request(self, spec: RequestSpec) -> None:
        self.d.add(list(spec.prompt), spec.ttl, spec.priority, spec.salt)

    @fuzz_rule(spec=requests)
    def serve_whole_request(self, spec: RequestSpec) -> None:
        self.d.serve(list(spec.prompt), spec.ttl, spec.priority, spec.salt)

    @fuzz_rule(spec=requests)
    def comes_back_after_eviction(self, spec: RequestSpec) -> None:
        """A conversation whose KV was pushed down to disk comes back: serve it, serve two
        GPU-sized fresh requests landing every transfer, then ask for it again (kept, and
        parked while its blocks are read back -- the reads stay held at the gate)."""
        d = self.d
        prompt = list(spec.prompt)
        d.serve(prompt, spec.ttl, spec.priority, spec.salt)
        for _ in range(2):
            d.serve(d.fresh_prompt(None), None, 0)
            self.drain_all()
        d.add(prompt, spec.ttl, spec.priority, spec.salt)

    @precondition(lambda self: self.driver is not None and self.d.served)
    @fuzz_rule(pick=st.integers(0, 63))
    def revisit(self, pick: int) -> None:
        """A prompt served before, asked again (a chat's next turn): kept (pick odd) or served
        whole, with a TTL when pick % 4 >= 2."""
        prompt, salt = self.d.served[(pick // 4) % len(self.d.served)]
        ttl = 5.0 if pick % 4 >= 2 else None
        if pick % 2:
            self.d.add(prompt, ttl, 0, salt)
        else:
            self.d.serve(prompt, ttl, 0, salt)

    @fuzz_rule(spec=churns)
    def churn(self, spec: ChurnSpec) -> None:
        """Serve fresh tokens, pushing older content down the tiers; with `land`, every
        transfer then lands."""
        self.d.serve(self.d.fresh_prompt(spec.blocks), spec.ttl, 0)
        if spec.land:
            self.drain_all()

    @fuzz_rule(count=st.integers(2, 4))
    def spill_burst(self, count: int) -> None:
        """Serve `count` full-size fresh requests back to back, landing nothing: a burst of
        evictions that fills the host tier and the writer queue."""
        for _ in range(count):
            self.d.serve(self.d.fresh_prompt(None), None, 0)

    @fuzz_rule(ttl=st.sampled_from([None, 2.0, 10.0]))
    def fill_disk(self, ttl: float | None) -> None:
        """Churn full-size requests, landing every transfer, until no slot is empty."""
        d = self.d
        for _ in range(d.spec.disk):
            if d.api.statistics().cache.disk_empty_slots == 0:
                break
            d.serve(d.fresh_prompt(None), ttl, 0)
            self.drain_all()

    def pick(self, pick: int) -> LiveRequest:
        live = self.d.live
        return list(live.values())[pick % len(live)]

    @precondition(lambda self: self.driver is not None and self.d.live)
    @fuzz_rule(pick=st.integers(0, 63))
    def compute(self, pick: int) -> None:
        """Compute 1 + pick // 8 more tokens of live request pick % 8."""
        self.d.compute(self.pick(pick % 8), pick // 8)

    @precondition(lambda self: self.driver is not None and self.d.live)
    @fuzz_rule(pick=st.integers(0, 31))
    def decode(self, pick: int) -> None:
        """Append token pick // 8 to live request pick % 8."""
        self.d.decode(self.pick(pick % 8), pick // 8)

    @precondition(lambda self: self.driver is not None and self.d.live)
    @fuzz_rule(pick=st.integers(0, 7))
    def release(self, pick: int) -> None:
        self.d.release(self.pick(pick).rid)

    def parked(self) -> list[str]:
        return [rid for rid in self.d.live if not self.d.api.is_ready(rid)]

    @precondition(lambda self: self.driver is not None and self.gate.counts()[1])
    @fuzz_rule(pick=st.integers(0, 15))
    def wait_ready_in_background(self, pick: int) -> None:
        """A waiter on parked request pick // 2: through the async API (open_cache's
        wait_ready, a trio task) when pick is even, through BlockingCache.wait_ready (a
        thread) when odd.  It wakes when the rules let its reads land or release it."""
        parked = self.parked()
        if parked:
            self.waiters.start(parked[(pick // 2) % len(parked)], blocking=bool(pick % 2))

    @precondition(lambda self: self.driver is not None and self.gate.counts()[1])
    @fuzz_rule(pick=st.integers(0, 7))
    def release_while_a_waiter_is_handed_over(self, pick: int) -> None:
        """The window between deciding to wait and the wait: a waiter is queued for the
        trio thread (held meanwhile), and the request is released before it runs.  It must
        wake as "gone", and the cache must live on (a waiter that raised in its system task
        killed the actor)."""
        parked = self.parked()
        if not parked:
            return
        rid = parked[pick % len(parked)]
        token = self.d.api._token
        assert token is not None
        running, go = threading.Event(), threading.Event()

        def hold_the_trio_thread() -> None:
            running.set()
            go.wait(30)

        token.run_sync_soon(hold_the_trio_thread)
        try:
            assert running.wait(30), "the cache's trio thread never ran"
            self.waiters.start(rid, blocking=False)  # queued behind the hold
            self.d.release(rid)
        finally:
            go.set()

    @fuzz_rule(spec=requests)
    def wait_for_a_comeback(self, spec: RequestSpec) -> None:
        """A conversation comes back from disk (comes_back_after_eviction) and the serving
        loop waits for it both ways, its reads held at the gate."""
        self.comes_back_after_eviction(spec)
        for rid in self.parked()[-1:]:
            self.waiters.start(rid, blocking=False)
            self.waiters.start(rid, blocking=True)

    @precondition(lambda self: self.driver is not None and self.gate.counts()[1])
    @fuzz_rule(pick=st.integers(0, 7))
    def cancel_parked(self, pick: int) -> None:
        """Release a request whose onboard reads are still in flight."""
        parked = [rid for rid in self.d.live if not self.d.api.is_ready(rid)]
        if parked:
            self.d.release(parked[pick % len(parked)])

    # -------------------------------------------------------------- rules: prefetch

    @fuzz_rule(spec=requests)
    def prefetch(self, spec: RequestSpec) -> None:
        """A request joins the queue and prefetches its disk blocks (reads held at the gate)."""
        self.d.prefetch(list(spec.prompt), spec.salt)

    @fuzz_rule(race=prefetch_races)
    def prefetch_race(self, race: PrefetchRace) -> None:
        """A prompt pushed down to disk is prefetched by a queued request, its reads held at
        the gate; then the race of fuzz/README.md's table: "leave" (released while its reads
        are in flight: the pages stay theirs until the reads land), "admit_early" (admitted
        before they land: they become its onboards), "admit" (they land, then it is admitted:
        host hits, their bytes checked), "evict" (they land, a GPU-sized request's evictions
        want host pages -- the prefetched ones, or host content first -- then it is
        admitted), "displace" (spills held in flight displaced disk content, possibly this
        prompt's, just before the prefetch; taking host pages for it spills more)."""
        d = self.d
        prompt = d.fresh_prompt(1 + race.pick % 3)
        # With a TTL (odd picks) a retained-only cache spills it and drops the fresh content
        # after it, which leaves host pages for the prefetch.
        d.serve(prompt, 30.0 if race.pick % 2 else None, 0)
        for _ in range(2):
            d.serve(d.fresh_prompt(None), None, 0)
            self.drain_all()
        if race.kind == "displace":
            d.serve(d.fresh_prompt(None), None, 0)  # its spills stay held
        rid = d.prefetch(prompt, None)
        if rid is None:
            return
        if race.kind == "leave":
            d.leave(rid)
        elif race.kind in ("admit_early", "displace"):
            d.admit(rid)
        else:
            self.drain_all()
            if race.kind == "evict":
                d.serve(d.fresh_prompt(None), None, 0)
            d.admit(rid)

    @precondition(lambda self: self.driver is not None and self.d.queued)
    @fuzz_rule(pick=st.integers(0, 11))
    def queued_request_moves(self, pick: int) -> None:
        """Queued request pick // 3 is admitted (pick % 3 == 0), leaves the queue (1), or
        asks again for what it could not prefetch before (2)."""
        d = self.d
        rid = list(d.queued)[(pick // 3) % len(d.queued)]
        if pick % 3 == 0:
            d.admit(rid)
        elif pick % 3 == 1:
            d.leave(rid)
        else:
            prompt, salt = d.queued[rid]
            d.prefetch(prompt, salt, rid=rid)

    @fuzz_rule(report=cost_reports)
    def report_prefill(self, report: CostReport) -> None:
        """The serving loop reports a prefill: with the readers' measured disk rate, the
        core may now recompute slow runs of disk hits (the model follows the same numbers)."""
        tokens = report.context_tokens // 2
        self.d.api.report_prefill(tokens, tokens * report.prefill_seconds_per_token,
                                  context_tokens=report.context_tokens)

    # -------------------------------------------------------------- rules: transfers

    def held(self, reads: bool) -> list[TransferId]:
        """Held completions (a batch's by its name) of reads or writes, oldest first."""
        return sorted(tid for tid, c in self.gate.held().items() if is_read(c) == reads)

    def land(self, tid: TransferId) -> None:
        """Let one held completion through and wait until the core has applied it."""
        self.gate.release(tid)
        self.settle()

    @precondition(lambda self: self.driver is not None and self.gate.counts()[0])
    @fuzz_rule(newest=st.booleans())
    def complete_a_write(self, newest: bool) -> None:
        """The oldest (or newest) pending write reports, by transfer id."""
        writes = self.held(reads=False)
        self.land(writes[-1 if newest else 0])

    @precondition(lambda self: self.driver is not None and self.gate.counts()[1])
    @fuzz_rule(newest=st.booleans())
    def complete_a_read(self, newest: bool) -> None:
        """The oldest (or newest) pending read reports, by transfer id."""
        reads = self.held(reads=True)
        self.land(reads[-1 if newest else 0])

    @precondition(lambda self: self.driver is not None and self.gate.counts()[1])
    @fuzz_rule(pick=st.integers(0, 63))
    def complete_any_read(self, pick: int) -> None:
        """Pending read pick (in transfer-id order) reports: reads land in any order."""
        reads = self.held(reads=True)
        self.land(reads[pick % len(reads)])

    @fuzz_rule(fault=st.sampled_from(SILENT_WRITE_FAULTS))
    def corrupt_on_disk_and_read_back(self, fault: Fault) -> None:
        """A block goes to disk with `fault` -- reported written, but a bit flipped or part of
        it never landed -- and is asked for again: the read must fail its checksum (or, torn,
        return exactly the bytes written), never serve other bytes.  The single-fault rules
        reach this only by a long, unlikely sequence (arm, spill that very block, land, push
        it out of the faster tiers, ask for it); the checksum path deserves the weight."""
        self.read_back_with_fault(Op.WRITE, fault)

    @fuzz_rule(fault=st.sampled_from(
        [(Op.WRITE, f) for f in WRITE_FAULTS if f not in SILENT_WRITE_FAULTS]
        + [(Op.READ, f) for f in READ_FAULTS]))
    def fail_a_transfer_and_read_back(self, fault: tuple[Op, Fault]) -> None:
        """A block goes to disk and comes back, and its write or its read fails at the store:
        the write keeps the block on host, the read falls back -- never published."""
        self.read_back_with_fault(*fault)

    def read_back_with_fault(self, op: Op, fault: Fault) -> None:
        """Serve one block twice (reused, retained: every spill mode spills it), push it out
        of the faster tiers landing every transfer, then ask for it again, the read held at
        the gate; `fault` meets this block's `op` at the store."""
        d = self.d
        prompt = d.fresh_prompt(1)
        key = d.keys_of(LiveRequest("read-back", prompt, None), 1)[0]
        self.faults_by_key[(op, key)] = fault
        for _ in range(2):
            d.serve(prompt, 30.0, 0)
        for _ in range(2):
            d.serve(d.fresh_prompt(None), None, 0)
            self.drain_all()
        d.add(prompt, 30.0, 0, None)
        # A fault whose transfer never came (the block never went to disk) goes unused.
        self.faults_by_key.clear()

    @fuzz_rule(fault=st.sampled_from(WRITE_FAULTS))
    def fail_next_write(self, fault: Fault) -> None:
        """The next write the core issues meets `fault` at the store."""
        self.arm_write, self.arm_write_at = fault, 0

    @fuzz_rule(fault=st.sampled_from(READ_FAULTS))
    def fail_next_read(self, fault: Fault) -> None:
        """The next read the core issues meets `fault` at the store."""
        self.arm_read, self.arm_read_at = fault, 0

    @fuzz_rule(armed=st.sampled_from([(f, at) for f in WRITE_FAULTS for at in (1, 2)]))
    def fail_a_write_inside_the_next_batch(self, armed: tuple[Fault, int]) -> None:
        """A later write of the next write batch meets the fault: the batch partly fails."""
        self.arm_write, self.arm_write_at = armed

    @fuzz_rule(armed=st.sampled_from([(f, at) for f in READ_FAULTS for at in (1, 2)]))
    def fail_a_read_inside_the_next_batch(self, armed: tuple[Fault, int]) -> None:
        """A later read of the next read batch meets the fault: the blocks before it land,
        that one is never served, its requests recompute from it."""
        self.arm_read, self.arm_read_at = armed

    @fuzz_rule()
    def stall_the_disk(self) -> None:
        """Every write issued from now on blocks in the store until the disk is unstalled:
        the writer threads stop, the writer queue fills, spills back up behind it -- and the
        serving loop must not notice."""
        self.stall_writes = True

    @precondition(lambda self: self.stall_writes)
    @fuzz_rule()
    def unstall_the_disk(self) -> None:
        self.unstall()

    def unstall(self) -> None:
        self.stall_writes = False
        self.d.fuzz_store.unstall()

    @fuzz_rule(dt=st.sampled_from(CLOCK_STEPS))
    def advance_clock(self, dt: float) -> None:
        """Time passes (the core sees it at its next call or completion): TTLs run out,
        possibly while their blocks' transfers are in flight."""
        self.d.now += dt

    @fuzz_rule()
    def drain(self) -> None:
        self.drain_all()

    @fuzz_rule(count=st.integers(2, 4))
    def close_behind_a_stalled_disk(self, count: int) -> None:
        """The disk stops answering, a burst of spills backs up behind it (the writer queue
        fills, the spill feeder waits in submit()), and the cache closes without draining:
        the close must count each backed-up write once, dropped or finished."""
        self.stall_writes = True
        self.spill_burst(count)
        self.close_with_work_in_flight()

    @fuzz_rule()
    def close_with_work_in_flight(self) -> None:
        """Shut down without draining, whatever is pending (held, queued, stalled, backed up
        behind a full writer queue), then start over with a fresh cache of the same shape.

        The close must finish (the harness fails a close that hangs), stop every thread, and
        account for every transfer: each is either applied to the core or reported dropped.
        """
        d = self.d
        self.settle()
        self.check_counters()
        before = d.core.statistics()
        w_held, _ = self.gate.jobs()
        waiting = len(self.write_batches) - w_held - d.fuzz_store.stalled
        # Threads take jobs oldest first, and the pool's pump holds the oldest waiting one:
        # the close drops the newest `waiting - 1` batches (batch names grow with dispatch).
        newest = sorted(self.write_batches)[len(self.write_batches) - max(waiting - 1, 0):]
        dropped_blocks = sum(self.batch_blocks[name] for name in newest)
        passed = self.gate.passed()
        closer = d.start_close(d.api, drain=False)
        # Held completions and a stalled disk go on only once the close is under way (it
        # counts what is in flight before it first waits): the writes a thread holds finish
        # while the close drops what is queued behind them, and every transfer in flight
        # before this step either finishes during the close or is dropped by it.
        closer.wait_until_closing(CLOSE_TIMEOUT)
        self.gate.open()
        time.sleep(0.002)
        self.unstall()
        report = closer.wait(CLOSE_TIMEOUT)
        assert report is not None
        self.waiters.join()
        self.waiters.check()
        with d.frozen():
            d._check_locked()
            stats = d.core.statistics()
        reads_left = stats.reads_in_flight + stats.prefetch_reads_in_flight
        assert (stats.writes_in_flight, reads_left) == (
            report.writes_dropped, report.reads_dropped), (
            f"{stats.writes_in_flight} writes and {reads_left} reads never "
            f"completed, but the close report says {report}"
        )
        self.check_close_report(report, before, waiting, dropped_blocks, passed)
        threads = d.new_threads()
        assert not threads, f"threads left running after close: {threads}"
        note("closed with work dropped" if report.writes_dropped or report.reads_dropped
             else "closed with nothing to drop")
        spec, baseline = d.spec, d.gpu_memory_at_start
        d.clean_up()
        # The closed cache must be unreachable by the teardown's leak check, which holds
        # the fresh cache to the first one's baseline: the closer still held it, pools and
        # all (the GPU profile once saw a fresh cache "give back" the old one's 32 KiB).
        del closer, d
        self.driver = None
        self.gate = FuzzGate(self.notify)
        self.write_batches.clear()
        self.read_batches.clear()
        self.batch_blocks.clear()
        self.arm_write = self.arm_read = None
        self.stall_writes = False
        self._open(spec, memory_baseline=baseline)

    def check_close_report(self, report: CloseReport, before: CacheStatistics, waiting: int,
                           dropped_blocks: int, passed: dict[str, int]) -> None:
        """Every field of a close without draining against the harness's count: the reads
        were all done (held at the gate), so none is dropped; of the `waiting` write jobs no
        thread had taken, all but the one the pool's pump holds are dropped (their
        `dropped_blocks` block transfers); everything else finishes during the close,
        through the gate."""
        d = self.d
        after = d.api.statistics()
        writer, reader = after.writer, after.reader
        assert writer is not None and reader is not None
        now = self.gate.passed()
        through = {kind: now[kind] - passed[kind] for kind in now}
        dropped = max(waiting - 1, 0)
        expected = CloseReport(
            drained=False, writes_dropped=dropped_blocks, reads_dropped=0,
            writes_finished_during_close=before.writes_in_flight - dropped_blocks,
            reads_finished_during_close=(before.reads_in_flight
                                         + before.prefetch_reads_in_flight),
        )
        assert report == expected, (
            f"close report {report}, expected {expected}: {before.writes_in_flight} writes "
            f"({waiting} waiting for a thread) and {before.reads_in_flight} reads in flight")
        assert (report.writes_finished_during_close, report.reads_finished_during_close) == (
            through["written"] + through["write failed"], through["read"] + through["read failed"]
        ), f"close report {report}, completions through the gate during the close {through}"
        # The pool dropped what its queue held (and the feeder's job); the backlog the rest.
        _queued, backlog = writer_pipeline(waiting, d.spec.write_queue_depth)
        assert writer.dropped_at_close == dropped - backlog, (writer, report)
        assert reader.dropped_at_close == 0, reader
        for pool in (writer, reader):
            assert pool.queued == pool.in_flight == 0, f"{pool} after close"
        assert after.spill_backlog == 0, after
        assert (writer.completed + writer.failed, reader.completed + reader.failed) == (
            now["written"] + now["write failed"], now["read"] + now["read failed"]
        ), f"pools {writer} {reader}, completions through the gate {now}"
        assert after.slots_discarded == d.fuzz_store.discards, after

    def drain_all(self) -> None:
        """Unstall the disk and land every transfer, oldest first (writes, then reads)."""
        self.unstall()
        while True:
            self.settle()
            writes, reads = self.held(reads=False), self.held(reads=True)
            if not writes and not reads:
                return
            self.land(writes[0] if writes else reads[0])

    # -------------------------------------------------------------- invariants

    @invariant()
    def system_agrees_with_the_spec(self) -> None:
        if self.driver is None:
            return
        self.settle()
        d = self.d
        with d.frozen():
            d._check_locked()
            _, _, failed_writes, failed_reads = self.gate.counts()
            d.check_errors_counted(failed_writes, failed_reads)
        self.check_counters()
        self.waiters.check()

    def teardown(self) -> None:
        driver = self.driver
        if driver is None:
            return
        # A failed step (or Hypothesis ending an example early) is propagating: check
        # nothing more, just clean up.
        failing = sys.exc_info()[0] is not None
        try:
            if not failing:
                self.drain_all()
                for rid in list(driver.live):
                    driver.release(rid)
                for rid in list(driver.queued):
                    driver.leave(rid)
                self.drain_all()
                # Every waiter woke (the requests are gone): their threads end first, so
                # that nothing but the cache's own references hold its memory.
                self.waiters.join()
                self.waiters.check()
                driver.check_nothing_leaks()
                self.report_events()
        finally:
            self.gate.open()
            driver.clean_up()

    def report_events(self) -> None:
        """What this example reached (shown by Hypothesis' statistics)."""
        d = self.d
        stats = d.core.statistics()
        note("slowest serving-loop call " + (
            f"{d.watchdog.slowest * 1000:.0f} ms" if d.watchdog.slowest > 0.05
            else "under 50 ms"))
        for name in ("prefetches", "prefetch_hits", "prefetches_taken_over",
                     "prefetches_cancelled", "prefetches_reclaimed", "prefetch_failures",
                     "onboards_skipped_as_too_slow",
                     "spills_completed", "onboards_completed", "onboard_failures",
                     "spill_failures", "displacements", "expirations", "requests_fallen_back",
                     "host_recalls", "pressure_drops", "admission_refusals"):
            if getattr(stats, name):
                note(f"reached {name}")
