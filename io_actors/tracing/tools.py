"""Looking at a recorded state trace (the ``statekv trace`` command runs these):

* :func:`write_html`: one self-contained HTML timeline;
* :func:`summarize`: counts, longest parks, slowest transfers;
* ``io_actors.tracing.recorder.write_chrome_trace``: Chrome trace-event JSON for Perfetto.

TRACE is a JSON Lines file written by ``TraceRecorder.save_jsonl`` (io_actors.tracing.recorder).
The HTML page embeds the trace and its script: it opens from disk with no network and no
build step.  Nothing here imports torch.
"""

from __future__ import annotations

import collections
import html
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Final, TextIO

from io_actors.tracing.recorder import (
    RecordKind,
    Trace,
    TraceRecorder,
    park_spans,
    state_spans,
    time_bounds,
    transfer_spans,
)
from statekv.lifecycle import BlockState

STATE_COLORS: Final[dict[str, str]] = {
    "FREE": "#e5e7eb",
    "ON_GPU": "#2563eb",
    "RELEASED": "#93c5fd",
    "ON_HOST": "#16a34a",
    "SPILLING": "#f59e0b",
    "ON_DISK": "#7c3aed",
    "ONBOARDING": "#ec4899",
    "ERROR": "#dc2626",
    "PREFETCHING": "#0d9488",
    "PREFETCHED": "#a3e635",
    "FETCHING": "#c2410c",
    "LOADING": "#0891b2",
}
"""One color per block state, shared by the page's lanes and its legend (a state without
one would be drawn as an empty lane)."""

STATE_TIERS: Final[dict[str, tuple[str, ...]]] = {
    "FREE": (),
    "ON_GPU": ("gpu",),
    "RELEASED": ("gpu",),
    "ON_HOST": ("host",),
    "SPILLING": ("host", "disk"),
    "ON_DISK": ("disk",),
    "ONBOARDING": ("disk", "gpu"),
    "ERROR": ("gpu",),
    "PREFETCHING": ("disk", "host"),
    "PREFETCHED": ("disk", "host"),
    "FETCHING": ("gpu",),
    "LOADING": ("disk",),
}
"""The tiers whose memory a block in each state holds (statekv.lifecycle's table): the
page's tier filter shows a state's spans while any of its tiers is ticked."""

MAX_PARK_ROWS: Final = 6
"""Rows the page gives to parked requests (more overlapping parks share the last rows)."""

_TEMPLATE: Final = "trace_view.html"
_DATA_SLOT: Final = "/*__STATEKV_DATA__*/"
_TITLE_SLOT: Final = "__STATEKV_TITLE__"


# ---------------------------------------------------------------------- the HTML page


def view_model(trace: Trace, *, title: str) -> dict[str, Any]:
    """What the page draws, precomputed: times in ms since the first record."""
    records = trace.records
    origin, end = time_bounds(records)

    def ms(t: float) -> float:
        return round((t - origin) * 1e3, 4)

    index = {rec.seq: i for i, rec in enumerate(records)}
    states = [s.name for s in BlockState]
    state_index = {name: i for i, name in enumerate(states)}
    lanes: dict[int, dict[str, Any]] = {}

    def lane(block: int) -> dict[str, Any]:
        if block not in lanes:
            lanes[block] = {"block": block, "segs": [], "xfers": [], "marks": [],
                            "requests": set(), "slots": set()}
        return lanes[block]

    for span in state_spans(records):
        lane(span.block)["segs"].append([
            ms(span.start), ms(span.end), state_index.get(span.state, 0),
            index[span.entered_by.seq], 1 if span.open else 0,
        ])
    transfers = transfer_spans(records)
    for xfer in transfers:
        if xfer.block is None:
            continue
        lane(xfer.block)["xfers"].append([
            ms(xfer.start), ms(xfer.end), xfer.kind, xfer.outcome, xfer.slot, xfer.transfer,
            xfer.cause, xfer.request,
        ])
    marks: list[list[Any]] = []
    first_error: int | None = None
    errors = 0
    for i, rec in enumerate(records):
        if rec.block is not None and rec.block in lanes:
            if rec.request is not None:
                lanes[rec.block]["requests"].add(rec.request)
            if rec.slot is not None:
                lanes[rec.block]["slots"].add(rec.slot)
        kind = None
        if rec.kind is RecordKind.INVARIANT:
            kind = "invariant"
        elif rec.is_error:
            kind = "error"
        elif rec.kind is RecordKind.PARK:
            kind = "park"
        elif rec.kind is RecordKind.UNPARK:
            kind = "unpark"
        if kind is None:
            continue
        if kind in ("error", "invariant"):
            errors += 1
            if first_error is None:
                first_error = i
            if rec.block is not None:
                lane(rec.block)["marks"].append([ms(rec.time), kind, i])
        marks.append([ms(rec.time), kind, i, rec.block])

    # Parks packed into as few rows as do not overlap (a lane per request would push the
    # blocks off the screen when many requests park); the tooltip names the request.
    parks: list[list[Any]] = []
    row_ends: list[float] = []
    for park in park_spans(records):
        start, stop = ms(park.start), ms(park.end)
        row = next((i for i, end_ in enumerate(row_ends) if end_ < start), None)
        if row is None:
            if len(row_ends) < MAX_PARK_ROWS:
                row_ends.append(stop)
                row = len(row_ends) - 1
            else:
                row = min(range(len(row_ends)), key=row_ends.__getitem__)
        row_ends[row] = max(row_ends[row], stop)
        parks.append([start, stop, park.outcome, index[park.park.seq], park.request, row])

    lane_list = []
    for block in sorted(lanes):
        item = lanes[block]
        item["requests"] = sorted(item["requests"])
        item["slots"] = sorted(item["slots"])
        lane_list.append(item)
    return {
        "title": title,
        "start": 0.0,
        "end": ms(end),
        "dropped": trace.dropped,
        "states": states,
        "colors": STATE_COLORS,
        "tiers": STATE_TIERS,
        "records": [
            [ms(r.time), r.kind.value, r.actor, r.event, r.block, r.slot, r.request,
             r.from_state, r.to_state, r.transfer, r.detail, r.seq]
            for r in records
        ],
        "lanes": lane_list,
        "marks": marks,
        "parks": parks,
        "parkRows": len(row_ends),
        "requests": sorted({r.request for r in records if r.request is not None}),
        "transfers": len(transfers),
        "errors": errors,
        "firstError": first_error,
    }


def render_html(trace: Trace, *, title: str = "statekv trace") -> str:
    """The whole page as one string: template, styles, script and data inline."""
    page = resources.files("io_actors.tracing").joinpath(_TEMPLATE)
    template = page.read_text(encoding="utf-8")
    data = json.dumps(view_model(trace, title=title), allow_nan=False,
                      separators=(",", ":"))
    # Inside <script> nothing may read as a closing tag or a comment opener: escape every
    # "<" (JSON allows \u003c in strings, and "<" appears nowhere else in JSON).
    data = data.replace("<", "\\u003c")
    return template.replace(_TITLE_SLOT, html.escape(title)).replace(_DATA_SLOT, data)


def write_html(trace: Trace, out: str | Path, *, title: str | None = None) -> Path:
    path = Path(out)
    path.write_text(render_html(trace, title=title or f"statekv trace: {path.stem}"),
                    encoding="utf-8")
    return path


def save_failure_trace(recorder: TraceRecorder, report: str | Path) -> tuple[Path, Path]:
    """Write a failing run's trace next to its report: ``<report>.trace.jsonl`` and the
    page ``<report>.trace.html`` (for the fuzz suite and for bug reports)."""
    report_path = Path(report)
    trace = recorder.snapshot()
    base = report_path.with_name(report_path.name.removesuffix(report_path.suffix))
    jsonl = trace.save_jsonl(base.with_name(base.name + ".trace.jsonl"))
    page = write_html(trace, base.with_name(base.name + ".trace.html"),
                      title=f"statekv trace: {report_path.name}")
    return jsonl, page


# ---------------------------------------------------------------------- the summary


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def summarize(trace: Trace, *, top: int = 10, out: TextIO | None = None) -> None:
    """Counts by transition and message, the longest parks, the slowest transfers, errors."""
    stream = out if out is not None else sys.stdout
    records = trace.records
    origin, end = time_bounds(records)

    def at(t: float) -> str:
        return f"+{(t - origin) * 1e3:.3f} ms"

    def p(*args: object) -> None:
        print(*args, file=stream)

    p(f"records: {len(records)}"
      + (f" ({trace.dropped} older ones overwritten)" if trace.dropped else "")
      + f", spanning {_ms(end - origin)}")
    if not records:
        return
    blocks = {r.block for r in records if r.block is not None}
    slots = {r.slot for r in records if r.slot is not None}
    requests = {r.request for r in records if r.request is not None}
    p(f"blocks: {len(blocks)}, slots: {len(slots)}, requests: {len(requests)}")

    transitions = collections.Counter(
        (r.from_state, r.event, r.to_state) for r in records
        if r.kind is RecordKind.TRANSITION
    )
    p("\ntransitions by (from, event, to)")
    for (src, event, dst), count in sorted(transitions.items(), key=lambda kv: (-kv[1], kv[0])):
        p(f"  {count:>8}  {src} --{event}--> {dst}")
    messages = collections.Counter(
        (r.kind.value, r.actor, r.event) for r in records
        if r.kind is not RecordKind.TRANSITION
    )
    if messages:
        p("\nmessages by (kind, actor, name)")
        for (kind, actor, event), count in sorted(messages.items(),
                                                  key=lambda kv: (-kv[1], kv[0])):
            p(f"  {count:>8}  {kind:<10} {actor:<10} {event}")

    parks = sorted(park_spans(records), key=lambda s: -(s.end - s.start))
    p(f"\nlongest parks ({len(parks)} in all)")
    if not parks:
        p("  none")
    for park in parks[:top]:
        p(f"  {park.request:<20} {_ms(park.end - park.start):>14}  at {at(park.start):<16}"
          f" {park.outcome}" + (f" ({park.park.detail})" if park.park.detail else ""))

    xfers = sorted(transfer_spans(records), key=lambda s: -(s.end - s.start))
    p(f"\nslowest transfers ({len(xfers)} in all: "
      f"{sum(x.kind == 'write' for x in xfers)} writes, "
      f"{sum(x.kind == 'read' for x in xfers)} reads)")
    if not xfers:
        p("  none")
    for xfer in xfers[:top]:
        where = f"block {xfer.block} {'->' if xfer.kind == 'write' else '<-'} slot {xfer.slot}"
        outcome = xfer.outcome + (f": {xfer.cause}" if xfer.cause else "")
        p(f"  {xfer.kind:<5} #{xfer.transfer:<6} {_ms(xfer.end - xfer.start):>14}"
          f"  at {at(xfer.start):<16} {where:<24} {outcome}")

    errors = [r for r in records if r.is_error]
    p(f"\nerrors: {len(errors)}")
    for rec in errors[:top]:
        who = ", ".join(f"{k} {v}" for k, v in (("block", rec.block), ("slot", rec.slot),
                                                ("request", rec.request)) if v is not None)
        p(f"  at {at(rec.time):<16} {rec.kind.value:<10} {rec.event}"
          + (f" ({who})" if who else "") + (f": {rec.detail}" if rec.detail else ""))
    open_states = [s for s in state_spans(records) if s.open and s.state in
                   ("SPILLING", "ONBOARDING", "ERROR")]
    if open_states:
        p("\nblocks still in flight or failed at the end: "
          + ", ".join(f"{s.block} ({s.state})" for s in open_states[:top])
          + (" ..." if len(open_states) > top else ""))
