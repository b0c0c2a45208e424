"""State-trace recording: every block transition and every message between the actors.

A :class:`TraceRecorder` is a bounded ring of records, preallocated once, that keeps the last
`capacity` things that happened:

* **transitions** of the block lifecycle (time, block, request, from-state, to-state, event),
  received from the core through the :class:`statekv.trace.TraceSink` protocol;
* **messages** between the actors, recorded by the scheduler when it was given a recorder:
  commands it executes or hands over (copies, disk writes and reads, slot frees),
  completions the pools report back, requests parked and un-parked, errors and invariant
  failures.

Recording is off by default: the cache records nothing unless a recorder is passed to
``open_cache(..., recorder=...)`` or ``BlockingCache(..., recorder=...)``.  Without one, the
core pays one ``is None`` test per transition and the scheduler at most two per call and two
per completion.  With one, a record is one tuple stored into the ring (a command or a
completion is stored as the frozen message itself): the hot path never formats, converts or
allocates anything else.  Conversion into :class:`TraceRecord` happens when the trace is
read (bench/trace_cost.py measures both costs).

Times: the core stamps transitions with the time of the call that caused them, and the
scheduler stamps messages with the same clock, so one trace has one time axis.  Records a
program adds itself (:meth:`TraceRecorder.error`, :meth:`TraceRecorder.invariant_failed`)
take the recorder's `clock` when one was given, else the latest time recorded.

Threads: the scheduler records only under its lock, so its records never race.  A program
that adds records itself must do so while no cache call is running (between steps).

Formats: :meth:`Trace.save_jsonl` writes JSON Lines (a header line, then one record a line);
:func:`load_trace` reads it back; :func:`chrome_trace` exports the Chrome trace-event format,
which Perfetto (ui.perfetto.dev) and chrome://tracing open.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from statekv.errors import ConfigError, StateKVError
from statekv.ids import BlockId, RequestId
from statekv.lifecycle import BlockEvent, BlockState
from statekv.messages import (
    BlockCommand,
    Command,
    Completion,
    CopyEngineToHost,
    CopyGpuToHost,
    CopyHostToEngine,
    CopyHostToGpu,
    FetchBlock,
    FreeSlot,
    LoadSlot,
    PersistRetention,
    PrefetchSlot,
    PublishBlock,
    ReadSlot,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
    WriteSlot,
    outcomes,
    per_block,
)

FORMAT_NAME: Final = "statekv-trace"
FORMAT_VERSION: Final = 1
DEFAULT_CAPACITY: Final = 1 << 16
"""65,536 records: a few MiB of memory, minutes of a busy serving loop."""


class RecordKind(enum.StrEnum):
    """What one record is."""

    TRANSITION = "transition"
    """A block changed state (from the core)."""
    COMMAND = "command"
    """The scheduler executed or handed over one of the core's commands."""
    COMPLETION = "completion"
    """A pool reported a disk write or read done (or failed)."""
    PARK = "park"
    """A request waits for disk reads: it may not run until they land."""
    UNPARK = "unpark"
    """A parked request's reads all landed (or it was released while parked)."""
    ERROR = "error"
    """Something failed that the cache reports (recorded by a program or an actor)."""
    INVARIANT = "invariant"
    """An invariant check failed: statekv's own bug."""


class TraceFormatError(StateKVError, ValueError):
    """A trace file cannot be read; the message names the line."""


FAILED_COMPLETIONS: Final = frozenset({"SlotWriteFailed", "SlotReadFailed"})

# Which state a block's slot belongs to: a transition into or out of one of these carries
# the slot its write or read used.
_SLOT_STATES: Final = frozenset({"SPILLING", "ON_DISK", "ONBOARDING", "PREFETCHING", "PREFETCHED",
                                 "LOADING"})


@attrs.frozen(kw_only=True)
class TraceRecord:
    """One thing that happened, as read back from a recorder or a trace file."""

    seq: int
    """Position in everything the recorder saw (gaps: overwritten or filtered out)."""
    time: float
    """Seconds on the cache's clock."""
    kind: RecordKind
    actor: str
    """Who acted: "core" for transitions; for messages the actor on the other side of the
    scheduler ("copy", "writer", "reader", "store"), or "scheduler" for parks."""
    event: str
    """The lifecycle event (transitions) or the message's name (``WriteSlot``,
    ``SlotReadFailed``, ``parked``...)."""
    block: int | None = None
    slot: int | None = None
    request: str | None = None
    from_state: str | None = None
    to_state: str | None = None
    transfer: int | None = None
    detail: str | None = None

    @property
    def is_error(self) -> bool:
        """A failed transfer, a block entering ERROR, an error or an invariant failure."""
        return (
            self.kind is RecordKind.ERROR
            or self.kind is RecordKind.INVARIANT
            or self.event in FAILED_COMPLETIONS
            or (self.kind is RecordKind.TRANSITION and self.to_state == "ERROR")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "time": self.time, "kind": self.kind.value, "actor": self.actor,
            "event": self.event, "block": self.block, "slot": self.slot,
            "request": self.request, "from_state": self.from_state,
            "to_state": self.to_state, "transfer": self.transfer, "detail": self.detail,
        }


@attrs.frozen(kw_only=True)
class Trace:
    """A recorded trace: the records kept, oldest first, and how many were lost."""

    records: tuple[TraceRecord, ...]
    recorded: int
    """Records the recorder saw in all."""
    capacity: int | None = None
    """The ring's size (None when not known)."""

    @property
    def dropped(self) -> int:
        """Older records overwritten by newer ones."""
        return max(0, self.recorded - len(self.records))

    def save_jsonl(self, path: str | Path) -> Path:
        """Write the trace as JSON Lines: a header object, then one record a line."""
        out = Path(path)
        header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "recorded": self.recorded,
                  "capacity": self.capacity, "time_unit": "s"}
        with out.open("w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for record in self.records:
                f.write(json.dumps(record.to_json(), allow_nan=False) + "\n")
        return out


class TraceRecorder:
    """The last `capacity` transitions and messages, in a ring allocated once.

    Pass it to ``open_cache`` / ``BlockingCache`` as ``recorder=``: the cache then records
    both the core's transitions and the scheduler's messages into it.  On its own it is a
    :class:`statekv.trace.TraceSink` for a bare ``KVCacheManager(config, trace=recorder)``.
    """

    # Slots: the hot path's attribute loads and stores are the recording's cost.
    __slots__ = ("_capacity", "_clock", "_mask", "_recorded", "_ring")

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, *, clock: Callable[[], float] | None = None
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError("capacity", f"must be an integer >= 1, got {capacity!r}")
        # The ring's size is the power of two at or above `capacity`, so that the slot of
        # record n is `n & mask` (cheaper than `%` on the hot path); reading keeps the last
        # `capacity`.  Three tuple shapes share the ring, told apart by their length: a
        # transition's 6 arguments as given; (time, message) for a command or completion,
        # the frozen message itself (decoded only when read); 9 fields for anything else.
        size = 1 << (capacity - 1).bit_length()
        self._ring: list[tuple[Any, ...] | None] = [None] * size
        self._mask = size - 1
        self._capacity = capacity
        self._recorded = 0
        self._clock = clock

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def recorded(self) -> int:
        """Records seen since creation (only the last `capacity` are kept)."""
        return self._recorded

    def __len__(self) -> int:
        return min(self._recorded, self._capacity)

    # ------------------------------------------------------------------ the core's sink

    def record(
        self,
        time: float,
        block: BlockId,
        request: RequestId | None,
        from_state: BlockState,
        to_state: BlockState,
        event: BlockEvent,
    ) -> None:
        """One transition (statekv.trace.TraceSink): the hot path, one tuple store."""
        n = self._recorded
        self._ring[n & self._mask] = (time, block, request, from_state, to_state, event)
        self._recorded = n + 1

    # ------------------------------------------------------------------ messages

    def message(
        self,
        time: float,
        kind: RecordKind,
        actor: str,
        event: str,
        *,
        block: int | None = None,
        slot: int | None = None,
        request: str | None = None,
        transfer: int | None = None,
        detail: str | None = None,
    ) -> None:
        """One message between actors, or a park, error or invariant failure."""
        n = self._recorded
        self._ring[n & self._mask] = (time, kind, actor, event, block, slot, request,
                                      transfer, detail)
        self._recorded = n + 1

    def commands(self, time: float, commands: Sequence[Command]) -> None:
        """The commands the scheduler took from the core, in the order it executes them;
        a batch is recorded as its per-block records."""
        ring, mask, n = self._ring, self._mask, self._recorded
        for cmd in per_block(commands):
            ring[n & mask] = (time, cmd)
            n += 1
        self._recorded = n

    def completion(self, time: float, completion: Completion) -> None:
        """A pool's report: one record per block transfer it reports on."""
        ring, mask, n = self._ring, self._mask, self._recorded
        for outcome in outcomes(completion):
            ring[n & mask] = (time, outcome)
            n += 1
        self._recorded = n

    def park(self, time: float, request: str, *, detail: str | None = None) -> None:
        self.message(time, RecordKind.PARK, "scheduler", "parked", request=request,
                     detail=detail)

    def unpark(self, time: float, request: str, *, detail: str | None = None) -> None:
        self.message(time, RecordKind.UNPARK, "scheduler", "unparked", request=request,
                     detail=detail)

    def error(
        self,
        message: str,
        *,
        actor: str = "program",
        block: int | None = None,
        slot: int | None = None,
        request: str | None = None,
        time: float | None = None,
    ) -> None:
        """Record an error seen by the program (a wrong byte, a failed check...)."""
        self.message(self._time(time), RecordKind.ERROR, actor, "error", block=block,
                     slot=slot, request=request, detail=message)

    def invariant_failed(
        self,
        message: str,
        *,
        actor: str = "program",
        block: int | None = None,
        request: str | None = None,
        time: float | None = None,
    ) -> None:
        """Record a failed invariant check (the scheduler records its own)."""
        self.message(self._time(time), RecordKind.INVARIANT, actor, "invariant failed",
                     block=block, request=request, detail=message)

    def _time(self, time: float | None) -> float:
        if time is not None:
            return time
        if self._clock is not None:
            return self._clock()
        latest = self._latest_time()
        return latest if latest is not None else 0.0

    def _latest_time(self) -> float | None:
        if not self._recorded:
            return None
        item = self._ring[(self._recorded - 1) & self._mask]
        assert item is not None
        return float(item[0])

    # ------------------------------------------------------------------ reading

    def records(self) -> list[TraceRecord]:
        """The kept records, oldest first, with slots and requests filled in (see annotate)."""
        ring = self._ring
        mask = self._mask
        kept = len(self)
        first = self._recorded - kept
        out: list[TraceRecord] = []
        for seq in range(first, self._recorded):
            item = ring[seq & mask]
            assert item is not None
            if len(item) == 6:
                time, block, request, from_state, to_state, event = item
                out.append(TraceRecord(
                    seq=seq, time=_finite(time), kind=RecordKind.TRANSITION, actor="core",
                    event=event.name, block=int(block), request=request,
                    from_state=from_state.name, to_state=to_state.name,
                ))
            elif len(item) == 2:
                out.append(_decode_message(seq, _finite(item[0]), item[1]))
            else:
                time, kind, actor, event, block, slot, request, transfer, detail = item
                out.append(TraceRecord(
                    seq=seq, time=_finite(time), kind=kind, actor=actor, event=event,
                    block=block, slot=slot, request=request, transfer=transfer,
                    detail=detail,
                ))
        return annotate(out)

    def snapshot(self) -> Trace:
        return Trace(records=tuple(self.records()), recorded=self._recorded,
                     capacity=self._capacity)

    def save_jsonl(self, path: str | Path) -> Path:
        """Write what the ring holds now as JSON Lines."""
        return self.snapshot().save_jsonl(path)

    def clear(self) -> None:
        """Forget every record (e.g. between the examples of a fuzz run)."""
        self._ring = [None] * len(self._ring)
        self._recorded = 0


def _decode_message(seq: int, time: float, msg: BlockCommand | TransferOutcome) -> TraceRecord:
    """A command or completion as a record (done when read, never on the hot path)."""
    name = type(msg).__name__
    if isinstance(msg, WriteSlot):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="writer",
                           event=name, block=msg.block, slot=msg.slot, transfer=msg.transfer,
                           detail=f"host page {msg.host_page}")
    if isinstance(msg, ReadSlot):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="reader",
                           event=name, block=msg.block, slot=msg.slot, transfer=msg.transfer,
                           detail=f"gpu page {msg.gpu_page}")
    if isinstance(msg, PrefetchSlot):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="reader",
                           event=name, block=msg.block, slot=msg.slot, transfer=msg.transfer,
                           detail=f"host page {msg.host_page}")
    if isinstance(msg, CopyGpuToHost):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="copy",
                           event=name, block=msg.block,
                           detail=f"gpu page {msg.gpu_page} -> host page {msg.host_page}")
    if isinstance(msg, CopyHostToGpu):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="copy",
                           event=name, block=msg.block,
                           detail=f"host page {msg.host_page} -> gpu page {msg.gpu_page}")
    if isinstance(msg, FreeSlot):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="store",
                           event=name, slot=msg.slot)
    if isinstance(msg, PersistRetention):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="writer",
                           event=name, slot=msg.slot, detail=f"deadline {msg.expiry:.3f}")
    if isinstance(msg, FetchBlock):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="fetcher",
                           event=name, block=msg.block, transfer=msg.transfer,
                           detail=f"gpu page {msg.gpu_page}")
    if isinstance(msg, PublishBlock):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="publisher",
                           event=name, block=msg.block, detail=f"host page {msg.host_page}")
    if isinstance(msg, LoadSlot):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="reader",
                           event=name, block=msg.block, slot=msg.slot, transfer=msg.transfer,
                           detail=f"engine page {msg.engine_page}")
    if isinstance(msg, CopyEngineToHost | CopyHostToEngine):
        return TraceRecord(seq=seq, time=time, kind=RecordKind.COMMAND, actor="copy",
                           event=name, block=msg.block,
                           detail=f"engine page {msg.engine_page}, host page {msg.host_page}")
    writes = isinstance(msg, SlotWritten | SlotWriteFailed)
    cause = msg.cause if isinstance(msg, SlotWriteFailed | SlotReadFailed) else None
    # Block and slot come from the transfer's command (see annotate).
    return TraceRecord(seq=seq, time=time, kind=RecordKind.COMPLETION,
                       actor="writer" if writes else "reader", event=name,
                       transfer=msg.transfer, detail=cause)


def _finite(time: float) -> float:
    # The core's time is -inf before its first call; JSON has no infinities.
    return float(time) if math.isfinite(time) else 0.0


def annotate(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """Fill in what the hot path did not know, from the records around each one.

    * A transition into, within or out of a disk state gets the slot of the write or read
      that the scheduler's next command for that block names (the core decides the slot in
      the same call that records the transition; the command follows it).
    * A command gets the request of the transition that caused it (the block's latest).
    * A completion gets the block and slot of its transfer's command (when the ring still
      holds the command).

    Fields already set are kept, so annotating twice changes nothing.
    """
    out = list(records)
    commands: dict[int, TraceRecord] = {}
    for i, rec in enumerate(out):
        if rec.transfer is None:
            continue
        if rec.kind is RecordKind.COMMAND:
            commands[rec.transfer] = rec
        elif rec.kind is RecordKind.COMPLETION and rec.transfer in commands:
            command = commands.pop(rec.transfer)
            out[i] = attrs.evolve(
                rec, block=rec.block if rec.block is not None else command.block,
                slot=rec.slot if rec.slot is not None else command.slot,
            )
    slot_of: dict[int, int] = {}
    awaiting_slot: dict[int, list[int]] = {}
    last_request: dict[int, str | None] = {}
    for i, rec in enumerate(out):
        block = rec.block
        if block is None:
            continue
        if rec.kind is RecordKind.TRANSITION:
            last_request[block] = rec.request
            in_slot = rec.to_state in _SLOT_STATES or rec.from_state in _SLOT_STATES
            if in_slot and rec.slot is None:
                if block in slot_of:
                    out[i] = attrs.evolve(rec, slot=slot_of[block])
                else:
                    awaiting_slot.setdefault(block, []).append(i)
            if rec.to_state not in _SLOT_STATES:
                slot_of.pop(block, None)
                awaiting_slot.pop(block, None)
        elif rec.kind is RecordKind.COMMAND:
            cause = last_request.get(block)
            if rec.request is None and cause is not None:
                out[i] = attrs.evolve(rec, request=cause)
            if rec.slot is not None and rec.event in ("WriteSlot", "ReadSlot", "PrefetchSlot"):
                slot_of[block] = rec.slot
                for j in awaiting_slot.pop(block, []):
                    out[j] = attrs.evolve(out[j], slot=rec.slot)
    return out


# ---------------------------------------------------------------------- JSON Lines


_STR_FIELDS: Final = ("actor", "event")
_OPT_INT_FIELDS: Final = ("block", "slot", "transfer")
_OPT_STR_FIELDS: Final = ("request", "from_state", "to_state", "detail")


def _record_from_json(obj: object, where: str) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        kind = RecordKind(str(obj.get("kind")))
    except ValueError:
        raise TraceFormatError(f"{where}: unknown kind {obj.get('kind')!r}") from None
    seq, time = obj.get("seq"), obj.get("time")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise TraceFormatError(f"{where}: seq must be an integer, got {seq!r}")
    if isinstance(time, bool) or not isinstance(time, int | float) or not math.isfinite(time):
        raise TraceFormatError(f"{where}: time must be a finite number, got {time!r}")
    fields: dict[str, Any] = {}
    for name in _STR_FIELDS:
        value = obj.get(name)
        if not isinstance(value, str):
            raise TraceFormatError(f"{where}: {name} must be a string, got {value!r}")
        fields[name] = value
    for name in _OPT_INT_FIELDS:
        value = obj.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TraceFormatError(f"{where}: {name} must be an integer or null, got {value!r}")
        fields[name] = value
    for name in _OPT_STR_FIELDS:
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise TraceFormatError(f"{where}: {name} must be a string or null, got {value!r}")
        fields[name] = value
    return TraceRecord(seq=seq, time=float(time), kind=kind, **fields)


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :meth:`Trace.save_jsonl` (or the recorder's)."""
    source = Path(path)
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceFormatError(f"{source}: {exc.strerror or exc}") from None
    if not lines:
        raise TraceFormatError(f"{source}: empty file, expected a {FORMAT_NAME} header")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{source}:1: not JSON ({exc.msg})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"{source}:1: not a {FORMAT_NAME} file (no header line)")
    if header.get("version") != FORMAT_VERSION:
        raise TraceFormatError(
            f"{source}:1: version {header.get('version')!r}, this reader knows {FORMAT_VERSION}"
        )
    records: list[TraceRecord] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{source}:{number}: not JSON ({exc.msg})") from None
        records.append(_record_from_json(obj, f"{source}:{number}"))
    recorded = header.get("recorded")
    capacity = header.get("capacity")
    return Trace(
        records=tuple(records),
        recorded=recorded if isinstance(recorded, int) and recorded >= len(records)
        else len(records),
        capacity=capacity if isinstance(capacity, int) else None,
    )


# ---------------------------------------------------------------------- derived views


@attrs.frozen(kw_only=True)
class StateSpan:
    """A block in one state from `start` until `end` (`open`: still in it at the end)."""

    block: int
    state: str
    start: float
    end: float
    entered_by: TraceRecord
    open: bool


@attrs.frozen(kw_only=True)
class TransferSpan:
    """One disk write or read, from its command to its completion."""

    transfer: int
    kind: str
    """"write" or "read"."""
    actor: str
    block: int | None
    slot: int | None
    request: str | None
    start: float
    end: float
    outcome: str
    """"ok", "failed", or "in flight" (no completion before the trace ends)."""
    cause: str | None
    command: TraceRecord | None
    """None when the command was overwritten in the ring before the completion."""
    completion: TraceRecord | None


@attrs.frozen(kw_only=True)
class ParkSpan:
    """A request parked from `start` until `end`."""

    request: str
    start: float
    end: float
    outcome: str
    """"unparked", "released while parked", or "still parked"."""
    park: TraceRecord
    unpark: TraceRecord | None


def time_bounds(records: Sequence[TraceRecord]) -> tuple[float, float]:
    if not records:
        return 0.0, 0.0
    times = [r.time for r in records]
    return min(times), max(times)


def state_spans(records: Sequence[TraceRecord]) -> list[StateSpan]:
    """Every block's states in order; FREE is left out (a free record holds nothing)."""
    _origin, end = time_bounds(records)
    open_span: dict[int, tuple[str, float, TraceRecord]] = {}
    spans: list[StateSpan] = []
    for rec in records:
        if rec.kind is not RecordKind.TRANSITION or rec.block is None:
            continue
        previous = open_span.pop(rec.block, None)
        if previous is not None:
            state, start, entered = previous
            spans.append(StateSpan(block=rec.block, state=state, start=start, end=rec.time,
                                   entered_by=entered, open=False))
        if rec.to_state is not None and rec.to_state != "FREE":
            open_span[rec.block] = (rec.to_state, rec.time, rec)
    for block, (state, start, entered) in open_span.items():
        spans.append(StateSpan(block=block, state=state, start=start, end=max(start, end),
                               entered_by=entered, open=True))
    spans.sort(key=lambda s: (s.block, s.start, s.entered_by.seq))
    return spans


def transfer_spans(records: Sequence[TraceRecord]) -> list[TransferSpan]:
    """Every disk write and read whose command or completion the trace holds."""
    _origin, end = time_bounds(records)
    started: dict[int, TraceRecord] = {}
    spans: list[TransferSpan] = []
    for rec in records:
        if rec.transfer is None:
            continue
        if rec.kind is RecordKind.COMMAND:
            started[rec.transfer] = rec
        elif rec.kind is RecordKind.COMPLETION:
            command = started.pop(rec.transfer, None)
            failed = rec.event in FAILED_COMPLETIONS
            kind = "write" if rec.event in ("SlotWritten", "SlotWriteFailed") else "read"
            block, slot = rec.block, rec.slot
            if command is not None:
                block = command.block if block is None else block
                slot = command.slot if slot is None else slot
            spans.append(TransferSpan(
                transfer=rec.transfer, kind=kind, actor=rec.actor, block=block, slot=slot,
                request=command.request if command else None,
                start=command.time if command else rec.time, end=rec.time,
                outcome="failed" if failed else "ok", cause=rec.detail, command=command,
                completion=rec,
            ))
    for command in started.values():
        assert command.transfer is not None
        spans.append(TransferSpan(
            transfer=command.transfer, kind="write" if command.event == "WriteSlot" else "read",
            actor=command.actor, block=command.block, slot=command.slot,
            request=command.request, start=command.time, end=max(command.time, end),
            outcome="in flight", cause=None, command=command, completion=None,
        ))
    spans.sort(key=lambda s: (s.start, s.transfer))
    return spans


def park_spans(records: Sequence[TraceRecord]) -> list[ParkSpan]:
    _origin, end = time_bounds(records)
    parked: dict[str, TraceRecord] = {}
    spans: list[ParkSpan] = []
    for rec in records:
        if rec.request is None:
            continue
        if rec.kind is RecordKind.PARK:
            parked[rec.request] = rec
        elif rec.kind is RecordKind.UNPARK and rec.request in parked:
            park = parked.pop(rec.request)
            spans.append(ParkSpan(
                request=rec.request, start=park.time, end=rec.time,
                outcome=rec.detail or "unparked", park=park, unpark=rec,
            ))
    for request, park in parked.items():
        spans.append(ParkSpan(request=request, start=park.time, end=max(park.time, end),
                              outcome="still parked", park=park, unpark=None))
    spans.sort(key=lambda s: (s.start, s.request))
    return spans


# ---------------------------------------------------------------------- Chrome trace events

_BLOCKS_PID: Final = 1
_SLOTS_PID: Final = 2
_ACTORS_PID: Final = 3
_ACTOR_ORDER: Final = ("scheduler", "copy", "writer", "reader", "store", "core")


def chrome_trace(trace: Trace | Sequence[TraceRecord]) -> dict[str, Any]:
    """The trace in the Chrome trace-event format (JSON object form).

    Tracks: process "blocks" with one thread per block (its states as complete events),
    process "slots" with one thread per disk slot (each transfer as a complete event: at
    most one is in flight per slot, so they never overlap), process "actors" with one
    thread per actor (each message as an instant event; transfers and parks also as async
    spans, which may overlap).  Errors are instant events on their block's track, invariant
    failures global instant events.  Timestamps are microseconds since the first record.
    """
    records = trace.records if isinstance(trace, Trace) else tuple(trace)
    origin, _end = time_bounds(records)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []

    def name_process(pid: int, name: str, order: int) -> None:
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": name}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": order}})

    def name_thread(pid: int, tid: int, name: str) -> None:
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": tid}})

    name_process(_ACTORS_PID, "statekv actors", 0)
    name_process(_BLOCKS_PID, "statekv blocks", 1)
    name_process(_SLOTS_PID, "statekv slots", 2)

    actors = sorted({r.actor for r in records} | {"scheduler"},
                    key=lambda a: (_ACTOR_ORDER.index(a) if a in _ACTOR_ORDER
                                   else len(_ACTOR_ORDER), a))
    actor_tid = {a: i + 1 for i, a in enumerate(actors)}
    for actor, tid in actor_tid.items():
        name_thread(_ACTORS_PID, tid, actor)
    blocks = sorted({r.block for r in records if r.block is not None})
    for block in blocks:
        name_thread(_BLOCKS_PID, block + 1, f"block {block}")
    slots = sorted({r.slot for r in records if r.slot is not None})
    for slot in slots:
        name_thread(_SLOTS_PID, slot + 1, f"slot {slot}")

    for span in state_spans(records):
        entered = span.entered_by
        events.append({
            "name": span.state, "cat": "state", "ph": "X", "ts": us(span.start),
            "dur": round(max(0.0, us(span.end) - us(span.start)), 3), "pid": _BLOCKS_PID,
            "tid": span.block + 1,
            "args": {"block": span.block, "entered_by": entered.event,
                     "from_state": entered.from_state, "request": entered.request,
                     "slot": entered.slot, "seq": entered.seq,
                     "open_at_end_of_trace": span.open},
        })

    for xfer in transfer_spans(records):
        args = {"transfer": xfer.transfer, "block": xfer.block, "slot": xfer.slot,
                "request": xfer.request, "outcome": xfer.outcome, "cause": xfer.cause}
        if xfer.slot is not None:
            events.append({
                "name": xfer.kind, "cat": "transfer", "ph": "X", "ts": us(xfer.start),
                "dur": round(max(0.0, us(xfer.end) - us(xfer.start)), 3), "pid": _SLOTS_PID,
                "tid": xfer.slot + 1, "args": args,
            })
        tid = actor_tid.get(xfer.actor, actor_tid["scheduler"])
        span_id = f"transfer-{xfer.transfer}"
        events.append({"name": xfer.kind, "cat": "transfer", "ph": "b", "ts": us(xfer.start),
                       "pid": _ACTORS_PID, "tid": tid, "id": span_id, "args": args})
        events.append({"name": xfer.kind, "cat": "transfer", "ph": "e", "ts": us(xfer.end),
                       "pid": _ACTORS_PID, "tid": tid, "id": span_id})

    for n, park in enumerate(park_spans(records)):
        span_id = f"park-{n}"
        tid = actor_tid["scheduler"]
        args = {"request": park.request, "outcome": park.outcome, "detail": park.park.detail}
        events.append({"name": "parked", "cat": "park", "ph": "b", "ts": us(park.start),
                       "pid": _ACTORS_PID, "tid": tid, "id": span_id, "args": args})
        events.append({"name": "parked", "cat": "park", "ph": "e", "ts": us(park.end),
                       "pid": _ACTORS_PID, "tid": tid, "id": span_id})

    for rec in records:
        if rec.kind is RecordKind.TRANSITION:
            if rec.is_error and rec.block is not None:
                events.append(_instant(rec, us(rec.time), _BLOCKS_PID, rec.block + 1, "t",
                                       f"{rec.event} (block {rec.block})"))
            continue
        tid = actor_tid[rec.actor]
        if rec.kind is RecordKind.INVARIANT:
            events.append(_instant(rec, us(rec.time), _ACTORS_PID, tid, "g",
                                   f"invariant failed: {rec.detail}"))
            continue
        label = rec.event if rec.request is None else f"{rec.event} {rec.request}"
        events.append(_instant(rec, us(rec.time), _ACTORS_PID, tid, "t", label))
        if rec.is_error and rec.block is not None:
            events.append(_instant(rec, us(rec.time), _BLOCKS_PID, rec.block + 1, "t",
                                   f"{rec.event} (block {rec.block})"))

    events.sort(key=lambda e: e["ts"])
    dropped = trace.dropped if isinstance(trace, Trace) else 0
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                      "origin_seconds": origin, "records": len(records),
                      "dropped": dropped},
    }


def _instant(rec: TraceRecord, ts: float, pid: int, tid: int, scope: str,
             name: str) -> dict[str, Any]:
    args = {k: v for k, v in rec.to_json().items() if v is not None}
    return {"name": name, "cat": rec.kind.value, "ph": "i", "s": scope, "ts": ts, "pid": pid,
            "tid": tid, "args": args}


def write_chrome_trace(trace: Trace | Sequence[TraceRecord], path: str | Path) -> Path:
    """Write the Chrome trace-event JSON (open it at ui.perfetto.dev or chrome://tracing)."""
    out = Path(path)
    out.write_text(json.dumps(chrome_trace(trace), allow_nan=False) + "\n", encoding="utf-8")
    return out
