"""State-trace recording: the ring, what the actors record, JSON Lines, the Perfetto export,
and the `statekv trace` command."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from io_actors.embed import BlockingCache
from io_actors.storage.faults import FaultPlan, FaultRule, FaultyStore
from io_actors.storage.posix import PosixSlotStore
from io_actors.tracing.recorder import (
    RecordKind,
    Trace,
    TraceFormatError,
    TraceRecord,
    TraceRecorder,
    chrome_trace,
    load_trace,
    transfer_spans,
)
from io_actors.tracing.tools import save_failure_trace, view_model
from serve.cli import main as cli_main
from statekv import CacheConfig, KVCacheManager, RingTrace
from statekv.errors import ConfigError, InvariantViolation, UsageError
from statekv.ids import BlockId, RequestId
from statekv.lifecycle import TRANSITIONS, BlockEvent, BlockState
from tests.io_helpers import serve, small_config, wait_quiet, wait_ready

PROMPT = list(range(13))  # three full blocks of 4, then one token
ODD_REQUEST = "</script><b>odd"
"""A request id that would break a page that pasted ids into HTML or a script."""


def record_scenario(directory: Path, *, fail_read: int | None = 2,
                    synchronous_io: bool = False) -> TraceRecorder:
    """Spill a prompt to disk, read it back (the `fail_read`-th read fails), serve more."""
    recorder = TraceRecorder(capacity=4096)
    config = small_config(directory)
    rank_dir = config.rank_directory()
    assert rank_dir is not None
    plan = (FaultPlan(rules=(FaultRule(op="read", fault="eio", nth=fail_read),))
            if fail_read else FaultPlan())
    store = FaultyStore(PosixSlotStore(rank_dir, config.core_config()), plan)
    try:
        with BlockingCache(config, store=store, recorder=recorder,
                           synchronous_io=synchronous_io) as cache:
            serve(cache, "first", PROMPT)
            wait_quiet(cache)
            for i in range(6):
                serve(cache, f"churn{i}", [10_000 + 100 * i + t for t in range(17)])
                wait_quiet(cache)
            cache.add_request("again", PROMPT)
            wait_ready(cache, "again")
            cache.release("again")
            serve(cache, ODD_REQUEST, [7, 7, 7, 7, 8])
            wait_quiet(cache)
    finally:
        store.close()
    return recorder


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return record_scenario(tmp_path_factory.mktemp("trace")).snapshot()


# ---------------------------------------------------------------------- the ring


def test_ring_keeps_the_last_capacity_records_oldest_first() -> None:
    recorder = TraceRecorder(capacity=5)
    for i in range(12):
        recorder.record(float(i), BlockId(i), None, BlockState.FREE, BlockState.ON_GPU,
                        BlockEvent.ALLOCATED)
    records = recorder.records()
    assert len(recorder) == 5 and recorder.recorded == 12
    assert [r.seq for r in records] == [7, 8, 9, 10, 11]
    assert [r.block for r in records] == [7, 8, 9, 10, 11]
    assert recorder.snapshot().dropped == 7
    recorder.clear()
    assert recorder.records() == [] and recorder.recorded == 0


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "8"])
def test_bad_capacity_is_a_config_error(capacity: Any) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        TraceRecorder(capacity=capacity)


def test_core_transitions_follow_the_table_and_chain_per_block() -> None:
    recorder = TraceRecorder()
    ring = RingTrace(1000)
    for sink in (recorder, ring):
        cache = KVCacheManager(CacheConfig(block_size=2, gpu_blocks=4, host_blocks=2),
                               trace=sink)
        for r in range(6):
            rid = f"r{r}"
            tokens = [r * 10 + t for t in range(5)]
            cache.add_request(rid, tokens, now=float(r))
            cache.allocate_nowait(rid, 5, now=float(r))
            cache.commit(rid, 5, now=float(r))
            cache.release(rid, now=float(r))
    records = recorder.records()
    # The recorder sees exactly what the core's own RingTrace sees.
    assert [(r.time, r.block, r.request, r.from_state, r.to_state, r.event) for r in records] == [
        (t.time, t.block, t.request, t.from_state.name, t.to_state.name, t.event.name)
        for t in ring.records()
    ]
    state: dict[int, str] = {}
    for rec in records:
        assert rec.kind is RecordKind.TRANSITION and rec.actor == "core"
        expected = TRANSITIONS[(BlockState[rec.from_state or ""], BlockEvent[rec.event])]
        assert rec.to_state == expected.name
        assert rec.block is not None
        assert state.get(rec.block, "FREE") == rec.from_state
        state[rec.block] = rec.to_state
    assert {r.event for r in records} >= {"ALLOCATED", "RELEASED", "OFFLOADED", "DROPPED"}


# ---------------------------------------------------------------------- what the actors record


def test_spill_and_onboard_record_commands_completions_and_slots(recorded: Trace) -> None:
    records = recorded.records
    times = [r.time for r in records]
    assert times == sorted(times), "one clock: records are in time order"
    writes = [r for r in records if r.event == "WriteSlot"]
    reads = [r for r in records if r.event == "ReadSlot"]
    assert writes and len(reads) == 3
    assert all(r.kind is RecordKind.COMMAND and r.actor == "writer" for r in writes)
    # Every transfer's completion names the block and slot of its command.
    by_transfer = {r.transfer: r for r in writes + reads}
    completions = [r for r in records if r.kind is RecordKind.COMPLETION]
    assert len(completions) == len(by_transfer)
    for done in completions:
        command = by_transfer[done.transfer]
        assert (done.block, done.slot) == (command.block, command.slot)
        assert done.actor == command.actor
    # A transition into or out of a disk state carries the slot of its transfer.
    slot_of_read = {r.block: r.slot for r in reads}
    started = [r for r in records if r.event == "READ_STARTED"]
    assert [(r.block, r.slot) for r in started] == [(b, slot_of_read[b]) for b in
                                                    (r.block for r in started)]
    assert all(r.slot is not None for r in records
               if r.kind is RecordKind.TRANSITION and r.event.startswith("SPILL"))
    # Commands name the request whose call caused them.
    assert {r.request for r in reads} == {"again"}


def test_a_request_waiting_on_disk_is_parked_then_unparked(recorded: Trace) -> None:
    records = recorded.records
    parks = [r for r in records if r.kind is RecordKind.PARK]
    unparks = [r for r in records if r.kind is RecordKind.UNPARK]
    assert [r.request for r in parks] == ["again"]
    assert [r.request for r in unparks] == ["again"]
    park_at, unpark_at = records.index(parks[0]), records.index(unparks[0])
    read_done = [i for i, r in enumerate(records)
                 if r.event in ("READ_LANDED", "READ_FAILED")]
    failed_at = next(i for i, r in enumerate(records) if r.event == "READ_FAILED")
    # Parked before any read landed; the failed read rewinds the request, which may then
    # run (recomputing what it lost) without waiting for its other reads.
    assert park_at < min(read_done) and failed_at < unpark_at


def test_a_failed_read_is_an_error_with_its_cause(recorded: Trace) -> None:
    failed = [r for r in recorded.records if r.event == "SlotReadFailed"]
    assert len(failed) == 1 and failed[0].is_error
    assert failed[0].detail and "Input/output error (injected)" in failed[0].detail
    error_state = [r for r in recorded.records if r.to_state == "ERROR"]
    assert [r.block for r in error_state] == [failed[0].block]
    spans = [s for s in transfer_spans(recorded.records) if s.outcome == "failed"]
    assert [s.transfer for s in spans] == [failed[0].transfer]


def test_synchronous_io_records_the_wait_as_a_park(tmp_path: Path) -> None:
    records = record_scenario(tmp_path, fail_read=None, synchronous_io=True).records()
    kinds = [(r.kind, r.request) for r in records
             if r.kind in (RecordKind.PARK, RecordKind.UNPARK)]
    assert kinds == [(RecordKind.PARK, "again"), (RecordKind.UNPARK, "again")]
    landed = [i for i, r in enumerate(records) if r.event == "SlotRead"]
    assert len(landed) == 3
    # Without a failure the request waits for every read.
    unpark_at = next(i for i, r in enumerate(records) if r.kind is RecordKind.UNPARK)
    assert max(landed) < unpark_at


def test_invariant_failures_are_recorded_then_raised(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = TraceRecorder()

    def broken(_self: KVCacheManager) -> None:
        raise InvariantViolation("planted: page 3 owned twice")

    with BlockingCache(small_config(tmp_path), recorder=recorder) as cache:
        serve(cache, "a", PROMPT)
        monkeypatch.setattr(KVCacheManager, "check_invariants", broken)
        with pytest.raises(InvariantViolation):
            cache.check_invariants()
        monkeypatch.undo()
    failures = [r for r in recorder.records() if r.kind is RecordKind.INVARIANT]
    assert [r.detail for r in failures] == ["planted: page 3 owned twice"]
    assert failures[0].is_error and failures[0].actor == "scheduler"


def test_program_errors_take_the_latest_time_or_the_clock() -> None:
    recorder = TraceRecorder()
    recorder.record(5.0, BlockId(1), RequestId("r"), BlockState.FREE, BlockState.ON_GPU,
                    BlockEvent.ALLOCATED)
    recorder.error("bytes differ", block=1, request="r")
    clocked = TraceRecorder(clock=lambda: 42.0)
    clocked.invariant_failed("tree points at a freed slot")
    assert recorder.records()[-1].time == 5.0
    assert clocked.records()[0].time == 42.0


def test_a_recorder_passed_as_trace_records_messages_too(tmp_path: Path) -> None:
    recorder = TraceRecorder()
    with BlockingCache(small_config(tmp_path), trace=recorder) as cache:
        serve(cache, "a", PROMPT)
        for i in range(3):
            serve(cache, f"b{i}", [100 * i + 50 + t for t in range(13)])
    kinds = {r.kind for r in recorder.records()}
    assert {RecordKind.TRANSITION, RecordKind.COMMAND} <= kinds


def test_trace_and_recorder_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="trace"):
        BlockingCache(small_config(tmp_path), trace=RingTrace(4), recorder=TraceRecorder())


# ---------------------------------------------------------------------- JSON Lines


def test_jsonl_round_trip_keeps_every_field(recorded: Trace, tmp_path: Path) -> None:
    path = recorded.save_jsonl(tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["format"] == "statekv-trace"
    assert len(lines) == len(recorded.records) + 1
    assert load_trace(path) == recorded


@pytest.mark.parametrize(("content", "message"), [
    ("", "empty file"),
    ('{"format": "other"}\n', "not a statekv-trace file"),
    ('{"format": "statekv-trace", "version": 99}\n', "version 99"),
    ('{"format": "statekv-trace", "version": 1}\n{"seq": 0\n', ":2: not JSON"),
    ('{"format": "statekv-trace", "version": 1}\n'
     '{"seq": 0, "time": 1, "kind": "teleport", "actor": "a", "event": "e"}\n',
     ":2: unknown kind"),
    ('{"format": "statekv-trace", "version": 1}\n'
     '{"seq": 0, "time": 1, "kind": "error", "actor": "a", "event": "e", "block": "7"}\n',
     ":2: block must be an integer"),
])
def test_malformed_trace_files_name_the_line(tmp_path: Path, content: str,
                                            message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


# ---------------------------------------------------------------------- Chrome trace events

PHASES = {"X", "i", "b", "e", "M"}


def check_trace_event_format(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The Trace Event Format's required fields, and what Perfetto needs on top."""
    assert set(doc) >= {"traceEvents"}
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    json.dumps(doc, allow_nan=False)
    opened: dict[tuple[str, str, str], int] = defaultdict(int)
    spans: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        assert ev.get("ph") in PHASES, ev
        assert isinstance(ev.get("pid"), int) and isinstance(ev.get("tid"), int), ev
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name", "process_sort_index",
                                  "thread_sort_index"), ev
            assert isinstance(ev.get("args"), dict), ev
            continue
        assert isinstance(ev.get("ts"), int | float) and ev["ts"] >= 0, ev
        if "args" in ev:
            assert isinstance(ev["args"], dict), ev
        if ev["ph"] == "X":
            assert isinstance(ev.get("dur"), int | float) and ev["dur"] >= 0, ev
            spans[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ev["ph"] == "i":
            assert ev.get("s", "t") in ("g", "p", "t"), ev
        else:
            assert isinstance(ev.get("cat"), str) and "id" in ev, ev
            key = (ev["cat"], ev["name"], str(ev["id"]))
            opened[key] += 1 if ev["ph"] == "b" else -1
            assert opened[key] >= 0, f"async end before its begin: {ev}"
    assert all(v == 0 for v in opened.values()), "every async begin has its end"
    # Complete events on one track nest or follow each other, never overlap partly.
    for track, intervals in spans.items():
        intervals.sort()
        for (s1, e1), (s2, e2) in itertools.pairwise(intervals):
            assert s2 >= e1 - 1e-6 or e2 <= e1 + 1e-6, (track, (s1, e1), (s2, e2))
    return list(events)


def test_perfetto_export_has_the_required_fields_and_tracks(recorded: Trace) -> None:
    doc = chrome_trace(recorded)
    events = check_trace_event_format(doc)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert {n for _pid, n in names} == {"statekv blocks", "statekv slots", "statekv actors"}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"scheduler", "writer", "reader", "copy"} <= threads
    blocks = {r.block for r in recorded.records if r.kind is RecordKind.TRANSITION}
    assert {f"block {b}" for b in blocks} <= threads
    states = [e for e in events if e["ph"] == "X" and e["cat"] == "state"]
    non_free = [r for r in recorded.records
                if r.kind is RecordKind.TRANSITION and r.to_state != "FREE"]
    assert len(states) == len(non_free)
    transfers = [e for e in events if e["ph"] == "X" and e["cat"] == "transfer"]
    assert len(transfers) == len(transfer_spans(recorded.records))
    instants = {e["cat"] for e in events if e["ph"] == "i"}
    assert {"park", "unpark", "completion", "command"} <= instants
    errors = [e for e in events if e["ph"] == "i" and "SlotReadFailed" in e["name"]]
    assert errors


def test_checker_rejects_what_perfetto_would_misdraw() -> None:
    good = {"name": "ON_GPU", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    check_trace_event_format({"traceEvents": [good]})
    for bad in ({**good, "dur": -1}, {k: v for k, v in good.items() if k != "ts"},
                {**good, "ph": "Z"}):
        with pytest.raises(AssertionError):
            check_trace_event_format({"traceEvents": [bad]})
    with pytest.raises(AssertionError):
        check_trace_event_format({"traceEvents": [good, {**good, "ts": 5}]})


def test_invariant_failures_are_global_instants() -> None:
    recorder = TraceRecorder()
    recorder.record(1.0, BlockId(0), None, BlockState.FREE, BlockState.ON_GPU,
                    BlockEvent.ALLOCATED)
    recorder.invariant_failed("planted")
    events = check_trace_event_format(chrome_trace(recorder.snapshot()))
    assert [e["s"] for e in events if e["ph"] == "i"] == ["g"]


# ---------------------------------------------------------------------- the command


def test_summary_counts_transitions_parks_and_slow_transfers(
    recorded: Trace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = recorded.save_jsonl(tmp_path / "t.jsonl")
    assert cli_main(["trace", "summary", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    allocated = sum(r.event == "ALLOCATED" for r in recorded.records)
    assert f"{allocated:>8}  FREE --ALLOCATED--> ON_GPU" in out
    assert "longest parks (1 in all)" in out and "again" in out
    assert "slowest transfers" in out and "failed: " in out
    assert "errors: 2" in out  # the failed read and the block entering ERROR


def test_view_writes_one_self_contained_page(recorded: Trace, tmp_path: Path) -> None:
    path = recorded.save_jsonl(tmp_path / "t.jsonl")
    assert cli_main(["trace", "view", str(path)]) == 0
    page = (tmp_path / "t.html").read_text()
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert "http://" not in page and "https://" not in page
    assert ODD_REQUEST not in page  # escaped wherever it appears
    model = view_model(recorded, title="t")
    assert model["firstError"] is not None
    assert model["records"][model["firstError"]][3] in ("SlotReadFailed", "READ_FAILED")


def test_perfetto_command_writes_valid_trace_events(recorded: Trace, tmp_path: Path) -> None:
    path = recorded.save_jsonl(tmp_path / "t.jsonl")
    assert cli_main(["trace", "perfetto", str(path), "-o", str(tmp_path / "p.json")]) == 0
    check_trace_event_format(json.loads((tmp_path / "p.json").read_text()))


def test_unreadable_trace_is_reported_not_raised(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["trace", "summary", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_failure_trace_lands_next_to_the_report(tmp_path: Path) -> None:
    recorder = TraceRecorder()
    recorder.record(0.0, BlockId(0), None, BlockState.FREE, BlockState.ON_GPU,
                    BlockEvent.ALLOCATED)
    recorder.invariant_failed("shrunk example")
    jsonl, page = save_failure_trace(recorder, tmp_path / "failure-17.txt")
    assert jsonl == tmp_path / "failure-17.trace.jsonl"
    assert page == tmp_path / "failure-17.trace.html"
    assert [r.kind for r in load_trace(jsonl).records] == [RecordKind.TRANSITION,
                                                           RecordKind.INVARIANT]
    assert "shrunk example" in page.read_text()


def test_records_are_plain_data() -> None:
    rec = TraceRecord(seq=0, time=1.0, kind=RecordKind.ERROR, actor="a", event="error")
    assert rec.is_error and rec.to_json()["kind"] == "error"
