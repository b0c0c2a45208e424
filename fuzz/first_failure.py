"""How soon each planted bug is found: steps to the first failure, gated machine and soak.

For every bug of :data:`fuzz.planted.PLANTED`, with the bug planted:

* **gated**: the system machine (:class:`fuzz.system_machine.SystemMachine`) with the CI
  profile's budget (examples x steps per example), generation only -- the first failing
  example ends the run, nothing is shrunk -- from each of the given seeds; it reports the
  rule steps run until that failure (all examples counted), or that the budget ran out;
* **soak**: real-thread soak rounds (:class:`fuzz.thread_soak.ThreadSoak`) of the CI
  profile's length, seeds ``seed * 1000 + i`` as ``python -m fuzz`` uses them; it reports
  the serving operations until the first failure, or that every round passed.

Each measurement runs in a child process: a planted hang leaves threads that cannot be
stopped.  ``python -m fuzz.first_failure`` prints a Markdown table (fuzz/README.md quotes
one); ``--bugs`` and ``--seeds`` narrow it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from fuzz.planted import PLANTED
from fuzz.profiles import PROFILES
from fuzz.steps import Counts
from fuzz.system_machine import SystemMachine
from fuzz.thread_soak import ThreadSoak

CHILD_TIMEOUT = 600
"""Seconds one measurement may take (a planted hang is reported by the harness in 10 s)."""


def gated(name: str, seed: int) -> dict[str, object]:
    """Steps of the system machine until the planted bug first fails a check."""
    ci = PROFILES["ci"].system
    config = settings(
        max_examples=ci.max_examples, stateful_step_count=ci.stateful_step_count,
        deadline=None, database=None, phases=[Phase.generate], report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )

    @hypothesis_seed(seed)
    def factory() -> RuleBasedStateMachine:
        return SystemMachine()

    with PLANTED[name].plant():
        try:
            run_state_machine_as_test(factory, settings=config)  # type: ignore[arg-type]
        except Exception as exc:
            return {"found": True, "steps": Counts.steps, "examples": Counts.examples,
                    "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    return {"found": False, "steps": Counts.steps, "examples": Counts.examples}


def soak(name: str, seed: int) -> dict[str, object]:
    """Operations of the thread soak until the planted bug first fails a check."""
    profile = PROFILES["ci"]
    operations = 0
    with PLANTED[name].plant():
        for i in range(profile.thread_rounds):
            round_ = ThreadSoak(seed * 1000 + i)
            try:
                round_.run(profile.thread_seconds)
            except Exception as exc:
                return {"found": True, "steps": operations + round_.operations,
                        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            finally:
                round_.driver.clean_up()
            operations += round_.operations
    return {"found": False, "steps": operations}


def measure(name: str, harness: str, seed: int) -> dict[str, object]:
    """One measurement, in a child process."""
    start = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-m", "fuzz.first_failure", "--child", name, harness, str(seed)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"found": None, "error": child.stderr[-500:]}
    result: dict[str, object] = json.loads(lines[-1])
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def cell(results: list[dict[str, object]]) -> str:
    found = [r for r in results if r.get("found")]
    steps = ", ".join(str(r["steps"]) if r.get("found") else "-" for r in results)
    return f"{len(found)}/{len(results)} ({steps})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.first_failure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bugs", default=",".join(sorted(PLANTED)),
                        help="comma-separated planted bugs (default: all)")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    parser.add_argument("--harnesses", default="gated,soak")
    parser.add_argument("--json", type=Path, default=None, help="also write every result")
    parser.add_argument("--child", nargs=3, metavar=("BUG", "HARNESS", "SEED"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, harness, seed = args.child
        import logging
        logging.disable(logging.CRITICAL)  # the planted bugs' injected faults log warnings
        run = gated if harness == "gated" else soak
        print(json.dumps(run(name, int(seed))), flush=True)
        return 0
    bugs = args.bugs.split(",")
    unknown = [b for b in bugs if b not in PLANTED]
    if unknown:
        parser.error(f"--bugs: no planted bug named {', '.join(unknown)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: not a list of integers: {args.seeds!r}")
    harnesses = args.harnesses.split(",")
    if not set(harnesses) <= {"gated", "soak"}:
        parser.error(f"--harnesses: gated and/or soak, got {args.harnesses!r}")
    everything: dict[str, dict[str, list[dict[str, object]]]] = {}
    print("| planted bug | " + " | ".join(
        f"{h}: found (steps to first failure per seed)" for h in harnesses) + " |")
    print("| --- |" + " --- |" * len(harnesses))
    for name in bugs:
        row = everything.setdefault(name, {})
        for harness in harnesses:
            row[harness] = [measure(name, harness, seed) for seed in seeds]
        print(f"| {name} | " + " | ".join(cell(row[h]) for h in harnesses) + " |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
