"""Planted bugs beneath an engine: statekv.engine_tiers and the vLLM connector's two halves.

As fuzz/planted.py does for the serving-loop core, each entry breaks one guarantee of the
real code for the duration of a ``with`` block; nothing on disk is edited.  Each bug is one
small textual change to one method (``old`` -> ``new``), compiled from the method's source in
its own module's namespace and put in place of the method while the block runs -- the kind
of slip a change to the code could make.  ``python -m fuzz.planted_engine NAME`` runs the
tests that should catch it with the bug planted (they must fail); ``--all`` runs every
entry and prints the table of fuzz/README.md ("Planted bugs beneath an engine").
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs


@contextmanager
def _mutated(owner: object, name: str, old: str, new: str) -> Iterator[None]:
    """Replace ``owner.name`` by its own source with `old` replaced by `new` (once)."""
    original = owner.__dict__[name]
    source = textwrap.dedent(inspect.getsource(original))
    if source.count(old) != 1:
        raise AssertionError(f"{owner!r}.{name}: {old!r} occurs "
                             f"{source.count(old)} times, not once")
    namespace: dict[str, Any] = {}
    module = sys.modules[original.__module__]
    code = compile(source.replace(old, new), inspect.getsourcefile(original) or "?", "exec")
    exec(code, vars(module), namespace)  # the planted method, in its own module
    setattr(owner, name, namespace[name])
    try:
        yield
    finally:
        setattr(owner, name, original)


@attrs.frozen
class EnginePlanted:
    name: str
    guarantee: str
    owner: str
    """"module:Class" of the method the bug changes ("module:" for a function)."""
    method: str
    old: str
    new: str
    tests: tuple[str, ...]
    """The pytest node ids that must fail with the bug planted."""

    def plant(self) -> AbstractContextManager[None]:
        module, cls = self.owner.split(":")
        __import__(module)
        owner = sys.modules[module]
        return _mutated(getattr(owner, cls) if cls else owner, self.method, self.old, self.new)


_ET = "statekv.engine_tiers:EngineTiers"
_SS = "io_actors.vllm.scheduler_side:SchedulerSide"
_WS = "io_actors.vllm.worker_side:WorkerSide"
_T = "tests/test_engine_tiers.py::"
_M = "tests/test_engine_tiers_machine.py"
_C = "tests/test_connector_machine.py::"
_G = "tests/test_engine_planted_gaps.py::"

ENGINE_PLANTED = {p.name: p for p in (
    EnginePlanted(
        "loading-block-left-in-displacement-order",
        "a block under a disk read (LOADING) is in no displacement order",
        _ET, "start_load",
        "self._disk.slots.unfile(block)  # no spill may take the slot under a read", "pass",
        (_M,)),
    EnginePlanted(
        "failed-load-left-in-index",
        "a failed read takes its content out of the index at once",
        _ET, "_load_done", "self._index.remove(block)", "pass",
        (_T + "test_a_failed_read_is_never_offered_again_and_its_slot_waits_for_every_read",)),
    EnginePlanted(
        "last-reader-off-by-one",
        "a slot is freed (or refiled) only when the last read of it has reported",
        _ET, "_load_done", "if block.ref_count:", "if block.ref_count > 1:",
        (_T + "test_two_requests_may_read_one_disk_block_at_once",)),
    EnginePlanted(
        "copied-out-not-refreshing-host-lru",
        "a host hit (COPIED_OUT) becomes the newest of the host order",
        _ET, "start_load", "if block.state is _S.ON_HOST:  # the newest of the host order again",
        "if False:",
        (_G + "test_a_host_hit_is_the_last_host_block_evicted",)),
    EnginePlanted(
        "save-not-stamping-cached-block",
        "a save stamps the TTL of a block the tiers already hold",
        _ET, "save", "self._disk.extend_retention(known, expiry, now)", "pass",
        (_G + "test_saving_a_block_the_tiers_hold_stamps_its_ttl",)),
    EnginePlanted(
        "write-through-of-best-effort-under-retained",
        'write_through="retained" writes only blocks saved with a live TTL',
        _ET, "_writes_through", 'if policy == "retained" and not', 'if False and not',
        (_T + "test_write_through_of_retained_content_only",)),
    EnginePlanted(
        "start-load-from-block-0",
        "start_load fills the pages from start_block on",
        _ET, "start_load", "run = self._run(req, start)", "run = self._run(req, 0)",
        (_M,)),
    EnginePlanted(
        "lookup-counts-towards-the-probe",
        "lookup changes nothing (not even the cost gate's probe count)",
        _ET, "lookup", "take, skipped = self._gate(req, run)\n",
        "take, skipped = self._gate(req, run); self._probe_next = self._probe_next or bool("
        "skipped and self._costs.probe_due(True, False))\n",
        (_T + "test_the_cost_gate_recomputes_a_slow_disk_run_and_probes_it_again",)),
    EnginePlanted(
        "gated-cut-not-counted-towards-the-probe",
        "a load cut by the cost gate counts towards the next probe",
        _ET, "start_load", "if skipped and len(pages) == take and", "if False and",
        (_T + "test_the_cost_gate_recomputes_a_slow_disk_run_and_probes_it_again",)),
    EnginePlanted(
        "landed-read-not-refiled",
        "a read that landed leaves its block displaceable on disk again",
        _ET, "_load_done", "self._disk.file(block, now)", "pass",
        (_T + "test_host_pressure_spills_and_a_disk_hit_is_read_back_and_stays_on_disk",)),
    EnginePlanted(
        "reported-before-every-rank",
        "a transfer is applied only once every rank reported it",
        _SS, "reported", "if got.ranks < self.world_size:", "if got.ranks < 1:",
        (_G + "test_a_write_is_applied_only_once_every_rank_reported",)),
    EnginePlanted(
        "finished-saves-a-request-awaiting-its-load",
        "a request given up while loading claims no save",
        _SS, "finished", "if request_id in self._awaiting:", "if False:",
        (_C + "test_a_request_given_up_before_its_host_copies_ran_claims_no_save",)),
    EnginePlanted(
        "restore-common-across-ranks-as-union",
        "a block is restored only when every rank holds it in the same slot",
        _SS, "_restore", "k: v for k, v in common.items() if k in found}",
        "**common, **found}",
        (_G + "test_a_block_one_rank_lacks_is_not_restored",)),
    EnginePlanted(
        "foreign-manifest-accepted",
        "a restore manifest written by another engine is refused",
        _SS, "_restore", 'if body.get("instance") != instance:', "if False:",
        (_G + "test_a_manifest_of_another_engine_is_refused",)),
    EnginePlanted(
        "recving-before-every-read-landed",
        "finished_recving names a request once every read of it reported on this rank",
        _WS, "_collect", "if not waiting:", "if True:",
        (_C + "test_connector_serves_only_the_asked_content_through_vllms_calls",)),
    EnginePlanted(
        "failed-read-scattered-into-the-page",
        "a read that fails writes nothing into the engine's pages",
        _WS, "_collect", "good = [i for i, r in enumerate(results) if r is None]",
        "good = list(range(len(results)))",
        (_G + "test_a_failed_read_leaves_the_engine_page_untouched",)),
    EnginePlanted(
        "unknown-setting-ignored",
        "an unknown kv_connector_extra_config key is an error, never ignored",
        "io_actors.vllm.settings:", "connector_config", "if k not in CONNECTOR_KEYS}",
        "if k in TIER_KEYS}",
        ("tests/test_vllm_settings.py::test_a_bad_extra_config_names_the_key",)),
)}


def run(planted: EnginePlanted, *, quiet: bool = True) -> tuple[bool, float, str]:
    """(caught, seconds, the first failing test) with the bug planted."""
    import pytest

    failed: list[str] = []

    class Collect:
        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.failed and report.nodeid not in failed:
                failed.append(report.nodeid)

    args = ["-x", "-p", "no:cacheprovider", "-q", *(["--no-header", "-rN"] if quiet else []),
            *planted.tests]
    start = time.monotonic()
    with planted.plant():
        pytest.main(args, plugins=[Collect()])
    return bool(failed), time.monotonic() - start, failed[0] if failed else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.planted_engine", description=__doc__)
    parser.add_argument("name", nargs="?", choices=sorted(ENGINE_PLANTED))
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args(argv)
    if not args.all:
        if args.name is None:
            parser.error("name a planted bug, or --all")
        planted = ENGINE_PLANTED[args.name]
        caught, seconds, test = run(planted)
        print(f"| `{planted.name}` | {test or 'NOT caught'} | {seconds:.1f} s |")
        return 0 if caught else 1
    missed = 0
    rows = []
    for name in ENGINE_PLANTED:  # a process each: a test module imported once stays planted
        child = subprocess.run([sys.executable, "-m", "fuzz.planted_engine", name],
                               capture_output=True, text=True, check=False)
        missed += child.returncode != 0
        rows.append(child.stdout.strip().splitlines()[-1] if child.stdout.strip()
                    else f"| `{name}` | error: {child.stderr.strip()[-200:]} | |")
    print("\n".join(rows))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
