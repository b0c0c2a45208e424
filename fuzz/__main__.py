"""``python -m fuzz``: run the fuzz machines under a profile and print steps/s and examples.

Examples::

    python -m fuzz --profile ci                    # what make test runs, about a minute
    python -m fuzz --profile soak --minutes 120    # make fuzz: rounds with new seeds
    python -m fuzz --profile gpu                   # make fuzz-gpu, on the GPU machine
    python -m fuzz --profile soak --machines system --seed 7 --minutes 5
    python -m fuzz --profile soak --machines kill9 --minutes 0  # one round of 200 kill -9

Exit status 0 when every run passed, 1 at the first failure (its report and state trace are
written to --failures and named in the output).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine

from fuzz.core_machine import CoreVsSpec
from fuzz.crash import KillReport, kill_loop
from fuzz.profiles import FAILURE_DIR, PROFILES, Profile
from fuzz.runner import RunResult, run_machine
from fuzz.steps import fuzz_rule
from fuzz.thread_soak import SoakResult, soak_round

MACHINES = ("core", "system", "threads", "kill9")
PROGRESS_EVERY = 60.0
"""Seconds between the progress lines of a machine's run."""


class _Floor(RuleBasedStateMachine):
    """A machine that does nothing: Hypothesis' own cost per step on this machine now."""

    @fuzz_rule()
    def step(self) -> None:
        return None


def calibrate() -> RunResult:
    """Steps/s of a machine whose rule does nothing: the ceiling any machine can reach on
    this host at this moment (shared hosts vary a lot)."""
    return run_machine(
        _Floor,
        settings(max_examples=100, stateful_step_count=50, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck), phases=[Phase.generate]),
        failure_dir=FAILURE_DIR,
    )


class Totals:
    def __init__(self) -> None:
        self.examples: dict[str, int] = dict.fromkeys(MACHINES, 0)
        self.steps: dict[str, int] = dict.fromkeys(MACHINES, 0)
        self.operations: dict[str, int] = dict.fromkeys(MACHINES, 0)
        self.seconds: dict[str, float] = dict.fromkeys(MACHINES, 0.0)
        self.runs = 0
        self.kill9: dict[str, int] = {}

    def add_machine(self, key: str, result: RunResult) -> None:
        self.examples[key] += result.examples
        self.steps[key] += result.steps
        self.operations[key] += result.operations
        self.seconds[key] += result.seconds

    def add_soak(self, result: SoakResult) -> None:
        self.examples["threads"] += 1
        self.steps["threads"] += result.operations
        self.operations["threads"] += result.operations
        self.seconds["threads"] += result.seconds

    def add_kills(self, report: KillReport, seconds: float) -> None:
        for name, value in report.totals().items():
            self.kill9[name] = self.kill9.get(name, 0) + value
        self.seconds["kill9"] += seconds

    def lines(self) -> list[str]:
        out = []
        for key in MACHINES:
            if key == "kill9":
                if self.kill9:
                    out.append("  kill9    " + ", ".join(f"{v:,} {k.replace('_', ' ')}"
                                                        for k, v in self.kill9.items())
                               + f" in {self.seconds['kill9']:.0f} s")
                continue
            if not self.seconds[key]:
                continue
            unit = "rounds" if key == "threads" else "examples"
            what = "operations" if key == "threads" else "steps"
            rate = self.steps[key] / self.seconds[key]
            line = (f"  {key:8s} {self.examples[key]:>9,} {unit}, {self.steps[key]:>11,} "
                    f"{what} in {self.seconds[key]:>8.0f} s = {rate:>7,.0f} {what}/s")
            if key != "threads":
                line += (f", {self.operations[key]:,} core operations "
                         f"({self.operations[key] / self.seconds[key]:,.0f}/s)")
            out.append(line)
        return out


def run_once(profile: Profile, machines: list[str], seed: int, totals: Totals,
             failures: Path, echo: Callable[[str], None]) -> None:
    if "core" in machines:
        result = run_machine(CoreVsSpec, profile.core, failure_dir=failures, seed=seed,
                             progress_every=PROGRESS_EVERY)
        echo(result.line())
        totals.add_machine("core", result)
    if "system" in machines:
        result = run_machine(profile.system_machine, profile.system, failure_dir=failures,
                             seed=seed, progress_every=PROGRESS_EVERY)
        echo(result.line())
        totals.add_machine("system", result)
    if "threads" in machines:
        for i in range(profile.thread_rounds):
            soak = soak_round(seed * 1000 + i, profile.thread_seconds, failure_dir=failures,
                              device=profile.device, backend=profile.backend, echo=echo)
            echo(soak.line())
            totals.add_soak(soak)
    if "kill9" in machines and profile.kill9:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="statekv-kill9-") as tmp:
            # Every other child fails some writes: faults and restarts together.
            report = kill_loop(Path(tmp) / "cache", kills=profile.kill9, seed=seed,
                               write_faults=True)
        totals.add_kills(report, time.monotonic() - started)
        found = report.totals()
        echo(f"kill9: {found}")
        if (found["wrong_bytes"] or found["unknown_keys"] or found["lost"]
                or found["deadline_errors"] or found["stale_index_entries"]):
            failures.mkdir(parents=True, exist_ok=True)
            (failures / f"kill9-seed{seed}.txt").write_text(repr(report.checks[-1]) + "\n")
            raise AssertionError(f"kill -9 loop (seed {seed}) found {found}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    parser.add_argument("--minutes", type=float, default=None,
                        help="time budget of a repeating profile (soak: default 120)")
    parser.add_argument("--machines", default=",".join(MACHINES),
                        help=f"comma-separated subset of {','.join(MACHINES)}")
    parser.add_argument("--seed", type=int, default=None,
                        help="first seed (default: random); rounds use seed, seed+1, ...")
    parser.add_argument("--failures", type=Path, default=FAILURE_DIR,
                        help="directory for failure reports and state traces")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    machines = [m.strip() for m in args.machines.split(",") if m.strip()]
    unknown = sorted(set(machines) - set(MACHINES))
    if unknown:
        parser.error(f"unknown machines {unknown} (known: {', '.join(MACHINES)})")
    if profile.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"the {profile.name} profile needs CUDA, and torch sees no GPU here")
    # Injected faults make the actors log a warning per failed transfer: expected here.
    logging.getLogger("io_actors").setLevel(logging.ERROR)

    def echo(text: str) -> None:
        print(text, flush=True)

    floor = calibrate()
    echo(f"profile {profile.name}: machines {', '.join(machines)}; Hypothesis' own ceiling "
         f"on this host now: {floor.steps_per_second:,.0f} steps/s (a machine doing nothing)")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    minutes = args.minutes if args.minutes is not None else (120.0 if profile.repeat else 0.0)
    totals = Totals()
    start = time.monotonic()
    try:
        while True:
            echo(f"--- round {totals.runs + 1}, seed {seed}")
            run_once(profile, machines, seed, totals, args.failures, echo)
            totals.runs += 1
            elapsed = (time.monotonic() - start) / 60
            echo(f"after {totals.runs} rounds, {elapsed:.1f} min, 0 failures:")
            for line in totals.lines():
                echo(line)
            if not profile.repeat or elapsed >= minutes:
                return 0
            seed += 1
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            echo("interrupted")
            return 130
        echo(f"FAILED in round {totals.runs + 1} (seed {seed}): {type(exc).__name__}: {exc}")
        echo(f"reports and state traces are in {args.failures}/")
        return 1


if __name__ == "__main__":
    sys.exit(main())
