"""The state trace each fuzz example records, and how a failing one is written out.

Every machine records into an :class:`io_actors.tracing.recorder.TraceRecorder`: the core's
transitions and, in the system machines, the scheduler's messages (commands, completions,
parks) on one time axis.  The runner writes the trace of the failing example's last replay
(the shrunk one) as JSON Lines next to the failure report; ``python -m io_actors.tracing.recorder``
style tools and the trace viewer read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from io_actors.tracing.recorder import TraceRecorder

TRACE_CAPACITY: Final = 1 << 15
"""Records kept per example: more than the longest example of any profile produces."""


def new_sink() -> TraceRecorder:
    return TraceRecorder(TRACE_CAPACITY)


def write_trace(sink: TraceRecorder, path: Path, failure: str) -> Path:
    """Write `sink` as JSON Lines to `path`, ending with an error record naming `failure`."""
    sink.error(failure, actor="fuzz")
    return sink.save_jsonl(path)
