"""Deterministic fault injection at the SlotStore seam, for tests and fuzzing.

:class:`FaultyStore` wraps any :class:`~io_actors.storage.interfaces.SlotStore` and, following a
:class:`FaultPlan`, makes chosen calls fail the way real disks and filesystems fail.  Every
fault must end in :class:`~statekv.errors.TransferFailed`, either at once or when the slot is
read back (checksum or header mismatch); none may ever let a read return wrong bytes.

Enumeration, as SQLite's I/O error tests do it: run a scenario once with
``FaultPlan()`` (no faults) and read :meth:`FaultyStore.calls`; then, for k in 1..N, run it
again with a plan that fails exactly the k-th call (or every call from the k-th on) and
check that the system stays correct.  :func:`single_fault_plans` builds those plans.

Determinism: calls are numbered per operation in the order they reach the store, and every
random choice (where a write tears, which bit flips) comes from a generator seeded with the
plan's seed, the operation and the call number.  With one calling thread, or any fixed
order of calls, a plan replays exactly.

Faults that change bytes on disk (short, torn and bit-flipped writes) need to reach the
slot's bytes: the inner store must offer ``slot_extent(slot)`` (:class:`RawSlotAccess`), as
the POSIX and kvikio stores do.
"""

from __future__ import annotations

import enum
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol, cast, runtime_checkable

import attrs
import torch

from io_actors.storage.interfaces import BatchOutcome, RetentionStore, SlotIO, SlotStore
from io_actors.storage.posix_open import Recovery
from io_actors.storage.retention_journal import RetentionRecord
from io_actors.storage.slot_format import ALIGN, HEADER_SIZE, SlotExtent, SlotMeta
from statekv.errors import TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

POISON: Final = 0xA5
"""Byte value a failed read leaves in its destination (a real failed read leaves garbage)."""


class _Crash(BaseException):
    """The simulated process died inside the inner store: nothing after reaches the disk.

    A BaseException so that no handler of the inner store (which would cut a torn append
    back, or give the index journal up) runs, as none would in a process that died."""


@runtime_checkable
class _IndexAccess(Protocol):
    """A store that keeps an index journal (PosixSlotStore)."""

    def observe_index(
        self, observer: Callable[[str, Path, int, int], None] | None
    ) -> None: ...

    def abandon(self) -> None: ...


class _JournalAccess(Protocol):
    """A store that can say where its retention journal is (PosixSlotStore)."""

    @property
    def journal_path(self) -> Path: ...


@runtime_checkable
class RawSlotAccess(Protocol):
    """A store that can say where a slot's bytes live on disk."""

    def slot_extent(self, slot: SlotId) -> SlotExtent: ...


class Op(enum.Enum):
    """The store calls a plan counts and fails."""

    WRITE = "write"
    READ = "read"
    JOURNAL = "journal"
    """Appends to the retention journal (``persist_retention``), numbered on their own."""
    INDEX = "index"
    """Appends to the index journal, numbered on their own: the inner store makes them
    inside its writes (before and after the slot's bytes), its discards' records with the
    next append, and a seal at close (``observe_index``)."""


class Fault(enum.Enum):
    """What goes wrong."""

    EIO_OPEN = "eio_open"
    """Opening fails: nothing moves, the call raises."""
    EIO = "eio"
    """An I/O error. Write: the bytes may have landed, the call raises. Read: the
    destination is left poisoned, the call raises."""
    ENOSPC = "enospc"
    """Write: no space left, nothing lands, the call raises."""
    SHORT_READ = "short_read"
    """Read: only a prefix of the destination is filled (the rest poisoned); raises."""
    SHORT_WRITE = "short_write"
    """Write: only a prefix of the slot's 4 KiB pages lands (header first); raises."""
    TORN_WRITE = "torn_write"
    """Write: a seeded subset of the slot's 4 KiB pages lands, the rest keep their old
    bytes (a write torn by a crash, in any order); the call raises."""
    TORN_WRITE_SILENT = "torn_write_silent"
    """As TORN_WRITE, but the call reports success: only the read-back can notice."""
    BIT_FLIP = "bit_flip"
    """Write: succeeds, then one seeded bit of the payload flips on disk (media rot)."""
    SLOW = "slow"
    """The call sleeps `delay_s`, then runs normally."""
    CRASH = "crash"
    """Write: the process dies during this write.  A seeded subset of the slot's 4 KiB
    pages lands (possibly all, possibly none), the call raises, and every later call of
    any operation raises without touching the disk: nothing after a crash reaches it.
    Journal and index: a seeded prefix of the append lands (possibly all, possibly none,
    often ending inside a record), then the same.  A crash during a slot write also loses
    the index record the write would have appended after its bytes landed."""


_APPLIES_TO: Final[dict[Fault, frozenset[Op]]] = {
    Fault.EIO_OPEN: frozenset({Op.READ, Op.WRITE}),
    Fault.EIO: frozenset({Op.READ, Op.WRITE, Op.JOURNAL}),
    Fault.ENOSPC: frozenset({Op.WRITE}),
    Fault.SHORT_READ: frozenset({Op.READ}),
    Fault.SHORT_WRITE: frozenset({Op.WRITE}),
    Fault.TORN_WRITE: frozenset({Op.WRITE}),
    Fault.TORN_WRITE_SILENT: frozenset({Op.WRITE}),
    Fault.BIT_FLIP: frozenset({Op.WRITE}),
    Fault.SLOW: frozenset({Op.READ, Op.WRITE, Op.JOURNAL}),
    Fault.CRASH: frozenset({Op.WRITE, Op.JOURNAL, Op.INDEX}),
}
NEEDS_RAW_ACCESS: Final = frozenset(
    {Fault.SHORT_WRITE, Fault.TORN_WRITE, Fault.TORN_WRITE_SILENT, Fault.BIT_FLIP, Fault.CRASH}
)
"""Faults that rewrite bytes on disk behind the inner store's back."""


def _to_op(value: object) -> Op:
    try:
        return Op(value)
    except ValueError:
        known = [o.value for o in Op]
        raise UsageError("op", f"unknown operation {value!r} (known: {known})") from None


def _to_fault(value: object) -> Fault:
    try:
        return Fault(value)
    except ValueError:
        known = [f.value for f in Fault]
        raise UsageError("fault", f"unknown fault {value!r} (known: {known})") from None


@attrs.frozen(kw_only=True)
class FaultRule:
    """Fail the `nth` call of `op` (counting from 1), or every call from it on."""

    op: Op = attrs.field(converter=_to_op)
    fault: Fault = attrs.field(converter=_to_fault)
    nth: int
    onward: bool = False
    delay_s: float = 0.0
    """Sleep of a SLOW fault, in seconds."""

    def __attrs_post_init__(self) -> None:
        if self.op not in _APPLIES_TO[self.fault]:
            raise UsageError(
                "op", f"{self.fault.value} does not apply to {self.op.value} calls"
            )
        if isinstance(self.nth, bool) or not isinstance(self.nth, int) or self.nth < 1:
            raise UsageError("nth", f"must be an integer >= 1, got {self.nth!r}")
        if not isinstance(self.onward, bool):
            raise UsageError("onward", f"must be True or False, got {self.onward!r}")
        delay = self.delay_s
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            raise UsageError("delay_s", f"must be a number, got {delay!r}")
        if not math.isfinite(delay) or delay < 0 or delay > 3600:
            raise UsageError("delay_s", f"must be in [0, 3600] seconds, got {delay!r}")
        if delay and self.fault is not Fault.SLOW:
            raise UsageError("delay_s", "only a SLOW fault sleeps")

    def matches(self, call: int) -> bool:
        return call >= self.nth if self.onward else call == self.nth


def _to_rules(value: object) -> tuple[FaultRule, ...]:
    if not isinstance(value, list | tuple):
        raise UsageError("rules", f"must be a sequence of FaultRule, got {value!r}")
    for rule in value:
        if not isinstance(rule, FaultRule):
            raise UsageError("rules", f"must hold FaultRule records, got {rule!r}")
    return tuple(value)


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Which calls fail, and how; the first matching rule wins.  No rules: counting mode."""

    rules: tuple[FaultRule, ...] = attrs.field(default=(), converter=_to_rules)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError("seed", f"must be an integer, got {self.seed!r}")

    def rule_for(self, op: Op, call: int) -> FaultRule | None:
        for rule in self.rules:
            if rule.op is op and rule.matches(call):
                return rule
        return None


def single_fault_plans(
    op: Op | str,
    fault: Fault | str,
    calls: int,
    *,
    onward: bool = False,
    seed: int = 0,
    delay_s: float = 0.0,
) -> list[FaultPlan]:
    """One plan per call number 1..`calls`, each failing that call (and later ones if
    `onward`): the enumeration of a scenario whose calls a counting run has counted."""
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
        raise UsageError("calls", f"must be an integer >= 0, got {calls!r}")
    return [
        FaultPlan(
            rules=(FaultRule(op=op, fault=fault, nth=k, onward=onward, delay_s=delay_s),),
            seed=seed,
        )
        for k in range(1, calls + 1)
    ]


@attrs.frozen(kw_only=True)
class FaultStatistics:
    """What a FaultyStore saw and did."""

    writes: int
    """Write calls (the count a plan's `nth` refers to)."""
    reads: int
    """Read calls."""
    discards: int
    injected: tuple[str, ...]
    """Each injected fault in order, as ``"<op>#<call>:<fault>"``."""


class FaultyStore:
    """A SlotStore that passes calls to `inner` and injects the faults of `plan`.

    `sleep` is the function a SLOW fault calls (tests may pass a fake).
    """

    def __init__(
        self,
        inner: SlotStore,
        plan: FaultPlan,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(plan, FaultPlan):
            raise UsageError("plan", f"must be a FaultPlan, got {plan!r}")
        raw = [r.fault.value for r in plan.rules if r.fault in NEEDS_RAW_ACCESS]
        if raw and not isinstance(inner, RawSlotAccess):
            raise UsageError(
                "plan", f"faults {raw} rewrite bytes on disk; {type(inner).__name__} "
                "offers no slot_extent()"
            )
        self._inner = inner
        self._plan = plan
        self._sleep = sleep
        self._lock = threading.Lock()
        self._counts = {Op.WRITE: 0, Op.READ: 0, Op.JOURNAL: 0, Op.INDEX: 0}
        self._discards = 0
        self._injected: list[str] = []
        self._crashed_at: int | None = None
        self._tearing = False
        """A CRASH write is in the inner store: its post-write index record never lands."""
        self._silently_torn: set[SlotId] = set()
        if isinstance(inner, _IndexAccess):
            inner.observe_index(self._index_appended)

    @property
    def inner(self) -> SlotStore:
        return self._inner

    def silently_torn(self) -> frozenset[SlotId]:
        """Slots whose last write was torn while reporting success (TORN_WRITE_SILENT): what
        they hold is not what the index journal names, and only a read-back can tell."""
        with self._lock:
            return frozenset(self._silently_torn)

    @property
    def device_reads(self) -> bool:
        return self._inner.device_reads

    def calls(self, op: Op | str) -> int:
        """How many calls of `op` this store has seen."""
        with self._lock:
            return self._counts[_to_op(op)]

    def statistics(self) -> FaultStatistics:
        with self._lock:
            return FaultStatistics(
                writes=self._counts[Op.WRITE],
                reads=self._counts[Op.READ],
                discards=self._discards,
                injected=tuple(self._injected),
            )

    def _index_appended(self, what: str, path: Path, before: int, after: int) -> None:
        """The inner store appended to its index journal: maybe crash in the middle."""
        if what == "landed" and self._tearing:
            os.truncate(path, before)
            raise _Crash
        call, rule = self._next(Op.INDEX)
        if rule is None or rule.fault is not Fault.CRASH:
            return
        with self._lock:
            self._crashed_at = call
        kept = self._rng(Op.INDEX, call).randrange(after - before + 1)
        os.truncate(path, before + kept)
        raise _Crash

    def _next(self, op: Op) -> tuple[int, FaultRule | None]:
        with self._lock:
            self._counts[op] += 1
            call = self._counts[op]
            rule = self._plan.rule_for(op, call)
            if rule is not None:
                self._injected.append(f"{op.value}#{call}:{rule.fault.value}")
            return call, rule

    def _rng(self, op: Op, call: int) -> random.Random:
        # String seeds hash with SHA-512: the same in every process, whatever PYTHONHASHSEED.
        return random.Random(f"{self._plan.seed}:{op.value}:{call}")

    # --- write ------------------------------------------------------------------------------

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        call, rule = self._next(Op.WRITE)
        if self._crashed_at is not None:
            raise TransferFailed(f"slot {slot}", "the process crashed (injected)")
        if rule is None:
            with self._lock:
                self._silently_torn.discard(slot)
            try:
                self._inner.write(slot, key, src, meta)
            except _Crash:
                raise TransferFailed(f"slot {slot}", "the process crashed during its index "
                                     "journal append (injected)") from None
            return
        self._faulty_write(slot, key, src, meta, call, rule)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        """Calls are numbered per slot, as for `write`; the slots no rule names go to the
        inner store as one batch (its vector path), the others one by one."""
        return self._many(Op.WRITE, writes, self._inner.write_many, self._faulty_write)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        return self._many(Op.READ, reads, self._inner.read_many, self._faulty_read)

    def _many(
        self, op: Op, batch: Sequence[SlotIO],
        plain_call: Callable[[Sequence[SlotIO]], BatchOutcome],
        faulty_call: Callable[
            [SlotId, BlockHash, torch.Tensor, SlotMeta | None, int, FaultRule], None
        ],
    ) -> BatchOutcome:
        """Per slot, in the batch's order: runs of slots no rule names go to the inner store
        as one batch each (its vector path), a faulted slot alone, and after a CRASH nothing
        more reaches the disk -- exactly what one call per slot would do."""
        items = list(batch)
        out: BatchOutcome = [None] * len(items)
        run: list[int] = []

        def flush() -> None:
            if run:
                try:
                    outcomes = plain_call([items[n] for n in run])
                except _Crash:
                    # The call never returned: none of its slots counts as landed.
                    outcomes = [TransferFailed(f"slot {items[n].slot}", "the process "
                                               "crashed during this batch (injected)")
                                for n in run]
                for n, outcome in zip(run, outcomes, strict=True):
                    out[n] = outcome
                run.clear()

        for n, item in enumerate(items):
            call, rule = self._next(op)
            if self._crashed_at is not None:
                if op is Op.READ:
                    item.buffer.fill_(POISON)
                out[n] = TransferFailed(f"slot {item.slot}", "the process crashed (injected)")
                continue
            if rule is None:
                if op is Op.WRITE:
                    with self._lock:
                        self._silently_torn.discard(item.slot)
                run.append(n)
                continue
            flush()
            try:
                faulty_call(item.slot, item.key, item.buffer, item.meta, call, rule)
            except TransferFailed as exc:
                out[n] = exc
        flush()
        return out

    def _faulty_write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None,
        call: int, rule: FaultRule,
    ) -> None:
        what = f"slot {slot}"
        fault = rule.fault
        if fault is Fault.SLOW:
            self._sleep(rule.delay_s)
            self._inner.write(slot, key, src, meta)
        elif fault is Fault.EIO_OPEN:
            raise TransferFailed(what, "open failed: [Errno 5] Input/output error (injected)")
        elif fault is Fault.ENOSPC:
            raise TransferFailed(
                what, "write failed: [Errno 28] No space left on device (injected)"
            )
        elif fault is Fault.EIO:
            self._inner.write(slot, key, src, meta)
            raise TransferFailed(what, "write failed: [Errno 5] Input/output error (injected)")
        elif fault is Fault.BIT_FLIP:
            self._inner.write(slot, key, src, meta)
            self._flip_bit(slot, src.numel(), self._rng(Op.WRITE, call))
        else:
            if fault is Fault.CRASH:
                with self._lock:
                    self._crashed_at = call
            self._tear(slot, key, src, meta, fault, self._rng(Op.WRITE, call), what)

    # --- the retention journal ---------------------------------------------------------------

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        """One journal append.  Over a store that keeps no journal the records are not
        kept, as the scheduler does for such a store, and no call is counted."""
        inner = self._inner
        if not isinstance(inner, RetentionStore):
            return
        call, rule = self._next(Op.JOURNAL)
        what = "retention journal"
        if self._crashed_at is not None:
            raise TransferFailed(what, "the process crashed (injected)")
        if rule is None:
            inner.persist_retention(records)
            return
        fault = rule.fault
        if fault is Fault.SLOW:
            self._sleep(rule.delay_s)
            inner.persist_retention(records)
        elif fault is Fault.EIO:
            raise TransferFailed(what, "append failed: [Errno 5] Input/output error (injected)")
        else:  # CRASH
            with self._lock:
                self._crashed_at = call
            path = cast(_JournalAccess, inner).journal_path
            before = path.stat().st_size if path.exists() else 0
            inner.persist_retention(records)
            after = path.stat().st_size
            kept = self._rng(Op.JOURNAL, call).randrange(after - before + 1)
            os.truncate(path, before + kept)
            raise TransferFailed(
                what, f"the process crashed during this append: {kept} of "
                f"{after - before} bytes landed (injected)"
            )

    def _extent(self, slot: SlotId) -> SlotExtent:
        # The constructor refused plans with disk faults for stores without slot_extent().
        return cast(RawSlotAccess, self._inner).slot_extent(slot)

    def _tear(
        self,
        slot: SlotId,
        key: BlockHash,
        src: torch.Tensor,
        meta: SlotMeta | None,
        fault: Fault,
        rng: random.Random,
        what: str,
    ) -> None:
        """Write for real, then put back the old bytes of the pages that did not land."""
        extent = self._extent(slot)
        before = _raw_read(extent)
        self._tearing = fault is Fault.CRASH
        with self._lock:
            if fault is Fault.TORN_WRITE_SILENT:
                self._silently_torn.add(slot)
            else:
                self._silently_torn.discard(slot)
        try:
            self._inner.write(slot, key, src, meta)
        except _Crash:
            pass  # the write's own index record, cut off (the crash came before it)
        finally:
            self._tearing = False
        pages = extent.nbytes // ALIGN
        if fault is Fault.CRASH:
            # Any subset may have reached the disk, all of it or none included.
            lost = [p for p in range(pages) if rng.random() < 0.5]
        elif fault is Fault.SHORT_WRITE:
            landed = rng.randrange(1, pages) if pages > 1 else 0
            lost = list(range(landed, pages))
        else:
            lost = [p for p in range(pages) if rng.random() < 0.5]
            if not lost:
                lost = [rng.randrange(pages)]
            if len(lost) == pages and pages > 1:
                lost.remove(rng.choice(lost))
        with _RawFile(extent) as raw:
            for page in lost:
                start = page * ALIGN
                raw.write(start, before[start : start + ALIGN])
        if fault is Fault.TORN_WRITE_SILENT:
            return
        if fault is Fault.CRASH:
            raise TransferFailed(what, "the process crashed during this write (injected)")
        written = (pages - len(lost)) * ALIGN
        kind = "short write" if fault is Fault.SHORT_WRITE else "torn write"
        raise TransferFailed(
            what, f"{kind}: {written} of {extent.nbytes} bytes landed (injected)"
        )

    def _flip_bit(self, slot: SlotId, payload_len: int, rng: random.Random) -> None:
        extent = self._extent(slot)
        where = HEADER_SIZE + rng.randrange(payload_len)
        bit = 1 << rng.randrange(8)
        with _RawFile(extent) as raw:
            (old,) = raw.read(where, 1)
            raw.write(where, bytes([old ^ bit]))

    # --- read -------------------------------------------------------------------------------

    @property
    def crashed_at(self) -> int | None:
        """The write call a CRASH fault struck, or None."""
        with self._lock:
            return self._crashed_at

    @property
    def recovery(self) -> Recovery | None:
        """The inner store's :attr:`~io_actors.storage.posix.PosixSlotStore.recovery`."""
        recovery = getattr(self._inner, "recovery", None)
        return recovery if isinstance(recovery, Recovery) else None

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        call, rule = self._next(Op.READ)
        if self._crashed_at is not None:
            dst.fill_(POISON)
            raise TransferFailed(f"slot {slot}", "the process crashed (injected)")
        if rule is None:
            self._inner.read(slot, key, dst)
            return
        self._faulty_read(slot, key, dst, None, call, rule)

    def _faulty_read(
        self, slot: SlotId, key: BlockHash, dst: torch.Tensor, _meta: SlotMeta | None,
        call: int, rule: FaultRule,
    ) -> None:
        what = f"slot {slot}"
        fault = rule.fault
        if fault is Fault.SLOW:
            self._sleep(rule.delay_s)
            self._inner.read(slot, key, dst)
        elif fault is Fault.EIO_OPEN:
            raise TransferFailed(what, "open failed: [Errno 5] Input/output error (injected)")
        elif fault is Fault.EIO:
            dst.fill_(POISON)
            raise TransferFailed(what, "read failed: [Errno 5] Input/output error (injected)")
        else:
            # SHORT_READ, the one other fault a READ rule admits.
            self._inner.read(slot, key, dst)
            got = self._rng(Op.READ, call).randrange(dst.numel())
            dst[got:].fill_(POISON)
            raise TransferFailed(
                what, f"short read: {got} of {dst.numel()} payload bytes (injected)"
            )

    def discard(self, slot: SlotId) -> None:
        with self._lock:
            self._discards += 1
        self._inner.discard(slot)

    def close(self) -> None:
        """After a CRASH the inner store is abandoned: a dead process seals nothing."""
        inner = self._inner
        if self._crashed_at is not None and isinstance(inner, _IndexAccess):
            inner.abandon()
            return
        try:
            inner.close()
        except _Crash:
            # The crash struck the close's own append (the index journal's seal).
            if isinstance(inner, _IndexAccess):
                inner.abandon()


def _raw_read(extent: SlotExtent) -> bytes:
    with _RawFile(extent) as raw:
        return raw.read(0, extent.nbytes)


class _RawFile:
    """Buffered access to one slot's bytes.

    Linux keeps buffered and O_DIRECT access to one file coherent (a direct read first
    writes back dirty cached pages of its range; a direct write drops them), so bytes
    changed here are what the inner store reads next.
    """

    def __init__(self, extent: SlotExtent) -> None:
        self._extent = extent
        self._fd = -1

    def __enter__(self) -> _RawFile:
        self._fd = os.open(self._extent.path, os.O_RDWR | os.O_CLOEXEC)
        return self

    def __exit__(self, *_exc: object) -> None:
        os.close(self._fd)

    def read(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._fd, nbytes, self._extent.offset + offset)
        if len(data) != nbytes:
            raise UsageError("slot", f"slot extent {self._extent} is shorter than expected")
        return data

    def write(self, offset: int, data: bytes) -> None:
        if os.pwrite(self._fd, data, self._extent.offset + offset) != len(data):
            raise UsageError("slot", f"could not rewrite {len(data)} bytes of {self._extent}")
