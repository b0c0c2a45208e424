"""What overlapping a request's reads with its own prefill could take off its TTFT, read
from sweep results already measured.

    python -m bench.read_overlap FILE.json [FILE.json ...] [--config d]

Overlap within one request -- reading the later layers of a prefix from disk while its
first layers compute -- would hide a request's reads behind its own compute.  Before
building it, this asks how much it could win.  The serving loop splits every measured
request's time to first token into queue, prefetch, parked, prefill and ready-wait
(`models.serving_loop.TtftBreakdown`).  *Parked* is the time from admission until the reads
its prefix still needed landed.  The loop runs other requests meanwhile, while the parked
one holds its GPU pages.  Parked time is the only part such overlap could hide, and each
request at most min(parked, its prefill).  So over a point's requests the mean parked time
bounds the mean saving, and its share of the mean TTFT bounds the relative saving.

Per measured point of the configuration (default (d)): its rate, verdict, requests, how
many were parked, the TTFT mean, parked mean (and share), parked p99 and prefill mean.  Per
run, the bound at its lightest point and at its goodput (the knee, where goodput is
decided).  The ratio is within one point of one run: no limit from another machine.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.flags import OneLineParser
from bench.sweep_cell import read_results


@attrs.frozen(kw_only=True)
class Point:
    """One measured point's TTFT split, as far as parking goes."""

    file: str
    case: str
    seed: str
    multiple: float
    verdict: str
    requests: int
    parked_requests: int
    ttft_mean_s: float
    parked_mean_s: float
    parked_p99_s: float
    prefill_mean_s: float

    @property
    def parked_share(self) -> float:
        """The mean parked time over the mean TTFT: the most overlap could take off it."""
        return self.parked_mean_s / self.ttft_mean_s if self.ttft_mean_s > 0 else math.nan


def points_of(path: Path, results: dict[str, Any], config: str) -> list[Point]:
    """The configuration's measured points that carry a TTFT breakdown (files written
    before the breakdown existed have none), in the order measured."""
    out: list[Point] = []
    for case in results["cases"]:
        for row in case.get("runs", {}).get(config, []):
            if not row.get("breakdown_requests"):
                continue
            out.append(Point(
                file=path.name, case=str(case.get("case", "?")), seed=str(row.get("seed", "?")),
                multiple=float(row["capacity_multiple"]), verdict=str(row.get("verdict", "?")),
                requests=int(row["breakdown_requests"]),
                parked_requests=int(row["breakdown_parked_requests"]),
                ttft_mean_s=float(row["breakdown_ttft_s_mean"]),
                parked_mean_s=float(row["breakdown_parked_s_mean"]),
                parked_p99_s=float(row["breakdown_parked_s_p99"]),
                prefill_mean_s=float(row["breakdown_prefill_s_mean"]),
            ))
    return out


def knee_multiple(results: dict[str, Any], case: str, config: str, seed: str) -> float | None:
    """The multiple of capacity the configuration's search ended on as its goodput."""
    for entry in results["cases"]:
        if str(entry.get("case")) == case:
            search = entry.get("search", {}).get(config, {}).get(seed, {})
            multiple = search.get("goodput_multiple")
            return float(multiple) if multiple is not None else None
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(points: Sequence[Point], knees: dict[tuple[str, str, str], float | None],
           config: str) -> str:
    lines = [f"({config}): the part of TTFT spent parked on the request's own reads",
             "| file | case | seed | x capacity | verdict | requests (parked) | TTFT mean ms | "
             "parked mean ms (share) | parked p99 ms | prefill mean ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        lines.append(
            f"| {p.file} | {p.case} | {p.seed} | {p.multiple:.4g} | {p.verdict} | "
            f"{p.requests} ({p.parked_requests}) | {_ms(p.ttft_mean_s)} | "
            f"{_ms(p.parked_mean_s)} ({p.parked_share:.1%}) | {_ms(p.parked_p99_s)} | "
            f"{_ms(p.prefill_mean_s)} |")
    runs: dict[tuple[str, str, str], list[Point]] = {}
    for p in points:
        runs.setdefault((p.file, p.case, p.seed), []).append(p)
    for (file, case, seed), run in runs.items():
        lightest = min(run, key=lambda p: p.multiple)
        knee = knees.get((file, case, seed))
        at_knee = [p for p in run if knee is not None and math.isclose(p.multiple, knee)]
        knee_text = "no goodput point in this file"
        if at_knee:
            worst = max(p.parked_share for p in at_knee)
            knee_text = f"at its goodput (x{knee:.4g}) at most {worst:.1%}"
        lines.append(f"{file} {case} seed {seed}: overlap could take off the mean TTFT at most "
                     f"{lightest.parked_share:.1%} at its lightest point "
                     f"(x{lightest.multiple:.4g}), {knee_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.read_overlap",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("files", type=Path, nargs="+", help="bench.sweep results files")
    parser.add_argument("--config", default="d",
                        help="the configuration whose points to read (default d)")
    args = parser.parse_args(argv)
    points: list[Point] = []
    knees: dict[tuple[str, str, str], float | None] = {}
    for path in args.files:
        try:
            results = read_results(path)
        except ValueError as exc:
            parser.error(f"argument files: {exc}")
        mine = points_of(path, results, args.config)
        points += mine
        for file, case, seed in dict.fromkeys((p.file, p.case, p.seed) for p in mine):
            knees[(file, case, seed)] = knee_multiple(results, case, args.config, seed)
    if not points:
        parser.error(f"argument files: no measured point of ({args.config}) with a TTFT "
                     "breakdown in them (files written before 2026-12-03 have none)")
    print(report(points, knees, args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
