"""A machine's run reports how far it got while it runs (a run cut off by a time limit on the
GPU machine still says how many examples it had run)."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine

from fuzz.runner import run_machine
from fuzz.steps import fuzz_rule


class Slow(RuleBasedStateMachine):
    @fuzz_rule()
    def step(self) -> None:
        time.sleep(0.002)


def test_progress_lines_count_examples_and_steps_while_the_machine_runs(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_machine(
        Slow, settings(max_examples=10, stateful_step_count=10, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck), phases=[Phase.generate]),
        failure_dir=tmp_path, echo=lines.append, progress_every=0.02)
    progress = [line for line in lines if line.startswith("  Slow so far:")]
    assert progress, lines
    assert all("examples" in line and "steps in" in line for line in progress)
    assert result.steps > 0
    count = len(lines)
    time.sleep(0.1)
    assert len(lines) == count, "progress went on after the run returned"


def test_a_progress_line_being_echoed_when_the_run_ends_lands_before_it_returns(
        tmp_path: Path) -> None:
    # The reporter spends most of its time inside a slow echo, so the run ends while one is
    # under way: that line must land before run_machine returns, not after.
    lines: list[str] = []

    def slow_echo(line: str) -> None:
        if line.startswith("  Slow so far:"):
            time.sleep(0.05)
        lines.append(line)

    run_machine(
        Slow, settings(max_examples=5, stateful_step_count=10, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck), phases=[Phase.generate]),
        failure_dir=tmp_path, echo=slow_echo, progress_every=0.001)
    count = len(lines)
    time.sleep(0.2)
    assert len(lines) == count, "progress went on after the run returned"
