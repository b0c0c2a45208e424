"""Planted bugs: the seed's races put back into the real code, to show the machines catch them.

Each entry re-introduces one bug that the seed shipped (its commit list is the race
catalogue of fuzz/README.md) by wrapping a method of the real code for the duration of a
``with`` block; nothing is copied or edited.  A bug of the core wraps the method of the
concern that owns the code (statekv.records, statekv.eviction, statekv.disk_tier,
statekv.onboarding, statekv.pools).  ``python -m fuzz.planted NAME`` runs the
machine that should catch it and prints the shrunk steps; tests/test_fuzz_planted.py asserts
that each is caught, and how short the shrunk example is.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine

from fuzz.core_machine import CoreVsSpec
from fuzz.runner import run_machine
from fuzz.system_machine import SystemMachine
from io_actors.actors.reader_pool import SlotReader
from io_actors.actors.scheduler import Scheduler
from io_actors.storage import posix
from io_actors.storage.buffers import host_view
from io_actors.storage.slot_format import payload_checksum
from statekv.block import Block
from statekv.disk_tier import DiskTier, Refusal
from statekv.eviction import Eviction
from statekv.lifecycle import BlockEvent, BlockState
from statekv.manager import KVCacheManager
from statekv.messages import BatchFinished, Completion, SlotRead, SlotReadFailed, outcomes
from statekv.onboarding import Onboarding
from statekv.pools import DiskSlots
from statekv.records import BlockRecords


@contextmanager
def _wrapped(owner: type, name: str,
             make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``owner.name`` by ``make(original)`` inside the block."""
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def release_during_onboard() -> AbstractContextManager[None]:
    """Seed: releaseBlocks freed a block whose disk read was still in flight, so a stranger's
    prefill and the late read collided in one GPU page."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def let_go(self: Eviction, req: Any, blocks: list[Block]) -> None:
            original(self, req, blocks)
            for block in blocks:
                if block.state is BlockState.ONBOARDING and block.ref_count == 0:
                    assert block.gpu_page is not None
                    if block.gpu_page not in self.gpu.empty:
                        self.gpu.empty.append(block.gpu_page)
        return let_go

    return _wrapped(Eviction, "let_go", make)


def slot_reused_before_read() -> AbstractContextManager[None]:
    """Seed: onboardBlock queued the read, then returned the slot's card to the free queue at
    once, so the next spill could overwrite the slot before the read ran."""

    def make(original: Callable[..., int]) -> Callable[..., int]:
        def start_reads(self: Onboarding, req: Any, run: list[Block]) -> int:
            retained = original(self, req, run)
            for block in run:
                assert block.disk_slot is not None
                self.disk.slots.empty.append(block.disk_slot)
            return retained
        return start_reads

    return _wrapped(Onboarding, "start_reads", make)


def displaced_identity_left_in_tree() -> AbstractContextManager[None]:
    """Seed: a spill that displaced disk content did not detach the displaced identity, so
    the prefix tree kept pointing at a slot whose bytes were recycled."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def discard(self: BlockRecords, block: Block, event: BlockEvent) -> None:
            key = block.key if block.state is BlockState.ON_DISK else None
            original(self, block, event)
            if key is not None and event is BlockEvent.DROPPED:
                self.index.blocks[key] = block
        return discard

    return _wrapped(BlockRecords, "discard", make)


def spills_displace_before_empty_slots() -> AbstractContextManager[None]:
    """Seed: empty disk slots were filed above fresh content, so spills displaced each other
    while empty slots sat unused."""

    def make(original: Callable[..., Refusal | None]) -> Callable[..., Refusal | None]:
        def try_spill(self: DiskTier, victim: Block, now: float,
                      **kwargs: Any) -> Refusal | None:
            disk = self.slots
            if disk.empty and disk.next_victim(True) is not None:
                empty, disk.empty = disk.empty, []
                try:
                    return original(self, victim, now, **kwargs)
                finally:
                    disk.empty = empty + disk.empty
            return original(self, victim, now, **kwargs)
        return try_spill

    return _wrapped(DiskTier, "try_spill", make)


def stale_deadline_kept() -> AbstractContextManager[None]:
    """Seed: a retained block's deadline entry stayed behind when the block left the disk
    (the deadline set leaked, and later walks met stale entries)."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def unfile(self: DiskSlots, block: Block) -> None:
            if block.heap_pos < 0:
                original(self, block)
        return unfile

    return _wrapped(DiskSlots, "unfile", make)


def reap_never_runs() -> AbstractContextManager[None]:
    """Seed: slots whose reads had landed were reclaimed only by a reap that never ran while
    the disk looked full, so spills wedged for good.  Here: the slot a landed read keeps (a
    disk copy) never goes back into the displacement order."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def read_landed(self: Onboarding, block: Block, now: float) -> None:
            original(self, block, now)
            if block.disk_slot is not None:
                self.disk.slots.unfile(block)
        return read_landed

    return _wrapped(Onboarding, "read_landed", make)


def displaced_copy_kept() -> AbstractContextManager[None]:
    """Inclusive tiers: a spill that displaced the disk copy of a block on GPU or host left
    the block pointing at the slot, so a later eviction trusts bytes that were overwritten
    (and the slot has two owners)."""

    def make(original: Callable[..., Refusal | None]) -> Callable[..., Refusal | None]:
        def try_spill(self: DiskTier, victim: Block, now: float,
                      **kwargs: Any) -> Refusal | None:
            placement = self._placement(victim, now)
            displaced = placement if isinstance(placement, Block) else None
            slot = None if displaced is None else displaced.disk_slot
            refusal = original(self, victim, now, **kwargs)
            if (refusal is None and displaced is not None
                    and displaced.state is not BlockState.FREE):
                displaced.disk_slot = slot
            return refusal
        return try_spill

    return _wrapped(DiskTier, "try_spill", make)


def checksum_not_verified() -> AbstractContextManager[None]:
    """Seed: short reads and I/O errors were logged and the block published anyway; here,
    the payload checksum is not verified, so a flipped bit is served as KV."""

    def accept_any(*_args: object, **_kwargs: object) -> None:
        return None

    @contextmanager
    def planted() -> Iterator[None]:
        # The store imported the function by name: replace it where the store looks it up.
        name = "verify_checksum"
        original = vars(posix)[name]
        setattr(posix, name, accept_any)
        try:
            yield
        finally:
            setattr(posix, name, original)

    return planted()


def header_checksum_of_other_bytes() -> AbstractContextManager[None]:
    """A spill's header carries a checksum the copy engine computed beside the copy, not one
    of the bytes written (on the GPU machine: a host page filled twice in one batch kept the
    earlier copy's checksum, and a page a prefetch read filled kept its earlier content's).
    Here every write stores a checksum one bit off its payload's: such a slot can never be
    read back, and nothing injected a fault into it."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def write_many(self: posix.PosixSlotStore, writes: Any) -> Any:
            stale = [attrs.evolve(item, crc=payload_checksum(host_view(item.buffer)) ^ 1)
                     for item in writes]
            return original(self, stale)
        return write_many

    return _wrapped(posix.PosixSlotStore, "write_many", make)


def failed_read_published() -> AbstractContextManager[None]:
    """Seed: a read that failed (an I/O error, a short read, a bad checksum) was logged and its
    block published anyway: the reader reports every read as landed, so the request computes
    on whatever the page holds."""

    def make(original: Callable[..., Completion]) -> Callable[..., Completion]:
        def execute(self: SlotReader, job: Any) -> Completion:
            result = original(self, job)
            landed = tuple(SlotRead(transfer=one.transfer)
                           if isinstance(one, SlotReadFailed) else one
                           for one in outcomes(result))
            return BatchFinished(outcomes=landed) if isinstance(result, BatchFinished) \
                else landed[0]
        return execute

    return _wrapped(SlotReader, "execute", make)


def failed_fetch_published() -> AbstractContextManager[None]:
    """Shared tier (issue 15): a fetch that failed (the key evicted between lookup and fetch,
    a corrupt value, a dead master) is applied as landed: its block is served and cached, so
    the request computes on whatever its page holds."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def fetch_failed(self: Onboarding, block: Block) -> None:
            self.fetch_landed(block)
        return fetch_failed

    return _wrapped(Onboarding, "fetch_failed", make)


def scheduler_waits_for_writes() -> AbstractContextManager[None]:
    """Seed: loadFromFile waited for the slot's pending writes on the scheduler, so onboarding
    a just-spilled block parked the whole engine behind the write queue.  Here a new request
    waits, in the serving loop's call, until no write is in flight."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
            while self.statistics().cache.writes_in_flight:
                time.sleep(0.001)
            return original(self, *args, **kwargs)
        return add_request

    return _wrapped(Scheduler, "add_request", make)


def _feeder_keeping_its_job_in_the_backlog(
    *, pop_checked: bool, count_feeding_once: bool,
) -> Iterator[None]:
    """The spill feeder as it was: the job it submits stays at the backlog's head until
    submit() returns.  `pop_checked`: pop it only if it is still there (else pop whatever
    is, as the first feeder did).  `count_feeding_once`: ``statistics()`` subtracts that job
    from the backlog (else it is counted both there and as the pool's)."""
    feeding: dict[int, object] = {}  # id(scheduler) -> the job its feeder is submitting

    def make_feeder(_fixed: Callable[..., Any]) -> Callable[..., Any]:
        async def _feed_spills(self: Scheduler) -> None:
            writer = self._writer
            assert writer is not None
            while True:
                while self._spill_backlog:
                    job = self._spill_backlog[0]
                    feeding[id(self)] = job
                    try:
                        await writer.submit(job)
                    finally:
                        feeding.pop(id(self), None)
                    if not pop_checked or (self._spill_backlog
                                           and self._spill_backlog[0] is job):
                        self._spill_backlog.popleft()
                if self._closed and not self._handover:
                    return
                self._spill_wakeup = trio.Event()
                await self._spill_wakeup.wait()
        return _feed_spills

    def make_backlog(_fixed: Callable[..., int]) -> Callable[..., int]:
        def _backlog(self: Scheduler) -> int:
            backlog = self._spill_backlog
            if not count_feeding_once:
                return len(backlog)
            return len(backlog) - bool(backlog and backlog[0] is feeding.get(id(self)))
        return _backlog

    with _wrapped(Scheduler, "_feed_spills", make_feeder), \
            _wrapped(Scheduler, "_backlog", make_backlog):
        yield


def feeder_pops_a_cleared_backlog() -> AbstractContextManager[None]:
    """Found by this suite (not the seed): closing without draining cleared the spill backlog
    while the spill feeder waited in submit() on a full writer queue; the feeder then popped
    the empty backlog, crashed the scheduler's nursery, the pools lost count of their jobs,
    and close() waited for them forever.  This is the feeder as it was before that fix, its
    job counted once in ``statistics()`` (so that only the pop of a cleared backlog is put
    back)."""
    return contextmanager(_feeder_keeping_its_job_in_the_backlog)(
        pop_checked=False, count_feeding_once=True)


def feeders_job_counted_twice() -> AbstractContextManager[None]:
    """Found by this suite (not the seed): the job the spill feeder is submitting stayed in
    the backlog until submit() returned, and was counted both as the writer pool's (queued)
    and as the backlog's in ``statistics()``.  The same job was also counted twice by a
    close without draining (found by the thread soak): a worker can start and finish it
    before the feeder runs again, and the close counted it dropped (in the backlog) and
    finished (the core had applied it).  The fix takes the job off the backlog before
    submit(); this is the feeder as it was."""
    return contextmanager(_feeder_keeping_its_job_in_the_backlog)(
        pop_checked=True, count_feeding_once=False)


def waiters_woken_only_on_slot_read() -> AbstractContextManager[None]:
    """Found by this suite (not the seed): ``wait_ready`` waiters were woken only when a read
    completion was applied, so a waiter whose request was released while parked stayed
    parked until some other read landed, and forever if none did.  Planted a little
    stronger -- only a successful read wakes waiters -- so that a failed read that lets a
    request go (rewound) is missed as well."""

    def make(original: Callable[..., list[trio.Event]]) -> Callable[..., list[trio.Event]]:
        def _waiters_to_wake_locked(self: Scheduler,
                                    completion: Completion | None) -> list[trio.Event]:
            # Only a batch of reads that all landed (a lone landed read) wakes waiters.
            if completion is None or not all(isinstance(one, SlotRead)
                                             for one in outcomes(completion)):
                return []
            return original(self, completion)
        return _waiters_to_wake_locked

    return _wrapped(Scheduler, "_waiters_to_wake_locked", make)


def wait_ready_returns_early() -> AbstractContextManager[None]:
    """An early return: ``wait_ready`` returns at once, parked or not, so the serving loop
    would compute on pages whose reads have not landed."""

    def make(_original: Callable[..., Any]) -> Callable[..., Any]:
        async def wait_ready(self: Scheduler, request_id: str) -> None:
            await trio.lowlevel.checkpoint()
        return wait_ready

    return _wrapped(Scheduler, "wait_ready", make)


def waiter_assumes_its_request_is_live() -> AbstractContextManager[None]:
    """Issue 27: the waiter asked the core whether a request it had not checked was still
    there; a release between the caller's `is_ready` and the waiter (queued for the trio
    thread) made it raise inside a trio system task, which killed the cache's actor."""

    def make(_original: Callable[..., Any]) -> Callable[..., Any]:
        async def wait_ready(self: Scheduler, request_id: str) -> None:
            event = trio.Event()
            with self._lock:
                if self._core.is_ready(request_id):  # raises once the request is gone
                    return
                self._ready_waiters.setdefault(request_id, []).append(event)  # type: ignore[arg-type]
            await event.wait()
        return wait_ready

    return _wrapped(Scheduler, "wait_ready", make)


def disk_rate_not_reported() -> AbstractContextManager[None]:
    """Issue 23: the scheduler stops passing the readers' measurements to the core, so the
    cost gate never learns the disk is slow and reads however slow it is."""

    def make(_original: Callable[..., None]) -> Callable[..., None]:
        def report_disk_read(self: Scheduler, num_bytes: int, seconds: float) -> None:
            del self, num_bytes, seconds
        return report_disk_read

    return _wrapped(Scheduler, "report_disk_read", make)


def fetch_rate_not_reported() -> AbstractContextManager[None]:
    """Issue 23: the shared tier's fetch rate never reaches the core: every remote run is
    fetched however slow the cluster."""

    def make(_original: Callable[..., None]) -> Callable[..., None]:
        def report_fetch(self: KVCacheManager, num_bytes: int, seconds: float) -> None:
            del self, num_bytes, seconds
        return report_fetch

    return _wrapped(KVCacheManager, "report_fetch", make)


def publishes_in_flight_uncounted() -> AbstractContextManager[None]:
    """Issue 23: the publisher forgets the batch it is publishing (counted only while
    queued), so a slow cluster lets it hold a batch more than its bound."""
    from io_actors.actors.remote_publisher import RemotePublisher

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        async def _publish(self: RemotePublisher, jobs: list[Any]) -> None:
            with self._lock:
                self._waiting -= len(jobs)
            try:
                await original(self, jobs)
            finally:
                with self._lock:
                    self._waiting += len(jobs)  # the original takes them off again
        return _publish

    return _wrapped(RemotePublisher, "_publish", make)


def expired_restored_as_retained() -> AbstractContextManager[None]:
    """Issue 23: a restore that files content whose deadline passed while the process was
    down with the retained content (as if no time had passed), instead of with the
    best-effort content it has become: the displacement order after a restart is wrong."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def restore(self: DiskTier, blocks: Any, slots: set[int], now: float) -> None:
            deadlines = [e.expiry for e in blocks if e.expiry is not None]
            original(self, blocks, slots, min([now, *deadlines]) - 1.0)
        return restore

    return _wrapped(DiskTier, "restore", make)


def prefetch_page_freed_on_leave() -> AbstractContextManager[None]:
    """Prefetch (issue 12): a queued request that leaves while its prefetch reads are in
    flight gives their host pages back at once, as it does for landed ones -- so a GPU
    eviction's copy (or another prefetch) can take a page the late read still writes into."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def end_prefetch(self: Onboarding, rid: Any, now: float) -> None:
            asked = [b for b in self.queued.get(rid, {}) if rid in b.prefetchers]
            original(self, rid, now)
            for block in asked:
                if (block.state is BlockState.PREFETCHING and not block.prefetchers
                        and block.host_page is not None
                        and block.host_page not in self.host.empty):
                    self.host.empty.append(block.host_page)
        return end_prefetch

    return _wrapped(Onboarding, "end_prefetch", make)


def staged_write_of_dropped_content_freed() -> AbstractContextManager[None]:
    """Retention write-through: a staged write that lands after its content left the cache
    (a GPU victim with no host page: the staging holds host pages too) frees its slot
    instead of keeping the content on disk, so retained content is lost to its own
    write-through."""

    def make(original: Callable[..., bool]) -> Callable[..., bool]:
        def adopt(self: DiskTier, key: Any, write: Any, now: float) -> bool:
            if self.index.blocks.get(key) is None:
                return False
            return original(self, key, write, now)
        return adopt

    return _wrapped(DiskTier, "_adopt", make)


def host_copy_of_a_draining_spill() -> AbstractContextManager[None]:
    """Inclusive host tier: a block recalled while its spill drains keeps the host page as
    its host copy, though the write still owns the page and gives it back when it lands --
    so a later eviction onto that "copy" trusts a page another block may be using."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def recall(self: Onboarding, block: Block) -> None:
            spilling = block.state is BlockState.SPILLING
            page = block.host_page
            original(self, block)
            if spilling and page is not None:
                block.host_page = page
                self.host.copies[block] = None
        return recall

    return _wrapped(Onboarding, "recall", make)


def pools_kept_after_close() -> AbstractContextManager[None]:
    """A leak for the leak check to catch (tests/test_fuzz_leak_check.py): every cache that
    closes leaves its GPU pool referenced from outside, as a cache of per-process device
    state that grows with every cache would (the close gives its own references back)."""
    kept: list[object] = []

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        async def close(self: Scheduler, **kwargs: Any) -> Any:
            kept.append(self._copies._pools.gpu)  # type: ignore[attr-defined]  # TorchCopyEngine's
            return await original(self, **kwargs)
        return close

    @contextmanager
    def planted() -> Iterator[None]:
        with _wrapped(Scheduler, "close", make):
            try:
                yield
            finally:
                kept.clear()

    return planted()


@attrs.frozen
class Planted:
    name: str
    plant: Callable[[], AbstractContextManager[None]]
    machine: type[RuleBasedStateMachine]
    examples: int
    """Examples the machine gets to find it (the test's budget)."""


PLANTED = {
    p.name: p for p in (
        Planted("release-during-onboard", release_during_onboard, CoreVsSpec, 1000),
        Planted("slot-reused-before-read", slot_reused_before_read, CoreVsSpec, 1000),
        Planted("displaced-identity-left-in-tree", displaced_identity_left_in_tree,
                CoreVsSpec, 1000),
        Planted("spills-displace-before-empty-slots", spills_displace_before_empty_slots,
                CoreVsSpec, 1000),
        Planted("stale-deadline-kept", stale_deadline_kept, CoreVsSpec, 1000),
        Planted("reap-never-runs", reap_never_runs, CoreVsSpec, 1000),
        Planted("displaced-copy-kept", displaced_copy_kept, CoreVsSpec, 1000),
        Planted("displaced-copy-kept-system", displaced_copy_kept, SystemMachine, 1000),
        Planted("checksum-not-verified", checksum_not_verified, SystemMachine, 1000),
        Planted("failed-read-published", failed_read_published, SystemMachine, 1000),
        Planted("header-checksum-of-other-bytes", header_checksum_of_other_bytes,
                SystemMachine, 1000),
        Planted("release-during-onboard-system", release_during_onboard, SystemMachine, 1000),
        Planted("scheduler-waits-for-writes", scheduler_waits_for_writes, SystemMachine, 1000),
        Planted("feeder-pops-a-cleared-backlog", feeder_pops_a_cleared_backlog, SystemMachine,
                3000),
        Planted("feeders-job-counted-twice", feeders_job_counted_twice, SystemMachine, 1000),
        Planted("waiters-woken-only-on-slot-read", waiters_woken_only_on_slot_read,
                SystemMachine, 1000),
        Planted("wait-ready-returns-early", wait_ready_returns_early, SystemMachine, 1000),
        Planted("waiter-assumes-its-request-is-live", waiter_assumes_its_request_is_live,
                SystemMachine, 1000),
        Planted("prefetch-page-freed-on-leave", prefetch_page_freed_on_leave, CoreVsSpec,
                1000),
        Planted("prefetch-page-freed-on-leave-system", prefetch_page_freed_on_leave,
                SystemMachine, 1000),
        Planted("failed-fetch-published", failed_fetch_published, CoreVsSpec, 1000),
        Planted("expired-restored-as-retained", expired_restored_as_retained, CoreVsSpec,
                1000),
        Planted("staged-write-of-dropped-content-freed",
                staged_write_of_dropped_content_freed, CoreVsSpec, 1000),
        Planted("host-copy-of-a-draining-spill", host_copy_of_a_draining_spill, CoreVsSpec,
                1000),
        Planted("host-copy-of-a-draining-spill-system", host_copy_of_a_draining_spill,
                SystemMachine, 1000),
    )
}


@attrs.frozen
class Caught:
    error: BaseException
    steps: list[str]
    """The shrunk example's steps, as Hypothesis printed them."""


def hunt(planted: Planted, failure_dir: Path, *, examples: int | None = None,
         echo: Callable[[str], None] = lambda _line: None) -> Caught | None:
    """Run the planted bug's machine; the shrunk failure, or None if it was not found."""
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        echo(line)

    config = settings(
        max_examples=examples or planted.examples, stateful_step_count=50, deadline=None,
        database=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
    )
    with planted.plant():
        try:
            run_machine(planted.machine, config, failure_dir=failure_dir, echo=report)
        except Exception as exc:  # the planted bug surfacing, whatever check catches it
            text = "\n".join([*lines, *map(str, getattr(exc, "__notes__", []))])
            steps = [line.strip() for line in text.splitlines()
                     if line.strip().startswith("state.") and "teardown" not in line
                     and "agrees_with_the_spec" not in line]
            return Caught(error=exc, steps=steps)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.planted", description=__doc__)
    parser.add_argument("name", choices=sorted(PLANTED))
    parser.add_argument("--failures", type=Path, default=Path(".hypothesis/fuzz-planted"))
    args = parser.parse_args(argv)
    planted = PLANTED[args.name]
    caught = hunt(planted, args.failures, echo=print)
    if caught is None:
        print(f"NOT caught: {planted.name}")
        return 1
    print(f"caught {planted.name}: {type(caught.error).__name__}, shrunk to "
          f"{len(caught.steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
