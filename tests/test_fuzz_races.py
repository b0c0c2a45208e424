"""Each race class of the seed's commit list, reached by a rule sequence of the system machine.

Every test drives the real system (actors, files, torch copies) through the machine's own
rules, with every invariant checked after every step, asserts that the racy situation was
really reached, and -- where the race is a bug the seed shipped -- plants that bug back
(fuzz/planted.py) and asserts that the same sequence now fails.  fuzz/README.md maps each
race to its test, the rule that reaches it and the invariant that catches it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import pytest

from fuzz import planted
from fuzz.core_machine import (
    DOCUMENTS,
    ChurnSpec,
    CoreVsSpec,
    FetchRace,
    PrefetchRace,
    RequestSpec,
)
from fuzz.driver import FUZZ_FINGERPRINT, SystemSpec
from fuzz.store import READ_FAULTS, WRITE_FAULTS
from fuzz.system_machine import SystemMachine
from io_actors.storage.faults import Fault, Op
from statekv.config import CacheConfig, SpillMode
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.stats import CacheStatistics

BASE = SystemSpec(
    block_size=2, gpu=4, host=2, reserved_host=0, disk=4, spill_mode=SpillMode.ALL,
    spill_min_reuse=1, protect_unexpired=False, drop_on_pressure=False, write_queue_depth=2,
    priority_levels=1, writers=1, readers=1, direct_io=False,
    # The seed's races are scripted block by block: lone transfers.  The batch tests below
    # evolve it.
    max_batch_blocks=1,
)
PROMPT = DOCUMENTS[0][:5]
"""Two full blocks and one more token."""
FILL = ChurnSpec(None, None, True)
"""A GPU-sized request of fresh tokens, every transfer landed after it."""


@pytest.fixture(autouse=True)
def _quiet_injected_faults() -> None:
    logging.getLogger("io_actors").setLevel(logging.ERROR)


class Run:
    """A system machine driven by hand: each step is a rule, then every invariant."""

    def __init__(self, **spec: Any) -> None:
        self.m = SystemMachine()
        self.m.open(attrs.evolve(BASE, **spec))

    def __call__(self, rule: str, **args: Any) -> CacheStatistics:
        getattr(self.m, rule)(**args)
        self.m.system_agrees_with_the_spec()
        return self.stats()

    def stats(self) -> CacheStatistics:
        return self.m.d.core.statistics()

    def tiers(self, prompt: tuple[int, ...] = PROMPT, salt: str | None = None) -> list[str]:
        """The state of each full block of `prompt` ("-" when not cached)."""
        key = root_key(FUZZ_FINGERPRINT, salt, None)
        cached = {b.key: b.state.name for b in self.m.d.core.cached_blocks()}
        out = []
        for i in range(len(prompt) // 2):
            key = chain_key(key, token_bytes(prompt[2 * i:2 * i + 2]))
            out.append(cached.get(key, "-"))
        return out

    def to_disk(self, ttl: float | None = None) -> None:
        """Serve PROMPT, then push its blocks through the host tier onto disk."""
        self("serve_whole_request", spec=RequestSpec(PROMPT, ttl))
        self("churn", spec=FILL)
        self("churn", spec=FILL)
        assert self.tiers() == ["ON_DISK", "ON_DISK"]

    def held(self) -> tuple[int, int]:
        writes, reads, _, _ = self.m.gate.counts()
        return writes, reads

    def teardown(self) -> None:
        self.m.teardown()


@contextmanager
def system(**spec: Any) -> Iterator[Run]:
    run = Run(**spec)
    try:
        yield run
    finally:
        run.teardown()


def fails_when_planted(plant: Callable[[], AbstractContextManager[None]],
                       scenario: Callable[[], None]) -> BaseException:
    """Run `scenario` with the seed's bug planted; it must fail.  The failure is returned."""
    with plant(), pytest.raises(Exception) as info:
        scenario()
    return info.value


# ------------------------------------------------------------------ the seed's races


def test_release_during_onboard_keeps_the_page_until_the_read_lands() -> None:
    """releaseBlocks freed a block whose disk read was in flight (seed)."""

    def scenario() -> None:
        with system() as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            assert run.held() == (0, 2)
            run("cancel_parked", pick=0)
            # Reached: both reads in flight for blocks nobody holds any more...
            assert run.tiers() == ["ONBOARDING", "ONBOARDING"]
            # ...while another request takes every page it can.
            run("churn", spec=ChurnSpec(None))
            run("complete_a_read", newest=True)
            run("complete_a_read", newest=False)
            assert run.tiers() == ["RELEASED", "RELEASED"]

    scenario()
    fails_when_planted(planted.release_during_onboard, scenario)


def test_a_slot_with_a_pending_read_is_never_claimed_by_a_spill() -> None:
    """onboardBlock gave the slot back before its read ran; a spill overwrote it (seed)."""

    def scenario() -> None:
        with system(disk=2, host=3) as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            busy = run.stats().disk_busy_refusals
            # Reached: the disk's only slots have reads in flight when spills want them.
            run("churn", spec=ChurnSpec(1))
            stats = run("churn", spec=ChurnSpec(1))
            assert stats.disk_busy_refusals > busy
            run("drain")

    scenario()
    fails_when_planted(planted.slot_reused_before_read, scenario)


def test_a_displaced_block_leaves_the_prefix_tree() -> None:
    """A spill that displaced disk content left its identity in the tree (seed)."""

    def scenario() -> None:
        with system(disk=2, host=3) as run:
            run.to_disk()
            stats = run("churn", spec=FILL)
            assert stats.displacements > 0  # reached
            assert "ON_DISK" not in run.tiers()
            match = run.m.d.add(list(PROMPT), None, 0, None)
            assert match is not None and not match.serials  # recomputed, never onboarded
            run("drain")

    scenario()
    fails_when_planted(planted.displaced_identity_left_in_tree, scenario)


def test_spills_use_empty_slots_before_displacing() -> None:
    """Empty slots were filed above fresh content: spills displaced each other (seed)."""

    def scenario() -> None:
        with system(disk=4) as run:
            run.to_disk()
            empty = run.stats().disk_empty_slots
            stats = run("churn", spec=FILL)
            # Reached: a spill while both empty slots and displaceable content exist.
            assert stats.disk_empty_slots < empty and stats.displacements == 0
            assert run.tiers() == ["ON_DISK", "ON_DISK"]

    scenario()
    fails_when_planted(planted.spills_displace_before_empty_slots, scenario)


def test_onboarding_a_retained_block_removes_its_deadline() -> None:
    """The deadline set kept entries of blocks that left the disk (seed)."""

    def scenario() -> None:
        with system() as run:
            run.to_disk(ttl=30.0)
            assert run.stats().disk_retained_blocks == 2
            run("add_request", spec=RequestSpec(PROMPT))
            assert run.stats().disk_retained_blocks == 0  # reached: left the disk
            run("drain")

    scenario()
    fails_when_planted(planted.stale_deadline_kept, scenario)


def test_slots_come_back_when_reads_land_so_spills_never_wedge() -> None:
    """Landed reads were reaped only when the disk did not look full: spills wedged (seed)."""

    def scenario() -> None:
        with system(disk=2, host=3) as run:
            run.to_disk()
            assert run.stats().disk_empty_slots == 0  # reached: a full disk...
            run("add_request", spec=RequestSpec(PROMPT))
            run("drain")  # ...whose reads land: the slots stay, as the blocks' disk copies
            assert run.stats().disk_empty_slots == 0 and run.stats().disk_copy_blocks == 2
            run("release", pick=0)
            spills = run.stats().spills
            assert run("churn", spec=FILL).spills > spills  # a copy's slot is displaceable

    scenario()
    fails_when_planted(planted.reap_never_runs, scenario)


def test_a_displaced_disk_copy_leaves_its_block_on_gpu_and_is_never_trusted() -> None:
    """Inclusive tiers: a spill that takes the slot of a block read back (on GPU, its copy
    kept) drops only the copy; the block's next eviction writes it again."""

    def scenario() -> None:
        with system(disk=2, host=3) as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            run("drain")
            assert run.stats().disk_copy_blocks == 2  # reached: on GPU, copies on disk
            saved = run.stats().spills_saved_by_disk_copy
            for doc in DOCUMENTS[1:4]:  # other content through the host: its spills
                run("serve_whole_request", spec=RequestSpec(doc[:3]))  # displace copies
                stats = run("churn", spec=FILL)
            assert stats.displacements > 0 and stats.disk_copy_blocks < 2
            assert run.tiers() == ["ON_GPU", "ON_GPU"]  # held: still cached on GPU
            run("release", pick=0)
            run("churn", spec=FILL)
            run("churn", spec=FILL)
            assert run.stats().spills_saved_by_disk_copy >= saved
            run("drain")

    scenario()
    fails_when_planted(planted.displaced_copy_kept, scenario)


def test_a_flipped_bit_is_never_served() -> None:
    """Short reads and I/O errors were logged and the bytes published anyway (seed)."""

    def scenario() -> None:
        with system() as run:
            run("fail_next_write", fault=Fault.BIT_FLIP)
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            stats = run("drain")
            assert stats.onboard_failures == 1 and stats.requests_fallen_back == 1
            run("serve_whole_request", spec=RequestSpec(PROMPT))  # still serving

    scenario()
    fails_when_planted(planted.checksum_not_verified, scenario)


def test_a_read_of_an_intact_slot_fails_only_where_a_fault_was_injected() -> None:
    """A slot written whole under a header whose checksum is of other bytes (the GPU
    checksum path's two bugs) is never served -- its read fails -- but nothing injected that
    failure: the fuzz store counts it as a violation, not as a tolerated fault."""

    def scenario() -> None:
        with system() as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            stats = run("drain")
            assert stats.onboard_failures == 0

    scenario()
    error = fails_when_planted(planted.header_checksum_of_other_bytes, scenario)
    assert "failed with no fault injected" in str(error), error


@pytest.mark.parametrize("plant", [planted.checksum_not_verified,
                                   planted.failed_read_published],
                         ids=lambda p: p.__name__)
def test_one_step_reaches_a_corrupt_slot_read_back(
        plant: Callable[[], AbstractContextManager[None]]) -> None:
    """The I/O rules with weight: one step spills a block whose bytes flip on disk and asks
    for it again; another fails a read-back.  Neither is ever served."""

    def scenario() -> None:
        with system() as run:
            run("corrupt_on_disk_and_read_back", fault=Fault.BIT_FLIP)
            assert run.held() == (0, 1)  # reached: the read of the flipped slot is held
            stats = run("drain")
            assert stats.onboard_failures == 1 and stats.requests_fallen_back == 1
        with system() as run:
            run("fail_a_transfer_and_read_back", fault=(Op.READ, Fault.EIO))
            assert run.held() == (0, 1)
            stats = run("drain")
            assert stats.onboard_failures == 1 and stats.requests_fallen_back == 1

    scenario()
    fails_when_planted(plant, scenario)


@pytest.mark.parametrize("fault", WRITE_FAULTS, ids=lambda f: f.value)
def test_every_write_fault_is_counted_and_the_cache_keeps_serving(fault: Fault) -> None:
    with system() as run:
        run("fail_next_write", fault=fault)
        run.to_disk() if fault is not Fault.EIO_OPEN and fault not in _LOUD else _spill(run)
        run("add_request", spec=RequestSpec(PROMPT))
        run("drain")
        run("release", pick=0)
        run("serve_whole_request", spec=RequestSpec(PROMPT))


_LOUD = {Fault.EIO, Fault.ENOSPC, Fault.SHORT_WRITE, Fault.TORN_WRITE}


def _spill(run: Run) -> None:
    """Push PROMPT to disk when its first write fails loudly (the block stays on host)."""
    run("serve_whole_request", spec=RequestSpec(PROMPT))
    run("churn", spec=FILL)
    stats = run("churn", spec=FILL)
    assert stats.spill_failures == 1 and stats.io_errors == 1


@pytest.mark.parametrize("fault", READ_FAULTS, ids=lambda f: f.value)
def test_every_read_fault_falls_back_to_recompute(fault: Fault) -> None:
    with system() as run:
        run.to_disk()
        run("fail_next_read", fault=fault)
        run("add_request", spec=RequestSpec(PROMPT))
        stats = run("drain")
        if fault is Fault.SLOW:
            assert stats.onboard_failures == 0
        else:
            assert stats.onboard_failures == 1 and stats.requests_fallen_back == 1
        run("compute", pick=63)
        run("release", pick=0)
        run("serve_whole_request", spec=RequestSpec(PROMPT))


def test_a_hit_on_a_block_still_spilling_is_recalled_without_waiting() -> None:
    """Onboarding a just-spilled slot waited behind the write queue on the scheduler (seed)."""

    def scenario() -> None:
        with system() as run:
            run.m.d.watchdog.limit = 1.0  # calls take microseconds; do not wait long here
            run("serve_whole_request", spec=RequestSpec(PROMPT))
            run("stall_the_disk")
            run("churn", spec=ChurnSpec(None))
            run("churn", spec=ChurnSpec(None))
            assert run.tiers() == ["SPILLING", "SPILLING"]  # reached: writes stuck on disk
            recalls = run.stats().host_recalls
            stats = run("add_request", spec=RequestSpec(PROMPT))
            assert stats.host_recalls == recalls + 2 and stats.reads_in_flight == 0
            assert run.m.d.api.is_ready(next(iter(run.m.d.live)))

    scenario()
    error = fails_when_planted(planted.scheduler_waits_for_writes, scenario)
    assert "waited on disk I/O" in str(error)


def test_a_request_is_parked_until_every_block_landed() -> None:
    """Reads were barriered on the scheduler; readiness is per block now (seed)."""
    with system(readers=2) as run:
        run.to_disk()
        run("add_request", spec=RequestSpec(PROMPT))
        rid = next(iter(run.m.d.live))
        assert run.held() == (0, 2) and not run.m.d.api.is_ready(rid)
        run("complete_a_read", newest=True)
        assert not run.m.d.api.is_ready(rid)  # reached: one block landed, one not
        run("complete_a_read", newest=True)
        assert run.m.d.api.is_ready(rid)


def test_a_batch_of_reads_parks_the_request_until_the_batch_lands() -> None:
    """One ReadSlots for both disk hits: parked until its one completion is applied."""
    with system(max_batch_blocks=16, readers=2) as run:
        run.to_disk()
        run("add_request", spec=RequestSpec(PROMPT))
        rid = next(iter(run.m.d.live))
        assert run.held() == (0, 2) and run.m.gate.jobs() == (0, 1)  # reached: one batch
        assert not run.m.d.api.is_ready(rid)
        run("complete_a_read", newest=False)
        assert run.m.d.api.is_ready(rid)
        run("compute", pick=0)


def test_release_during_a_batch_onboard_keeps_every_page_until_the_batch_lands() -> None:
    """The seed's release-during-onboard, for a whole batch in flight."""
    with system(max_batch_blocks=16) as run:
        run.to_disk()
        run("add_request", spec=RequestSpec(PROMPT))
        run("cancel_parked", pick=0)
        assert run.tiers() == ["ONBOARDING", "ONBOARDING"]
        run("churn", spec=ChurnSpec(None))
        run("complete_a_read", newest=False)
        assert run.tiers() == ["RELEASED", "RELEASED"]


def test_a_fault_in_the_middle_of_a_batch_publishes_the_blocks_before_it() -> None:
    """A batch that partly fails: the first block lands and is served, the second is never
    published, and the request recomputes from it."""
    with system(max_batch_blocks=16) as run:
        run.to_disk()
        run("fail_a_read_inside_the_next_batch", armed=(READ_FAULTS[0], 1))
        run("add_request", spec=RequestSpec(PROMPT))
        rid = next(iter(run.m.d.live))
        stats = run("complete_a_read", newest=False)
        assert stats.onboard_failures == 1 and stats.onboards_completed == 1  # reached
        assert run.m.d.api.is_ready(rid)
        assert run.m.d.api.request_status(rid).num_computed_tokens == 2
        run("compute", pick=0)


def test_a_fault_in_the_middle_of_a_spill_batch_keeps_that_block_on_host() -> None:
    """A write batch that partly fails: the blocks that landed are on disk, the failed one
    stays on host, and the slot it claimed is free again."""
    with system(max_batch_blocks=16, host=3, disk=6) as run:
        run("fail_a_write_inside_the_next_batch", armed=(WRITE_FAULTS[0], 1))
        run("serve_whole_request", spec=RequestSpec(DOCUMENTS[0][:7]))
        run("churn", spec=ChurnSpec(None))  # to host
        run("churn", spec=ChurnSpec(None))  # to disk: one batch of three
        stats = run("drain")
        assert stats.spill_failures == 1 and stats.spills_completed >= 1  # reached


def test_a_prompt_ending_inside_a_disk_block_reuses_only_full_blocks() -> None:
    """A disk block served a partial match from pool memory: garbage (seed)."""
    with system() as run:
        run.to_disk()
        stats = run("add_request", spec=RequestSpec(PROMPT[:3]))
        # Reached: the second block is on disk and half of it is the prompt's.
        assert stats.hit_blocks_disk == 1 and run.tiers() == ["ONBOARDING", "ON_DISK"]
        run("drain")
        run("compute", pick=63)


def test_writes_landing_out_of_order_with_two_writers() -> None:
    """N writers drain one queue; same-slot writes stay ordered (seed)."""
    with system(writers=2, host=3) as run:
        run("serve_whole_request", spec=RequestSpec(DOCUMENTS[0][:7]))
        run("churn", spec=ChurnSpec(None))
        stats = run("churn", spec=ChurnSpec(None))
        assert stats.writes_in_flight >= 2  # reached
        run("complete_a_write", newest=True)
        run("drain")


def test_reserved_host_pages_go_out_and_come_back() -> None:
    """Async spills hand out a reserved host page while the victim drains (seed)."""
    with system(reserved_host=2) as run:
        run("serve_whole_request", spec=RequestSpec(PROMPT))
        run("churn", spec=ChurnSpec(None))
        stats = run("churn", spec=ChurnSpec(None))
        assert stats.host_reserved_pages < 2 and stats.writes_in_flight  # reached: out
        stats = run("drain")
        assert stats.host_reserved_pages == 2  # and back in


def test_pressure_sheds_best_effort_spills_never_retained_ones() -> None:
    """Drop-on-pressure: best-effort spills shed at the gate, retained ones never (seed)."""
    # (No write-through: the retained blocks must meet the pressure gate as spills.)
    with system(drop_on_pressure=True, write_queue_depth=1, host=3, reserved_host=1,
                retention_write_through=False) as run:
        run("serve_whole_request", spec=RequestSpec(DOCUMENTS[0][:7], 30.0))
        run("stall_the_disk")
        run("spill_burst", count=3)
        stats = run.stats()
        assert stats.pressure_drops > 0  # reached
        assert run.tiers(DOCUMENTS[0][:7]).count("-") == 0  # the retained blocks survive
        run("drain")


def test_a_full_disk_of_live_ttls_refuses_spills_until_they_expire() -> None:
    """protect_unexpired: refuse new blocks while the disk is full of live TTLs (seed)."""
    with system(disk=2, protect_unexpired=True) as run:
        run.to_disk(ttl=30.0)
        stats = run("churn", spec=FILL)
        assert stats.admission_refusals > 0 and stats.displacements == 0  # reached
        run("advance_clock", dt=30.0)
        stats = run("churn", spec=FILL)
        assert stats.expirations == 2 and stats.displacements > 0


def test_the_reuse_gate_counts_reuse_across_tiers() -> None:
    """Spill only blocks reused >= k times; the counter survives tier moves (seed)."""
    with system(spill_mode=SpillMode.REUSED, spill_min_reuse=1) as run:
        run("serve_whole_request", spec=RequestSpec(PROMPT))
        run("churn", spec=FILL)
        stats = run("churn", spec=FILL)
        assert stats.gate_drops >= 2 and run.tiers() == ["-", "-"]  # never reused: dropped
        run("serve_whole_request", spec=RequestSpec(PROMPT))
        run("serve_whole_request", spec=RequestSpec(PROMPT))  # reused once
        run("churn", spec=FILL)
        run("churn", spec=FILL)
        assert run.tiers() == ["ON_DISK", "ON_DISK"]


def closing_with_spills_backed_up() -> None:
    with system(host=3, reserved_host=2, write_queue_depth=1) as run:
        run("stall_the_disk")
        run("spill_burst", count=4)
        stats = run.m.d.api.statistics()
        # Reached: the feeder waits on a full queue (the pump's job, the queue's, its own).
        assert stats.writer is not None and stats.writer.queued == 1 + 2
        run("close_with_work_in_flight")
        run("serve_whole_request", spec=RequestSpec(PROMPT))


def test_closing_with_spills_backed_up_behind_a_stalled_disk_finishes() -> None:
    """Found by this suite: close(drain=False) hung when spills were backed up behind a full
    writer queue (the spill feeder crashed, the pools lost count of their jobs)."""
    closing_with_spills_backed_up()


def test_a_close_behind_a_stalled_disk_counts_each_write_once() -> None:
    """Found by this suite: with the spill feeder waiting in submit(), its job was counted
    as queued in the writer pool and as backed up in statistics() (the close report counts
    block transfers from the core, and tests/test_close_accounting.py pins it without the
    machine): the counter check before the close names the spill backlog."""

    def scenario() -> None:
        with system(host=3, reserved_host=2, write_queue_depth=1) as run:
            run("serve_whole_request", spec=RequestSpec(PROMPT))
            run("close_behind_a_stalled_disk", count=4)
            run("serve_whole_request", spec=RequestSpec(PROMPT))

    scenario()
    error = fails_when_planted(planted.feeders_job_counted_twice, scenario)
    assert "backed up expected" in str(error), error


def test_waiters_wake_ready_after_a_failed_read_and_gone_after_a_release() -> None:
    """Found by this suite: a waiter on a request released while parked was not woken (only
    read completions woke waiters).  Waiters through both APIs, reads held and landed one at
    a time, the first failing: each waiter wakes to a ready, rewound request or a gone one."""

    def scenario() -> None:
        with system() as run:
            run.to_disk()
            run("fail_next_read", fault=Fault.EIO)
            run("add_request", spec=RequestSpec(PROMPT))
            run("wait_ready_in_background", pick=0)  # the async API (a trio task)
            run("wait_ready_in_background", pick=1)  # BlockingCache.wait_ready (a thread)
            assert run.held() == (0, 2)  # reached: both reads held, two waiters parked
            run("complete_any_read", pick=1)  # the second block's read lands: still parked
            assert [w.woke for w in run.m.waiters.all] == [False] * 2
            run("complete_any_read", pick=0)  # the first one fails: rewound, ready
            assert [w.outcome for w in run.m.waiters.all] == ["ready"] * 2
            assert run.stats().onboard_failures == 1

    def released() -> None:
        with system() as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            run("wait_ready_in_background", pick=0)
            run("wait_ready_in_background", pick=1)
            assert run.held() == (0, 2)  # reached: both reads held, two waiters parked
            run("cancel_parked", pick=0)  # released while they wait: they wake, gone
            assert [w.outcome for w in run.m.waiters.all] == ["gone"] * 2

    for steps in (scenario, released):
        steps()
        error = fails_when_planted(planted.waiters_woken_only_on_slot_read, steps)
        assert "were never woken" in str(error), error


def test_a_release_while_a_waiter_is_handed_over_wakes_it_gone() -> None:
    """Issue 27: a waiter queued for the trio thread, its request released before it ran:
    it wakes "gone" and the cache lives on."""

    def scenario() -> None:
        with system() as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            assert run.held() == (0, 2)
            run("release_while_a_waiter_is_handed_over", pick=0)
            assert [w.outcome for w in run.m.waiters.all] == ["gone"]
            run("complete_a_read", newest=False)
            run("complete_a_read", newest=False)
            run("serve_whole_request", spec=RequestSpec(PROMPT))  # the actor lives

    scenario()
    error = fails_when_planted(planted.waiter_assumes_its_request_is_live, scenario)
    assert "wait_ready(r" in str(error) and "raised UsageError" in str(error), error


def test_a_waiter_never_wakes_while_its_request_is_parked() -> None:
    """An early return of wait_ready is seen by the waiter itself."""

    def scenario() -> None:
        with system() as run:
            run.to_disk()
            run("add_request", spec=RequestSpec(PROMPT))
            run("wait_ready_in_background", pick=0)
            run("wait_ready_in_background", pick=1)
            run("complete_a_read", newest=True)
            run("complete_a_read", newest=True)
            assert [w.outcome for w in run.m.waiters.all] == ["ready"] * 2

    scenario()
    error = fails_when_planted(planted.wait_ready_returns_early, scenario)
    assert "still parked" in str(error), error


def test_closing_with_spills_backed_up_fails_loudly_with_the_old_feeder() -> None:
    """The same steps with the feeder as it was: its crash (popping the cleared backlog)
    stops the cache and comes out of the close.  It hung the close (and the harness said so)
    until a pool stopped by the crash stopped counting its jobs as busy.

    In a child process: should the close hang again, the cache's threads cannot be stopped,
    and must not outlive the test in this one.
    """
    code = ("from fuzz.planted import feeder_pops_a_cleared_backlog\n"
            "from tests.test_fuzz_races import closing_with_spills_backed_up\n"
            "with feeder_pops_a_cleared_backlog():\n"
            "    closing_with_spills_backed_up()\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, check=False)
    assert child.returncode != 0
    assert "closing the cache hung" not in child.stderr, child.stderr[-2000:]
    assert "IndexError: pop from an empty deque" in child.stderr, child.stderr[-2000:]


# ------------------------------------------------------------------ prefetch races (issue 12)


def test_a_release_during_prefetch_keeps_the_host_pages_until_the_reads_land() -> None:
    """A queued request leaves while its prefetch reads are in flight: the pages stay the
    reads' until they land, however hard GPU evictions want host pages meanwhile."""

    def scenario() -> None:
        with system() as run:
            run.to_disk()
            run("prefetch", spec=RequestSpec(PROMPT))
            assert run.held() == (0, 2)
            assert run.tiers() == ["PREFETCHING", "PREFETCHING"]
            run("queued_request_moves", pick=1)  # leaves the queue
            # Reached: both reads in flight for blocks no queued request wants any more...
            assert run.tiers() == ["PREFETCHING", "PREFETCHING"]
            # ...while GPU victims want host pages.
            run("serve_whole_request", spec=RequestSpec(DOCUMENTS[2][:5]))
            run("churn", spec=ChurnSpec(None))
            run("complete_a_read", newest=True)
            stats = run("complete_a_read", newest=False)
            assert run.tiers() == ["ON_DISK", "ON_DISK"]
            assert stats.prefetches_cancelled == 2 and stats.prefetched_blocks == 0

    scenario()
    error = fails_when_planted(planted.prefetch_page_freed_on_leave, scenario)
    assert "host page" in str(error) and "PREFETCHING" in str(error), error


def test_a_prefetch_pins_its_slots_against_displacing_spills() -> None:
    """Spills that want slots while a prefetch of those very blocks is in flight (a disk of
    two, both slots being prefetched): they never take the slots, and the bytes read are
    the content's."""
    with system(disk=2, host=3) as run:
        run.to_disk()
        run("prefetch", spec=RequestSpec(PROMPT))
        assert run.tiers() == ["PREFETCHING", "PREFETCHING"]
        stats = run("spill_burst", count=2)
        assert stats.disk_busy_refusals > 0  # every slot has a read in flight
        assert run.tiers() == ["PREFETCHING", "PREFETCHING"]
        run("drain")
        assert run.tiers() == ["PREFETCHED", "PREFETCHED"]  # bytes checked at rest
        run("queued_request_moves", pick=0)  # admitted: host hits
        assert run.stats().prefetch_hits == 2


def test_a_prefetch_that_loses_its_host_page_goes_back_to_disk() -> None:
    """The prefetch lands, then GPU evictions reclaim its host pages (prefetched pages go
    first): the blocks go back to disk and the admitted request reads them as usual."""
    with system() as run:
        run.to_disk()
        run("prefetch", spec=RequestSpec(PROMPT))
        run("drain")
        assert run.tiers() == ["PREFETCHED", "PREFETCHED"]
        run("serve_whole_request", spec=RequestSpec(DOCUMENTS[2][:5]))
        stats = run("churn", spec=ChurnSpec(None))
        assert stats.prefetches_reclaimed >= 1
        assert "ON_DISK" in run.tiers()
        run("queued_request_moves", pick=0)  # admitted: what is on disk is read back
        run("drain")
        stats = run.stats()
        assert stats.prefetch_hits + stats.onboards_completed == 2


# ------------------------------------------------------------------ the shared tier (issue 15)


SHARED = CacheConfig(block_size=2, gpu_blocks=8, host_blocks=2, disk_blocks=2,
                     shared_tier=True)


def core_run(race: FetchRace) -> CacheStatistics:
    """The core machine, by hand: one fetch race, every invariant checked after it."""
    m = CoreVsSpec()
    m.build(SHARED)
    m.fetch_race(race)
    m.agrees_with_the_spec()
    m._drain()
    m.agrees_with_the_spec()
    return m.core.statistics()


def test_a_failed_fetch_is_never_served_and_the_request_recomputes_from_it() -> None:
    def scenario() -> None:
        stats = core_run(FetchRace("fail", 1))
        assert stats.fetches >= 2 and stats.fetch_failures == 1
        assert stats.requests_fallen_back == 1

    scenario()
    error = fails_when_planted(planted.failed_fetch_published, scenario)
    assert isinstance(error, AssertionError)


def test_a_block_evicted_between_lookup_and_fetch_is_a_clean_miss() -> None:
    def scenario() -> None:
        stats = core_run(FetchRace("evicted", 0))
        assert stats.fetch_failures == 1 and stats.fetches_completed == stats.fetches - 1

    scenario()
    fails_when_planted(planted.failed_fetch_published, scenario)


def test_a_release_during_a_fetch_keeps_the_pages_until_the_fetches_report() -> None:
    stats = core_run(FetchRace("release", 1))
    assert stats.fetches >= 2 and stats.fetch_failures >= 1 and stats.requests_released == 1
    assert stats.fetches_in_flight == 0


def test_a_request_joining_a_fetch_in_flight_falls_back_with_it() -> None:
    stats = core_run(FetchRace("joined", 1))
    assert stats.hit_blocks_remote > stats.fetches  # the second request waited on them
    assert stats.requests_fallen_back == 2


# ------------------------------------------------------------------ restarts (issue 23)


def restart_run(config: CacheConfig) -> CacheStatistics:
    """The core machine, by hand: a retained prompt goes to disk, the process restarts
    after its deadline passed, and the fresh core and reference model restore and agree."""
    m = CoreVsSpec()
    m.build(config)
    m.prefetch_race(PrefetchRace(kind="leave", pick=0))  # content on disk
    m.agrees_with_the_spec()
    m.serve_whole_request(RequestSpec(prompt=(1, 2, 1, 2), ttl=5.0, priority=0, salt=None))
    m.agrees_with_the_spec()
    m.add_request(RequestSpec(prompt=(1,), ttl=None, priority=0, salt=None))
    m.agrees_with_the_spec()
    m.restart(down=10.0)  # the deadline passed while it was down: best-effort now
    m.agrees_with_the_spec()
    return m.core.statistics()


RESTART = CacheConfig(block_size=2, gpu_blocks=4, host_blocks=1, reserved_host_blocks=1,
                      disk_blocks=1, write_queue_depth=1, max_batch_blocks=1,
                      priority_levels=1)


def test_content_that_expired_while_down_is_restored_as_best_effort() -> None:
    """Found by the restart rule with the bug planted (5 steps): a restore that files
    content whose deadline passed while the process was down with the retained content."""
    stats = restart_run(RESTART)
    assert stats.restored_blocks >= 1 and stats.disk_retained_blocks == 0
    with planted.expired_restored_as_retained(), pytest.raises(Exception) as info:
        restart_run(RESTART)
    assert "retain" in str(info.value).lower() or "expired" in str(info.value).lower(), info


def test_a_block_recalled_while_its_spill_drains_keeps_no_host_copy() -> None:
    """Inclusive host tier (issue 22): a recalled block keeps its host page as a host copy,
    except while its spill drains -- the write owns the page until it lands and gives it
    back then.  Reached: recalled from SPILLING, evicted again, the write landed, the page
    reused, and the content recalled and read back (the machine checks the bytes)."""

    def scenario() -> None:
        with system(host=2, disk=4) as run:
            run("serve_whole_request", spec=RequestSpec(PROMPT))
            run("churn", spec=ChurnSpec(None))          # PROMPT -> host
            run("churn", spec=ChurnSpec(None))          # its blocks spill (held in flight)
            assert run.tiers() == ["SPILLING", "SPILLING"]
            run("serve_whole_request", spec=RequestSpec(PROMPT))  # recalled from SPILLING
            stats = run("drain")
            assert stats.host_copies_kept == 0 and stats.host_recalls == 2
            run("churn", spec=FILL)                     # PROMPT -> host again (copied)
            run("churn", spec=FILL)
            run("serve_whole_request", spec=RequestSpec(PROMPT))  # bytes checked
            run("drain")

    scenario()
    fails_when_planted(planted.host_copy_of_a_draining_spill, scenario)


def test_a_block_evicted_onto_its_host_copy_serves_its_own_bytes() -> None:
    """Inclusive host tier (issue 22): recalled from host, the page stays a host copy; the
    next eviction moves the block onto it with no copy, and a later recall serves the bytes
    the block was computed with (the machine checks them)."""
    with system(host=8, disk=4) as run:
        run("serve_whole_request", spec=RequestSpec(PROMPT))
        run("churn", spec=FILL)                         # PROMPT -> host
        run("serve_whole_request", spec=RequestSpec(PROMPT))  # recalled: copies kept
        stats = run.stats()
        assert stats.host_copies_kept == 2 and stats.host_copy_pages == 2
        run("churn", spec=FILL)                         # evicted onto its copies
        stats = run.stats()
        assert stats.offloads_saved_by_host_copy == 2 and run.tiers() == ["ON_HOST"] * 2
        run("serve_whole_request", spec=RequestSpec(PROMPT))
        run("drain")
