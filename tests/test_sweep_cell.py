"""bench.sweep_cell: a cell's goodput ratio paired within each run, and its spread over runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.sweep_cell import main, runs_of, summarize
from tests.cli_helpers import refused_line


def row(good: float | None, high: float | None, status: str | None = "below_next",
        done: bool = True) -> dict[str, Any]:
    return {"done": done, "status": status, "goodput_requests_per_s": good,
            "bracket_high_requests_per_s": high}


def results(seed: int, d: dict[str, Any], c: dict[str, Any], *, pressure: float = 3.0,
            capacity: float = 20.0, commit: str = "abcdef0123") -> dict[str, Any]:
    return {
        "bench": "sweep", "signature": {"pressure": pressure, "histories": [4096],
                                        "seed": seed, "machine": "h200"},
        "calls": [{"commit": commit}],
        "cases": [{"case": "m-x2-h4096", "capacity_requests_per_s": capacity,
                   "search": {"d": {str(seed): d}, "c": {str(seed): c}}}],
    }


def write(tmp_path: Path, name: str, content: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return path


def test_each_run_is_paired_within_itself_with_its_brackets_bounds() -> None:
    # Two machines 1.5x apart in speed: requests/s differ, the paired ratios do not.
    slow = results(0, row(24.0, 26.0), row(16.0, 18.0), capacity=18.0)
    fast = results(1, row(36.0, 39.0), row(24.0, 27.0), capacity=27.0)
    runs = [*runs_of(Path("a.json"), slow, "d", "c")["m-x2-h4096"],
            *runs_of(Path("b.json"), fast, "d", "c")["m-x2-h4096"]]
    assert [r.ratio for r in runs] == [pytest.approx(1.5), pytest.approx(1.5)]
    assert runs[0].low == pytest.approx(24 / 18) and runs[0].high == pytest.approx(26 / 16)
    summary = summarize(runs, target=1.3)
    assert summary.median == pytest.approx(1.5)
    assert summary.claim == "above, beyond the spread"
    assert summary.target_verdict == "met"


def test_a_run_whose_brackets_overlap_keeps_the_claim_within_the_spread() -> None:
    runs = [*runs_of(Path("a.json"), results(0, row(24.0, 26.0), row(16.0, 18.0)), "d", "c")
            ["m-x2-h4096"],
            *runs_of(Path("b.json"), results(1, row(20.0, 22.0), row(20.0, 22.0)), "d", "c")
            ["m-x2-h4096"]]
    summary = summarize(runs, target=1.3)
    assert summary.spread is not None
    assert summary.spread[0] == pytest.approx(1.0) and summary.spread[1] == pytest.approx(1.5)
    assert summary.claim == "within the spread"
    assert summary.target_verdict == "within the spread"


def test_one_run_claims_nothing_beyond_a_spread_it_does_not_have() -> None:
    runs = runs_of(Path("a.json"), results(0, row(30.0, 33.0), row(10.0, 11.0)), "d", "c")
    summary = summarize(runs["m-x2-h4096"], target=1.3)
    assert summary.claim == "above, one run: no spread"
    assert summary.target_verdict == "met (one run: no spread)"


def test_a_target_no_run_can_reach_is_missed_and_a_num_that_met_every_rate_is_unbounded(
) -> None:
    low = runs_of(Path("a.json"), results(0, row(11.0, 12.0), row(10.0, 11.0)), "d", "c")
    assert summarize(low["m-x2-h4096"], target=1.5).target_verdict == "missed"
    every = runs_of(Path("a.json"), results(0, row(30.0, None, "every_rate"), row(10.0, 11.0)),
                    "d", "c")["m-x2-h4096"][0]
    assert every.high == math.inf and every.low == pytest.approx(30 / 11)


def test_runs_without_both_goodputs_are_listed_and_left_out_of_the_figure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    met = write(tmp_path, "met.json", results(0, row(24.0, 26.0), row(16.0, 18.0)))
    never = write(tmp_path, "never.json",
                  results(1, row(None, 10.0, "never_met"), row(None, 10.0, "never_met")))
    unfinished = write(tmp_path, "unfinished.json",
                       results(2, row(None, None, None, done=False), row(16.0, 18.0)))
    assert main([str(met), str(never), str(unfinished)]) == 0
    out = capsys.readouterr().out
    assert "| never.json | 1 | abcdef0 | 20.00 | never_met | never_met | - |" in out
    assert "| unfinished.json | 2 | abcdef0 | 20.00 | not done | below_next | - |" in out
    assert "median 1.50x over 1 of 3 runs, spread 1.50-1.50x; (d) vs (c): within the spread" \
        in out


def test_files_of_another_cell_or_not_sweep_results_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path, "a.json", results(0, row(24.0, 26.0), row(16.0, 18.0)))
    other = write(tmp_path, "other.json",
                  results(1, row(24.0, 26.0), row(16.0, 18.0), pressure=1.5))
    junk = write(tmp_path, "junk.json", {"bench": "io"})
    text = tmp_path / "text.json"
    text.write_text("{not json")
    for argv, says in (([str(a), str(other)], "pressure differ"),
                       ([str(junk)], "not a bench.sweep results file"),
                       ([str(text)], "is not JSON"),
                       ([str(tmp_path / "missing.json")], "cannot read"),
                       ([str(a), "--num", "c", "--den", "c"], "both 'c'"),
                       ([str(a), "--num", "x"], "no case has both (x) and (c)")):
        assert says in refused_line(main, argv, capsys), argv


def test_the_committed_4k_pressure_3_files_give_their_published_spread(
        capsys: pytest.CaptureFixture[str]) -> None:
    results_dir = Path(__file__).parent.parent / "bench" / "results"
    files = [results_dir / name for name in (
        "sweep-h200-20261202-70b-class-p3-h4096.json",
        "sweep-h200-20261203-70b-class-p3-h4096-fused.json",
        "sweep-h200-20261204-70b-class-p3-h4096-seed1.json",
        "sweep-h200-20261204-70b-class-p3-h4096-seed2.json")]
    assert main([*map(str, files), "--target", "1.3"]) == 0
    out = capsys.readouterr().out
    assert "spread 1.00-1.54x" in out and "target 1.30x: within the spread" in out


def test_settings_named_to_pool_despite_may_differ_and_each_files_values_are_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = results(0, row(24.0, 26.0), row(20.0, 22.0))
    new = results(1, row(24.0, 26.0), row(20.0, 22.0))
    new["signature"]["foreground"] = "auto"  # a setting the older file predates
    a, b = write(tmp_path, "old.json", old), write(tmp_path, "new.json", new)
    with pytest.raises(SystemExit):
        main([str(a), str(b)])
    assert "foreground differ" in capsys.readouterr().err
    assert main([str(a), str(b), "--pool-despite", "foreground"]) == 0
    out = capsys.readouterr().out
    assert "old.json: foreground=(not recorded)" in out and "new.json: foreground=auto" in out
    assert "over 2 of 2 runs" in out
    # Pooling despite a setting still refuses a difference in any other.
    other = results(2, row(24.0, 26.0), row(20.0, 22.0), pressure=1.5)
    with pytest.raises(SystemExit):
        main([str(a), str(write(tmp_path, "p15.json", other)), "--pool-despite", "foreground"])
    assert "pressure differ" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "says"), [
    (",", "setting names separated by commas"),
    ("foregound", "no file records foregound"),
])
def test_a_pool_despite_naming_nothing_recorded_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, says: str) -> None:
    a = write(tmp_path, "a.json", results(0, row(24.0, 26.0), row(16.0, 18.0)))
    line = refused_line(main, [str(a), "--pool-despite", value], capsys)
    assert says in line and "--pool-despite" in line
