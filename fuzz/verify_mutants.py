"""Re-run mutants that mutmut reported as timed out, outside mutmut.

mutmut runs each mutant in a child forked from a process that already imported and
collected the tests.  For the shared tier's tests (Redis Clusters started by subprocess,
client threads) some of those children hang where the same tests, run directly with the
same mutant switched on, pass in half a minute: a fork taken while another thread held a
lock.  A "timed out" there says nothing about the mutant.  This runs each named mutant's
tests (the ones mutmut recorded for its function) in a fresh ``pytest`` process of the
scratch tree, with the mutant switched on, and reports: killed (a test failed), hung (past
``--timeout`` seconds), or survived.

    python -m fuzz.verify_mutants io_actors/actors/scheduler.py NAME... [--timeout 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def verify(module: str, names: list[str], timeout: float) -> dict[str, str]:
    mutants = ROOT / "build" / "mutmut" / Path(module).stem / "mutants"
    stats = json.loads((mutants / "mutmut-stats.json").read_text())
    tests_of = stats["tests_by_mangled_function_name"]
    outcome: dict[str, str] = {}
    for name in names:
        function = name.rsplit("__mutmut_", 1)[0]
        tests = sorted(tests_of.get(function, []))
        if not tests:
            outcome[name] = "no tests"
            print(f"{name}: no tests", flush=True)
            continue
        env = dict(os.environ, MUTANT_UNDER_TEST=name)
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                cwd=mutants, env=env, capture_output=True, text=True, timeout=timeout,
                check=False,
            )
            result = {0: "survived", 1: "killed"}.get(done.returncode,
                                                      f"exit {done.returncode}")
        except subprocess.TimeoutExpired:
            result = "hung"
        outcome[name] = result
        print(f"{name}: {result} ({len(tests)} tests, {time.monotonic() - started:.0f} s)",
              flush=True)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.verify_mutants")
    parser.add_argument("module")
    parser.add_argument("names", nargs="+")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    outcome = verify(args.module, args.names, args.timeout)
    counts: dict[str, int] = {}
    for result in outcome.values():
        counts[result] = counts.get(result, 0) + 1
    print(json.dumps({"module": args.module, **counts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
