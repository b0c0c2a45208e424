"""One sweep cell over several results files: each run's goodput ratio, paired within its
run, and the spread over runs.

    python -m bench.sweep_cell FILE.json [FILE.json ...] [--num d --den c] [--target 1.3]
                               [--pool-despite SETTING,...]

A cell (a model shape, history length and pressure) is often measured one seed a device
call, each call a file of its own, on machines whose speed differs by half between calls
(the calibrated recompute capacity of the 4k-token cell ranged 18.1-26.7 requests/s on the
H200 machines).  Goodput in requests/s from different calls is not comparable; the ratio of
two configurations measured in the same run is.  So each (file, seed) is one *run*: its
ratio num/den, with the bounds its search brackets give (each knee lies in [goodput,
bracket_high)), and the cell's figure is the median of the runs' ratios with their spread.

A claim is made only beyond the spread: "num above den" when in every run num's knee lies
above den's whatever the brackets' resolution (num's goodput at or above den's first missed
rate), "below" the mirror of it, else "within the spread".  With --target, the same for the
ratio against that target: met when every run's lower bound reaches it, missed when no
run's upper bound does.  One run gives no spread, and says so.  Files of different cells or
settings are refused: their ratios do not measure the same thing, unless the settings that
differ are named with --pool-despite (a file written before a setting existed does not
record it); each file's values of those are then printed above the table.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.flags import OneLineParser, comma_list, positive_number

IGNORED_SETTINGS = frozenset({"seed", "seeds", "machine"})
"""Signature fields that may differ between the files of one cell: which seeds a file ran,
and the machine's name."""


@attrs.frozen(kw_only=True)
class Run:
    """One (file, seed): the two configurations' searches from the same run."""

    file: str
    seed: str
    commits: tuple[str, ...]
    capacity: float
    num_status: str | None
    den_status: str | None
    ratio: float | None
    """num's goodput over den's; None when either has none (never met, or not done)."""
    low: float | None
    """The lowest ratio the brackets allow (num's goodput over den's first missed rate)."""
    high: float | None
    """The highest (num's first missed rate over den's goodput); inf if num met every rate."""


def _rows(case: dict[str, Any], config: str) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = case.get("search", {}).get(config, {})
    return rows


def runs_of(path: Path, results: dict[str, Any], num: str, den: str) -> dict[str, list[Run]]:
    """Every case of one results file: its runs, one per seed both configurations searched."""
    commits = tuple(dict.fromkeys(str(c.get("commit", "?"))[:7] for c in results["calls"]))
    out: dict[str, list[Run]] = {}
    for case in results["cases"]:
        nums, dens = _rows(case, num), _rows(case, den)
        for seed in sorted(set(nums) & set(dens), key=int):
            n, d = nums[seed], dens[seed]
            ratio = low = high = None
            done = n["done"] and d["done"]
            n_good, d_good = n["goodput_requests_per_s"], d["goodput_requests_per_s"]
            if done and n_good is not None and d_good is not None:
                ratio = n_good / d_good
                d_high = d["bracket_high_requests_per_s"]
                n_high = n["bracket_high_requests_per_s"]
                low = n_good / d_high if d_high is not None else None
                high = math.inf if n_high is None else n_high / d_good
            out.setdefault(case["case"], []).append(Run(
                file=path.name, seed=seed, commits=commits,
                capacity=case["capacity_requests_per_s"],
                num_status=n["status"], den_status=d["status"], ratio=ratio, low=low,
                high=high))
    return out


@attrs.frozen(kw_only=True)
class CellSummary:
    runs: list[Run]
    median: float | None
    spread: tuple[float, float] | None
    claim: str
    target_verdict: str | None


def summarize(runs: Sequence[Run], target: float | None) -> CellSummary:
    ratios = [r.ratio for r in runs if r.ratio is not None]
    if not ratios:
        return CellSummary(runs=list(runs), median=None, spread=None,
                           claim="no run has both goodputs", target_verdict=None)
    complete = [r for r in runs if r.ratio is not None]
    every = len(complete) == len(runs)
    lows = [r.low for r in complete]
    highs = [r.high for r in complete]
    if every and all(lo is not None and lo >= 1.0 for lo in lows):
        claim = "above"
    elif every and all(hi is not None and hi <= 1.0 for hi in highs):
        claim = "below"
    else:
        claim = "within the spread"
    if claim != "within the spread":
        claim += ", beyond the spread" if len(complete) >= 2 else ", one run: no spread"
    verdict = None
    if target is not None:
        if every and all(lo is not None and lo >= target for lo in lows):
            verdict = "met" + ("" if len(complete) >= 2 else " (one run: no spread)")
        elif all(hi is not None and hi < target for hi in highs):
            verdict = "missed"
        else:
            verdict = "within the spread"
    return CellSummary(runs=list(runs), median=statistics.median(ratios),
                       spread=(min(ratios), max(ratios)), claim=claim, target_verdict=verdict)


def _signature(results: dict[str, Any], despite: frozenset[str] = frozenset()
               ) -> dict[str, Any]:
    return {k: v for k, v in results.get("signature", {}).items()
            if k not in IGNORED_SETTINGS and k not in despite}


def read_results(path: Path) -> dict[str, Any]:
    """One bench.sweep results file; ValueError saying why it is not one."""
    try:
        results = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not JSON: not UTF-8 text") from None
    if not isinstance(results, dict) or results.get("bench") != "sweep" or not all(
            key in results for key in ("signature", "calls", "cases")):
        raise ValueError(f"{path} is not a bench.sweep results file")
    return results


def load(paths: Sequence[Path], despite: frozenset[str] = frozenset()
         ) -> list[tuple[Path, dict[str, Any]]]:
    """The files, checked to be sweep results of one cell (settings named in `despite` may
    differ); ValueError naming the first that is not."""
    loaded: list[tuple[Path, dict[str, Any]]] = []
    for path in paths:
        results = read_results(path)
        if loaded:
            first_path, first = loaded[0]
            want, got = _signature(first, despite), _signature(results, despite)
            differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            if differ:
                raise ValueError(f"{path} is another cell or other settings than "
                                 f"{first_path}: {', '.join(differ)} differ")
        loaded.append((path, results))
    return loaded


def _x(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def report(case: str, summary: CellSummary, num: str, den: str, target: float | None) -> str:
    lines = [f"cell {case}: ({num})/({den}) goodput, each run paired within itself",
             "| file | seed | commits | capacity req/s | "
             f"({num}) status | ({den}) status | ratio | bounds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary.runs:
        lines.append(f"| {r.file} | {r.seed} | {' '.join(r.commits)} | {r.capacity:.2f} | "
                     f"{r.num_status or 'not done'} | {r.den_status or 'not done'} | "
                     f"{_x(r.ratio)} | "
                     f"{_x(r.low)} - {_x(r.high)} |")
    if summary.median is None or summary.spread is None:
        lines.append(summary.claim)
    else:
        lo, hi = summary.spread
        with_ratio = sum(r.ratio is not None for r in summary.runs)
        lines.append(f"median {summary.median:.2f}x over {with_ratio} of "
                     f"{len(summary.runs)} runs, spread {lo:.2f}-{hi:.2f}x; "
                     f"({num}) vs ({den}): {summary.claim}")
        if target is not None:
            lines.append(f"target {target:.2f}x: {summary.target_verdict}")
    return "\n".join(lines)


def _setting_names(text: str) -> frozenset[str]:
    return frozenset(comma_list(str, what="setting names separated by commas",
                                distinct=False)(text))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.sweep_cell",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("files", type=Path, nargs="+", help="bench.sweep results files")
    parser.add_argument("--num", default="d", help="the configuration over (default d)")
    parser.add_argument("--den", default="c", help="the configuration under (default c)")
    parser.add_argument("--target", type=positive_number, default=None,
                        help="a ratio to judge the runs against")
    parser.add_argument("--pool-despite", type=_setting_names, default=frozenset(),
                        metavar="SETTING[,SETTING...]",
                        help="pool files whose recorded settings differ in these (a file "
                             "written before a setting existed lacks it); each file's "
                             "values of them are printed")
    args = parser.parse_args(argv)
    if args.num == args.den:
        parser.error(f"--num and --den are both {args.num!r}")
    try:
        loaded = load(args.files, args.pool_despite)
    except ValueError as exc:
        parser.error(f"argument files: {exc}")
    unknown = sorted(name for name in args.pool_despite
                     if not any(name in results["signature"] for _path, results in loaded))
    if unknown:
        parser.error(f"argument --pool-despite: no file records {', '.join(unknown)}")
    for path, results in loaded:
        if args.pool_despite:
            recorded = results["signature"]
            values = ", ".join(f"{k}={recorded.get(k, '(not recorded)')}"
                               for k in sorted(args.pool_despite))
            print(f"{path.name}: {values}")
    cells: dict[str, list[Run]] = {}
    for path, results in loaded:
        for case, runs in runs_of(path, results, args.num, args.den).items():
            cells.setdefault(case, []).extend(runs)
    if not cells:
        parser.error(f"argument files: no case has both ({args.num}) and ({args.den}) searched")
    for case, runs in cells.items():
        print(report(case, summarize(runs, args.target), args.num, args.den, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
