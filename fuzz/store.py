"""The slot store the fuzz harnesses run on: a real store, faults injected by identity.

:class:`FuzzStore` wraps a real :class:`~io_actors.storage.interfaces.SlotStore` (POSIX files, or
kvikio on the GPU machine).  It injects the faults of
:mod:`io_actors.storage.faults` -- EIO on open, read or write, ENOSPC, short reads and
writes, torn writes (reported or silent), bit flips on disk, slow calls -- and can *stall* a
call (block it until released) to model a disk that has stopped answering.

Faults are assigned to a transfer's identity, ``(operation, slot, key)``, by the harness when
it sees the command (at most one transfer per slot is ever in flight), never to "the next
call": with several worker threads the order of calls varies between runs, and the same
steps must always fail the same transfer.  The soak assigns them at random instead
(:class:`RandomFaults`).

The store also keeps the truth about each slot -- which key was last written there and
whether the bytes on disk are still what was written -- and checks every read that
succeeds: the bytes it returns must be exactly the payload the harness wrote for that key,
and a slot whose bytes were flipped must never read back successfully.  Anything else is
recorded in :attr:`FuzzStore.violations` (the harness asserts the list stays empty): corrupt
KV must never get past the store.
"""

from __future__ import annotations

import enum
import random
import threading
from collections.abc import Callable, Sequence

import torch

from io_actors.storage.faults import Fault, FaultPlan, FaultRule, FaultyStore, Op
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore
from io_actors.storage.slot_format import SlotMeta
from statekv.errors import TransferFailed
from statekv.ids import BlockHash, SlotId

WRITE_FAULTS = (
    Fault.EIO_OPEN, Fault.EIO, Fault.ENOSPC, Fault.SHORT_WRITE, Fault.TORN_WRITE,
    Fault.TORN_WRITE_SILENT, Fault.BIT_FLIP, Fault.SLOW,
)
READ_FAULTS = (Fault.EIO_OPEN, Fault.EIO, Fault.SHORT_READ, Fault.SLOW)
SLOW_SECONDS = 0.005
"""How long a SLOW call sleeps in the gated machine (the soak draws its own delays)."""

Identity = tuple[Op, SlotId, BlockHash]


class Truth(enum.Enum):
    """What a slot's bytes on disk are, as far as the store knows."""

    INTACT = "intact"
    """Exactly what the last successful write put there."""
    FLIPPED = "flipped"
    """A bit of the payload flipped after the write: every read must fail."""
    TORN = "torn"
    """Part of the write never landed, silently: the bytes may or may not be intact."""


class RandomFaults:
    """Faults and delays drawn at random for each call (the real-thread soak)."""

    def __init__(self, seed: int, *, fault_rate: float, delay_rate: float,
                 max_delay_s: float) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.fault_rate = fault_rate
        self.delay_rate = delay_rate
        self.max_delay_s = max_delay_s

    def draw(self, op: Op) -> tuple[Fault | None, float]:
        """(fault or None, delay in seconds) for one call of `op`."""
        with self._lock:
            rng = self._rng
            delay = rng.uniform(0, self.max_delay_s) if rng.random() < self.delay_rate else 0.0
            if rng.random() >= self.fault_rate:
                return None, delay
            kinds = [f for f in (WRITE_FAULTS if op is Op.WRITE else READ_FAULTS)
                     if f is not Fault.SLOW]
            return rng.choice(kinds), delay


class FuzzStore:
    """A :class:`SlotStore` that injects faults by transfer identity and checks reads."""

    def __init__(
        self,
        inner: SlotStore,
        *,
        expected: Callable[[BlockHash], torch.Tensor | None],
        notify: Callable[[], None] = lambda: None,
        random_faults: RandomFaults | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self._inner = inner
        self._expected = expected
        self._notify = notify
        self._random = random_faults
        self._sleep = sleep
        self._lock = threading.Lock()
        self._assigned: dict[Identity, Fault] = {}
        self._stall: set[Identity] = set()
        self._stalled: list[threading.Event] = []
        self._calls = 0
        self.stalled = 0
        """Calls blocked in a stall right now."""
        self.truth: dict[SlotId, tuple[BlockHash, Truth]] = {}
        self.write_errors = 0
        """Write calls that raised TransferFailed."""
        self.read_errors = 0
        """Read calls that raised TransferFailed."""
        self.discards = 0
        """Calls of discard(): the harness's count of the slots the scheduler let go."""
        self.injected: list[str] = []
        self.violations: list[str] = []

    @property
    def inner(self) -> SlotStore:
        return self._inner

    @property
    def device_reads(self) -> bool:
        return self._inner.device_reads

    # ------------------------------------------------------------------ the harness's side

    def assign(self, op: Op, slot: SlotId, key: BlockHash, fault: Fault) -> None:
        """Fail the transfer ``(op, slot, key)`` with `fault` when it reaches the store."""
        with self._lock:
            self._assigned[(op, slot, key)] = fault

    def stall(self, op: Op, slot: SlotId, key: BlockHash) -> None:
        """Block the transfer ``(op, slot, key)`` in the store until :meth:`unstall`."""
        with self._lock:
            self._stall.add((op, slot, key))

    def unstall(self) -> None:
        """Let every stalled call (and every call marked to stall) go on.

        The count of stalled calls drops at once, not when each thread wakes: a released call
        is running again, and the harness must not mistake it for one still stalled.
        """
        with self._lock:
            self._stall.clear()
            released, self._stalled = self._stalled, []
            self.stalled = 0
        for wake in released:
            wake.set()

    # ------------------------------------------------------------------ the SlotStore

    def _begin(self, op: Op, slot: SlotId, key: BlockHash) -> tuple[Fault | None, float, int]:
        ident = (op, slot, key)
        wake: threading.Event | None = None
        with self._lock:
            self._calls += 1
            call = self._calls
            fault = self._assigned.pop(ident, None)
            if ident in self._stall:
                self._stall.discard(ident)
                wake = threading.Event()
                self._stalled.append(wake)
                self.stalled += 1
        delay = 0.0
        if self._random is not None:
            fault, delay = self._random.draw(op)
        if wake is not None:
            self._notify()
            wake.wait()
        if fault is not None:
            with self._lock:
                self.injected.append(f"{op.value} slot {slot}: {fault.value}")
        return fault, delay, call

    def _faulty(self, op: Op, fault: Fault, call: int) -> FaultyStore:
        delay = SLOW_SECONDS if fault is Fault.SLOW else 0.0
        rule = FaultRule(op=op, fault=fault, nth=1, delay_s=delay)
        kwargs = {} if self._sleep is None else {"sleep": self._sleep}
        return FaultyStore(self._inner, FaultPlan(rules=(rule,), seed=call), **kwargs)

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        fault, delay, call = self._begin(Op.WRITE, slot, key)
        if delay:
            (self._sleep or _sleep)(delay)
        try:
            if fault is None:
                self._inner.write(slot, key, src, meta)
            else:
                self._faulty(Op.WRITE, fault, call).write(slot, key, src, meta)
        except TransferFailed:
            with self._lock:
                self.write_errors += 1
                self.truth.pop(slot, None)
            raise
        finally:
            self._notify()
        truth = (Truth.FLIPPED if fault is Fault.BIT_FLIP
                 else Truth.TORN if fault is Fault.TORN_WRITE_SILENT else Truth.INTACT)
        with self._lock:
            self.truth[slot] = (key, truth)

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        fault, delay, call = self._begin(Op.READ, slot, key)
        if delay:
            (self._sleep or _sleep)(delay)
        with self._lock:
            before = self.truth.get(slot)
        try:
            if fault is None:
                self._inner.read(slot, key, dst)
            else:
                self._faulty(Op.READ, fault, call).read(slot, key, dst)
        except TransferFailed as exc:
            self._check_failed_read(slot, key, fault, before, exc)
            raise
        finally:
            self._notify()
        self._check_read(slot, key, dst, before)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        """Per slot as `write` (faults and stalls by identity); the slots with no fault go
        to the inner store as one batch, so its vector path runs under the fuzzer too."""
        items = list(writes)
        begun = [self._begin(Op.WRITE, item.slot, item.key) for item in items]
        out = self._many(Op.WRITE, items, begun, self._inner.write_many)
        with self._lock:
            for item, outcome, (fault, _delay, _call) in zip(items, out, begun, strict=True):
                if outcome is not None:
                    self.write_errors += 1
                    self.truth.pop(item.slot, None)
                else:
                    truth = (Truth.FLIPPED if fault is Fault.BIT_FLIP
                             else Truth.TORN if fault is Fault.TORN_WRITE_SILENT
                             else Truth.INTACT)
                    self.truth[item.slot] = (item.key, truth)
        return out

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        items = list(reads)
        begun = [self._begin(Op.READ, item.slot, item.key) for item in items]
        with self._lock:
            before = [self.truth.get(item.slot) for item in items]
        out = self._many(Op.READ, items, begun, self._inner.read_many)
        for item, outcome, prior, (fault, _d, _c) in zip(items, out, before, begun,
                                                          strict=True):
            if outcome is not None:
                self._check_failed_read(item.slot, item.key, fault, prior, outcome)
            else:
                self._check_read(item.slot, item.key, item.buffer, prior)
        return out

    def _check_failed_read(
        self, slot: SlotId, key: BlockHash, fault: Fault | None,
        before: tuple[BlockHash, Truth] | None, error: TransferFailed,
    ) -> None:
        """A read fails only where something made it fail: a fault injected into it, or bytes
        the store knows are not what was written.  A read of a slot last written intact for
        `key`, with no fault of its own, that fails anyway means the write stored a header
        its payload disagrees with (as a wrong checksum computed beside the copy did) or the
        read path spoiled the bytes: recorded as a violation."""
        with self._lock:
            self.read_errors += 1
            if fault is None and before == (key, Truth.INTACT):
                self.violations.append(
                    f"slot {slot}: a read of the intact bytes written for key "
                    f"{key.hex()[:12]} failed with no fault injected: {error}")

    def _many(
        self, op: Op, items: list[SlotIO], begun: list[tuple[Fault | None, float, int]],
        plain_call: Callable[[Sequence[SlotIO]], BatchOutcome],
    ) -> BatchOutcome:
        delay = max((d for _f, d, _c in begun), default=0.0)
        if delay:
            (self._sleep or _sleep)(delay)
        out: BatchOutcome = [None] * len(items)
        try:
            plain = [n for n, (fault, _d, _c) in enumerate(begun) if fault is None]
            if plain:
                results = plain_call([items[n] for n in plain])
                for n, outcome in zip(plain, results, strict=True):
                    out[n] = outcome
            for n, (fault, _d, call) in enumerate(begun):
                if fault is None:
                    continue
                item = items[n]
                faulty = self._faulty(op, fault, call)
                try:
                    if op is Op.WRITE:
                        faulty.write(item.slot, item.key, item.buffer, item.meta)
                    else:
                        faulty.read(item.slot, item.key, item.buffer)
                except TransferFailed as exc:
                    out[n] = exc
        finally:
            self._notify()
        return out

    def _check_read(
        self, slot: SlotId, key: BlockHash, dst: torch.Tensor,
        before: tuple[BlockHash, Truth] | None,
    ) -> None:
        """A read that succeeded returned exactly the payload written for `key`."""
        problems: list[str] = []
        if before is not None and before[0] == key and before[1] is Truth.FLIPPED:
            problems.append(f"slot {slot}: a read of flipped bytes passed the checksum")
        expected = self._expected(key)
        if expected is not None:
            got = dst.detach().to("cpu", copy=True).view(torch.uint8).reshape(-1)
            if not torch.equal(got, expected):
                problems.append(f"slot {slot}: a read returned bytes other than those "
                                f"written for key {key.hex()[:12]}")
        if problems:
            with self._lock:
                self.violations += problems

    def discard(self, slot: SlotId) -> None:
        with self._lock:
            self.discards += 1
        self._inner.discard(slot)

    def close(self) -> None:
        self.unstall()
        self._inner.close()


def _sleep(seconds: float) -> None:
    threading.Event().wait(seconds)
