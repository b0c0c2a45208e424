"""Running a machine under a profile, counting steps, and reporting a failure.

A failing run leaves two files in the failure directory, named after the machine and the
time:

* ``<name>.txt``: the shrunk steps exactly as Hypothesis prints them (paste them into a test
  to replay), the error and its traceback;
* ``<name>.trace.jsonl``: the state trace (every block transition and, in the system
  machine, every command and completion) of the last replay of the shrunk example.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import attrs
from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis.reporting import default as default_reporter
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from fuzz.steps import Counts
from fuzz.tracefile import write_trace
from io_actors.tracing.recorder import TraceRecorder


class Traced(Protocol):
    trace: TraceRecorder | None


@attrs.frozen(kw_only=True)
class RunResult:
    """What one run of one machine did."""

    machine: str
    examples: int
    """State-machine examples run (each from a fresh machine, shrinking replays included)."""
    steps: int
    """Rule steps run over all examples."""
    operations: int
    """Calls on the core (API calls and completions) checked against the model."""
    seconds: float

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        ops = self.operations / self.seconds if self.seconds > 0 else 0.0
        return (f"{self.machine}: {self.examples:,} examples, {self.steps:,} steps in "
                f"{self.seconds:.1f} s = {self.steps_per_second:,.0f} steps/s "
                f"({self.operations:,} core operations = {ops:,.0f}/s)")


def run_machine(
    machine: type[RuleBasedStateMachine],
    config: settings,
    *,
    failure_dir: Path,
    seed: int | None = None,
    echo: Callable[[str], None] = default_reporter,
    progress_every: float | None = None,
) -> RunResult:
    """Run `machine` under `config`; on failure write the report and trace, then re-raise.

    With `progress_every`, a line of examples and steps so far is echoed every that many
    seconds: a run cut off by a time limit (the GPU machine's calls are) then still says how
    far it got, and a slow run can be told from a hung one."""
    latest: list[RuleBasedStateMachine] = []

    def factory() -> RuleBasedStateMachine:
        instance = machine()
        latest[:] = [instance]
        return instance

    if seed is not None:
        factory = hypothesis_seed(seed)(factory)
    lines: list[str] = []

    def report(value: object) -> None:
        text = str(value)
        lines.append(text)
        echo(text)

    steps0, examples0, operations0 = Counts.steps, Counts.examples, Counts.operations
    start = time.perf_counter()
    done = threading.Event()

    def progress(every: float) -> None:
        while not done.wait(every):
            echo(f"  {machine.__name__} so far: {Counts.examples - examples0:,} examples, "
                 f"{Counts.steps - steps0:,} steps in {time.perf_counter() - start:.0f} s")

    reporter = None
    if progress_every is not None:
        reporter = threading.Thread(target=progress, args=(progress_every,),
                                    name="fuzz-progress", daemon=True)
        reporter.start()
    try:
        with with_reporter(report):
            # Documented to take any factory returning a machine; typed as a class.
            run_state_machine_as_test(cast(type[RuleBasedStateMachine], factory),
                                      settings=config)
    except BaseException as exc:
        write_failure(failure_dir, machine.__name__, lines, exc,
                      latest[0] if latest else None, seed)
        raise
    finally:
        done.set()
        # A line the reporter had begun when the run ended is echoed before this returns,
        # never after (the echo may be the caller's output, read once the run is over).
        if reporter is not None:
            reporter.join()
    return RunResult(
        machine=machine.__name__, examples=Counts.examples - examples0,
        steps=Counts.steps - steps0, operations=Counts.operations - operations0,
        seconds=time.perf_counter() - start,
    )


def write_failure(
    failure_dir: Path,
    name: str,
    lines: list[str],
    exc: BaseException,
    machine: object,
    seed: int | None,
) -> Path:
    """Write the failure report (and the trace of `machine`, when it kept one)."""
    failure_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6:06d}"
    report = failure_dir / f"{stem}.txt"
    notes = getattr(exc, "__notes__", [])
    text = [f"# {name} failed" + (f" (seed {seed})" if seed is not None else ""), ""]
    text += ["## Shrunk steps, as Hypothesis printed them", "", *lines, ""]
    if notes:
        text += ["## Notes", "", *map(str, notes), ""]
    text += ["## Error", "", *traceback.format_exception(exc)]
    report.write_text("\n".join(text))
    trace = getattr(machine, "trace", None)
    if isinstance(trace, TraceRecorder):
        path = write_trace(trace, failure_dir / f"{stem}.trace.jsonl",
                           f"{type(exc).__name__}: {exc}")
        default_reporter(f"state trace of the shrunk example: {path}")
    default_reporter(f"failure report: {report}")
    return report
