"""Mutation testing of one io_actors module with mutmut, outside the core's configuration.

pyproject.toml's ``[tool.mutmut]`` is the core's run (``statekv/``).  This runs mutmut on one
actor module in a scratch copy of the tree (``build/mutmut/<module>``), whose pyproject.toml
names that module and an explicit test selection for it, and where a mutant that hangs a
thread is stopped by a wall-clock limit (mutmut 3.8 sends SIGXCPU after
``(tests' time + timeout_constant) * timeout_multiplier`` seconds; a hang counts as a kill,
"timeout").  With ``--sample N`` it runs a seeded random sample of the module's mutants
(``random.Random(seed).sample`` over mutmut's own mutant list, in its order).  The
results stay in the scratch tree: ``cd build/mutmut/<module> && mutmut results``/``show``.

    python -m fuzz.mutate_actors io_actors/actors/worker_threads.py
    python -m fuzz.mutate_actors io_actors/actors/scheduler.py --sample 150 --seed 10

fuzz/README.md ("Mutation testing") gives the selection, the scores and the survivors.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
from pathlib import Path

from mutmut.mutation.file_mutation import mutate_file_contents

ROOT = Path(__file__).resolve().parent.parent

_ACTOR_TESTS = [
    "tests/test_io_actors.py",
    "tests/test_close_accounting.py",
    "tests/test_io_faults.py",
    "tests/test_prefetch_actors.py",
    "tests/test_actor_mutation_gaps.py",
    "tests/test_persistence.py",
    "tests/test_retention_journal.py",
]
# The tests that reach each module (run in full for every mutant the module's functions
# are seen in: mutmut 3.8 records calls from every thread of the test process).  The shared
# tier's tests start Redis Clusters (about 2 s each, a time mutmut does not measure: it
# times only the tests' calls, so runs that include them need --timeout-constant 10 or so);
# a session that mutmut's CPU limit kills takes its clusters with it
# (bench/redis_cluster.py: the servers die with their parent).
_SHARED_TIER_TESTS = ["tests/test_remote_actors.py", "tests/test_redis_store.py"]
_POSIX_STORE_TESTS = [
    "tests/test_posix_store.py", "tests/test_posix_store_counters.py",
    "tests/test_io_faults.py", "tests/test_faults.py", "tests/test_slot_format.py",
    "tests/test_posix_store_setup.py", "tests/test_persistence.py",
    "tests/test_index_journal.py", "tests/test_retention_journal.py",
]
TESTS: dict[str, list[str]] = {
    "io_actors/actors/worker_threads.py": _ACTOR_TESTS,
    "io_actors/actors/writer_pool.py": _ACTOR_TESTS,
    "io_actors/actors/reader_pool.py": _ACTOR_TESTS,
    "io_actors/actors/scheduler.py": [*_ACTOR_TESTS, "tests/test_spill_modes.py",
                               "tests/test_tracing.py", "tests/test_index_journal.py",
                               "tests/test_scheduler_gaps.py", *_SHARED_TIER_TESTS],
    "io_actors/embed.py": [*_ACTOR_TESTS, "tests/test_tracing.py",
                           "tests/test_index_journal.py", "tests/test_config.py",
                           "tests/test_serving_cancel.py", "tests/test_serving_prefetch.py",
                           "tests/test_metrics.py", "tests/test_open_interrupted.py",
                           *_SHARED_TIER_TESTS],
    # The store and its open procedure (split out of posix.py) answer to the same tests.
    "io_actors/storage/posix.py": _POSIX_STORE_TESTS,
    "io_actors/storage/posix_open.py": _POSIX_STORE_TESTS,
    "io_actors/storage/slot_format.py": [
        "tests/test_slot_format.py", "tests/test_slot_format_errors.py",
        "tests/test_posix_store.py", "tests/test_io_faults.py",
    ],
}


def _config(module: str, timeout_multiplier: float, timeout_constant: float) -> str:
    tests = [t for t in TESTS[module] if (ROOT / t).exists()]
    return (
        "[tool.mutmut]\n"
        f"source_paths = [{json.dumps(module)}]\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
        'also_copy = ["tests", "specs", "fuzz", "io_actors", "statekv", "models", "serve",'
        ' "bench", "README.md", "BENCHMARKS.md", "docs"]\n'
        f"timeout_multiplier = {timeout_multiplier}\n"
        f"timeout_constant = {timeout_constant}\n"
    )


def _scratch_tree(module: str, config: str) -> Path:
    work = ROOT / "build" / "mutmut" / Path(module).stem
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = work / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    pyproject = work / "pyproject.toml"
    text = pyproject.read_text()
    start = text.index("[tool.mutmut]")
    end = text.find("\n[", start + 1)
    rest = "" if end < 0 else text[end:]
    pyproject.write_text(text[:start] + config + rest)
    return work


def mutant_names(module: str) -> list[str]:
    """Every mutant mutmut makes of `module`, by its full name, in mutmut's order."""
    prefix = module.removesuffix(".py").replace("/", ".")
    mutated = mutate_file_contents(module, (ROOT / module).read_text())
    return [f"{prefix}.{name}" for name in mutated.mutant_names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.mutate_actors")
    parser.add_argument("module", choices=sorted(TESTS))
    parser.add_argument("--sample", type=int, default=None,
                        help="run this many mutants, chosen at random (default: all)")
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--timeout-multiplier", type=float, default=4.0)
    parser.add_argument("--timeout-constant", type=float, default=3.0)
    parser.add_argument("--names", nargs="*", default=None,
                        help="run only these mutants (e.g. a previous run's survivors)")
    args = parser.parse_args(argv)
    names = mutant_names(args.module)
    if args.names:
        chosen = args.names
    elif args.sample is not None and args.sample < len(names):
        chosen = sorted(random.Random(args.seed).sample(names, args.sample),
                        key=names.index)
    else:
        chosen = []
    print(f"{args.module}: {len(names)} mutants, running "
          f"{len(chosen) if chosen else len(names)}", flush=True)
    work = _scratch_tree(args.module, _config(args.module, args.timeout_multiplier,
                                              args.timeout_constant))
    # A mutant of the POSIX store's free-space check makes the test of a disk larger than
    # the free space allocate all of it (it filled this machine's disk once): no file the
    # mutants' tests write may pass 1 GiB (Python ignores SIGXFSZ: the write fails, EFBIG).
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))
    mutmut = Path(sys.executable).parent / "mutmut"
    run = subprocess.run([str(mutmut), "run", "--max-children", str(args.children), *chosen],
                         cwd=work, check=False)
    results = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=work,
                             check=False, capture_output=True, text=True).stdout
    counts: dict[str, int] = {}
    for line in results.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name and (not chosen or name in chosen):
            counts[status] = counts.get(status, 0) + 1
    print(json.dumps({"module": args.module, "mutants": len(names),
                      "run": sum(counts.values()), **counts}))
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
