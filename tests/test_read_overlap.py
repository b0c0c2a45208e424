"""bench.read_overlap: the bound on what overlapping a request's reads with its own prefill
could take off its TTFT, read from sweep results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.read_overlap import main, points_of
from tests.cli_helpers import refused_line

_MEASURED = (Path(__file__).parent.parent / "bench" / "results"
             / "sweep-h200-20261204-70b-class-p3-h4096-seed2.json")
"""A committed sweep file measured on a GPU machine: (d)'s five points of seed 2."""


def point(multiple: float, verdict: str, ttft: float, parked: float, *,
          breakdown: bool = True) -> dict[str, Any]:
    row: dict[str, Any] = {"seed": 0, "capacity_multiple": multiple, "verdict": verdict}
    if breakdown:
        row.update(breakdown_requests=200, breakdown_parked_requests=40,
                   breakdown_ttft_s_mean=ttft, breakdown_parked_s_mean=parked,
                   breakdown_parked_s_p99=4 * parked, breakdown_prefill_s_mean=0.05)
    return row


def results(rows: list[dict[str, Any]], knee: float | None) -> dict[str, Any]:
    search = {} if knee is None else {"d": {"0": {"goodput_multiple": knee}}}
    return {"bench": "sweep", "signature": {}, "calls": [],
            "cases": [{"case": "m-x2-h4096", "runs": {"d": rows, "c": [point(0.5, "met", 1, 0)]},
                       "search": search}]}


def write(tmp_path: Path, content: object, name: str = "sweep.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return path


def test_the_bound_is_the_parked_share_of_mean_ttft_at_the_lightest_point_and_the_knee(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [point(0.5, "met", 0.100, 0.020), point(1.0, "met", 0.400, 0.004),
            point(2.0, "missed", 3.0, 0.0)]
    path = write(tmp_path, results(rows, knee=1.0))
    assert [p.parked_share for p in points_of(path, results(rows, 1.0), "d")] == [
        pytest.approx(0.2), pytest.approx(0.01), 0.0]
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 0.5 | met | 200 (40) | 100.0 | 20.0 (20.0%) | 80.0 | 50.0 |" in out
    assert ("at most 20.0% at its lightest point (x0.5), at its goodput (x1) at most 1.0%"
            in out)


def test_points_without_a_breakdown_are_left_out_and_a_search_without_goodput_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [point(0.25, "met", 0, 0, breakdown=False), point(0.5, "met", 0.1, 0.01)]
    path = write(tmp_path, results(rows, knee=None))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 0.25 |" not in out
    assert "at most 10.0% at its lightest point (x0.5), no goodput point in this file" in out


def test_a_committed_gpu_file_gives_the_bound_of_its_points() -> None:
    # The figure BENCHMARKS.md quotes for this file: seed 2's lightest point parked 8.0%
    # of its mean TTFT, its goodput point 0.1%.
    doc = json.loads(_MEASURED.read_text())
    points = points_of(_MEASURED, doc, "d")
    assert [p.multiple for p in points] == pytest.approx([0.5, 0.7071, 0.8409, 0.917, 1.0],
                                                         abs=1e-4)
    assert points[0].parked_share == pytest.approx(0.080, abs=5e-4)
    assert points[3].parked_share == pytest.approx(0.001, abs=5e-4)


@pytest.mark.parametrize(("content", "message"), [
    (None, "is not JSON"),
    ({"bench": "io"}, "is not a bench.sweep results file"),
    (results([point(0.5, "met", 0.1, 0.01, breakdown=False)], knee=0.5),
     "no measured point of (d) with a TTFT breakdown"),
])
def test_a_file_it_cannot_use_is_one_line_naming_the_argument(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object,
        message: str) -> None:
    path = tmp_path / "bad.json"
    if content is None:
        path.write_bytes(b"\xff\xfe not json")
    else:
        path.write_text(json.dumps(content))
    line = refused_line(main, [str(path)], capsys)
    assert "argument files:" in line and message in line
