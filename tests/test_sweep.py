"""The offered-load sweep (bench/sweep.py): goodput from hand-made tables, the CLI's errors,
and one small sweep end to end on the CPU (tiny shapes, 2 rates, 2 configurations)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.sweep import Goodput, climb_order, figures, goodput, goodput_rows, main
from statekv.errors import UsageError

# ---------------------------------------------------------------------- goodput


def test_goodput_is_the_rate_before_the_first_miss() -> None:
    # The recovery at 8/s does not count: every lower rate must meet the SLO too.
    assert goodput([1, 2, 4, 8], [0.5, 1.0, 3.0, 1.0], 2.0) == Goodput(
        rate=2, index=1, status="below_next")


def test_goodput_when_every_rate_meets_the_slo() -> None:
    assert goodput([0.5, 1.0, 2.0], [0.1, 0.2, 2.0], 2.0) == Goodput(
        rate=2.0, index=2, status="every_rate")


def test_goodput_when_the_slo_is_never_met() -> None:
    assert goodput([0.5, 1.0], [2.5, 9.0], 2.0) == Goodput(
        rate=None, index=None, status="never_met")


def test_an_unmeasured_p99_is_a_miss() -> None:
    assert goodput([1, 2, 3], [0.1, math.nan, 0.1], 1.0).rate == 1
    assert goodput([1, 2, 3], [0.1, 0.2, None], 1.0) == Goodput(
        rate=2, index=1, status="below_next")


@pytest.mark.parametrize(("rates", "p99", "slo", "field"), [
    ([1, 2], [0.1, 0.1], 0.0, "slo"),
    ([1, 2], [0.1, 0.1], -1.0, "slo"),
    ([1, 2], [0.1, 0.1], math.inf, "slo"),
    ([1, 2], [0.1], 1.0, "ttft_p99"),
    ([], [], 1.0, "rates"),
    ([2, 1], [0.1, 0.1], 1.0, "rates"),
    ([1, 1], [0.1, 0.1], 1.0, "rates"),
])
def test_goodput_rejects_bad_input(rates: list[float], p99: list[float], slo: float,
                                   field: str) -> None:
    with pytest.raises(UsageError) as err:
        goodput(rates, p99, slo)
    assert err.value.field == field


def _case(p99: dict[str, list[float]], done: str = "abcde") -> dict[str, Any]:
    rates = [0.5, 1.0, 2.0]
    return {
        "case": "x", "capacity_requests_per_s": 10.0,
        "runs": {k: [{"ttft_p99_s": v, "capacity_multiple": m, "requests_per_s": 10 * m,
                      "input_tok_per_s": 1000 * m} for m, v in zip(rates, vs, strict=False)]
                 for k, vs in p99.items()},
        "search_done": {k: k in done for k in p99},
        "disk_read_gb_per_s": 2.0, "prefill_tok_per_s": 5e4,
    }


def test_goodput_table_and_figures() -> None:
    case = _case({"a": [3.0, 4.0, 5.0], "c": [0.5, 3.0, 4.0], "d": [0.5, 1.0, 2.5],
                  "e": [0.5, 1.0, 1.5]})
    case["goodput"] = goodput_rows(case, 2.0)
    assert case["goodput"]["a"]["status"] == "never_met"
    assert case["goodput"]["a"]["requests_per_s"] is None
    assert case["goodput"]["c"] == {"status": "below_next", "run_index": 0,
                                    "requests_per_s": 5.0, "input_tok_per_s": 500.0,
                                    "capacity_multiple": 0.5}
    assert case["goodput"]["d"]["requests_per_s"] == 10.0
    assert case["goodput"]["e"]["status"] == "every_rate"
    figs = figures([case])
    assert "x_goodput_a" not in figs  # never met: absent, not zero
    assert figs["x_goodput_d"]["ratio"] == 1.0
    assert figs["x_goodput_d"]["lower_bound"] is False
    assert figs["x_goodput_e"]["lower_bound"] is True
    assert figs["x_goodput_d_vs_c"]["value"] == 2.0
    assert figs["x_goodput_e_vs_d"] == {"value": 2.0, "unit": "x", "ratio": 2.0,
                                        "lower_bound": True}
    assert figs["x_disk_read_raw"]["unit"] == "GB/s"


def test_no_goodput_ratio_without_the_denominators_knee() -> None:
    case = _case({"c": [0.5, 1.0, 1.5], "d": [0.5, 1.0, 1.5]})
    case["goodput"] = goodput_rows(case, 2.0)
    assert "x_goodput_d_vs_c" not in figures([case])


def test_a_configuration_cut_short_has_no_goodput() -> None:
    case = _case({"c": [0.5, 1.0, 1.5], "d": [0.5]}, done="c")
    assert set(goodput_rows(case, 2.0)) == {"c"}


def test_the_climb_tries_every_other_rate_and_the_highest() -> None:
    assert climb_order(1) == [0]
    assert climb_order(5) == [0, 2, 4]
    assert climb_order(6) == [0, 2, 4, 5]


# ---------------------------------------------------------------------- the CLI


@pytest.mark.parametrize(("argv", "flag"), [
    (["--rates", "0,1"], "--rates"),
    (["--rates", "-0.5"], "--rates"),
    (["--rates", "1,nan"], "--rates"),
    (["--rates", "1,1"], "--rates"),
    (["--rates", ""], "--rates"),
    (["--slo-ttft-p99", "0"], "--slo-ttft-p99"),
    (["--slo-ttft-p99", "-2"], "--slo-ttft-p99"),
    (["--configs", "abx"], "--configs"),
    (["--configs", ""], "--configs"),
    (["--models", "8b-class,13b"], "--models"),
    (["--histories", "4096,-1"], "--histories"),
    (["--users", "0"], "--users"),
    (["--gpu-gib", "0"], "--gpu-gib"),
    (["--layers", "two"], "--layers"),
    (["--progress", "sometimes"], "--progress"),
    (["--tag", "a/b"], "--tag"),
    (["--pressure", "0"], "--pressure"),
    (["--duration-s", "0"], "--duration-s"),
    (["--min-requests", "0"], "--min-requests"),
    (["--max-requests", "x"], "--max-requests"),
    (["--warmup-requests", "-1"], "--warmup-requests"),
    (["--drain-s", "nan"], "--drain-s"),
    (["--deadline-s", "-5"], "--deadline-s"),
    (["--search", "bisect"], "--search"),
    (["--rates-rps", "1,-1"], "--rates-rps"),
])
def test_bad_flags_get_one_line_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and "Traceback" not in err


def test_a_gpu_pool_too_small_for_a_conversation_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY, "--histories", "48,4096", "--out", str(tmp_path), "--dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu-gib" in err, err


@pytest.mark.parametrize("content", [None, "{not json", '{"bench": "e2e", "cases": []}'])
def test_plot_of_a_bad_file_is_one_line(content: str | None, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        main(["--plot", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--plot" in err, err


def test_a_drain_within_the_slo_is_one_line(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--drain-s", "0.4", "--out", str(tmp_path), "--dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--drain-s" in err, err


# ---------------------------------------------------------------------- end to end

# Rates in requests/s (the calibrated capacity of a tiny model on a loaded CPU swings 2x
# from run to run, and the loop runs far below it anyway, bound by per-step overheads): 2/s
# is light load (each request a few ms of work) and 3000/s is far past what the loop serves
# (40/s on a loaded 2-core machine, about 150/s on an idle one).  The overload run offers
# 3000 requests within about a second and stops 1 s (the drain) after its last arrival: they
# cannot all get a first token in that time unless the loop served over 1,500 requests/s, so
# its p99 is above the 0.5 s SLO, while the light run's requests take milliseconds.  Both
# outcomes rest on orders of magnitude, not on timing.
TINY = [
    "--models", "tiny", "--layers", "2", "--histories", "48", "--rates-rps", "3000,2",
    "--configs", "dc", "--users", "4", "--rounds", "2", "--system-tokens", "16",
    "--question-tokens", "8", "--answer-tokens", "4", "--block-size", "4",
    "--gpu-gib", "0.00005", "--host-gib", "0.00003", "--disk-gib", "0.001",
    "--readers", "2", "--writers", "2", "--disk-probe-mib", "1", "--device", "cpu",
    "--machine", "cpu", "--progress", "never", "--slo-ttft-p99", "0.5", "--drain-s", "1",
    "--duration-s", "4", "--min-requests", "16", "--max-requests", "3000",
]
RUN_KEYS = {
    "ttft_p50_s", "ttft_p99_s", "ttft_p99_lower_bound", "itl_p50_s", "input_tok_per_s",
    "output_tok_per_s", "offered_input_tok_per_s", "sustained_vs_offered",
    "sustained_requests_per_s", "arrived_requests_per_s", "window_s", "tokens_gpu",
    "tokens_host", "tokens_disk", "tokens_computed", "requests", "warmup_requests",
    "measured_requests", "unfinished", "no_first_token", "seconds", "io_errors",
    "rate_index", "capacity_multiple", "requests_per_s", "users_started", "busy_skips",
    "joined_for_load",
}


def test_a_small_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert main([*TINY, "--out", str(out), "--dir", str(tmp_path / "disk")]) == 0
    (path,) = out.glob("sweep-cpu-*.json")
    results = json.loads(path.read_text())
    for key in ("bench", "machine", "date", "commit", "command", "figures", "cases",
                "goodput_table", "slo_ttft_p99_s", "method"):
        assert key in results, key
    assert results["bench"] == "sweep" and results["machine"] == "cpu"
    assert results["slo_ttft_p99_s"] == 0.5 and results["cut_short"] is None
    (case,) = results["cases"]
    assert case["case"] == "tiny-x2-h48"
    assert case["disk_read_gb_per_s"] > 0 and case["prefill_tok_per_s"] > 0
    assert results["figures"]["tiny-x2-h48_disk_read_raw"]["value"] > 0
    assert results["figures"]["tiny-x2-h48_prefill_rate"]["value"] > 0
    # Rates sorted ascending, in requests/s and input tokens/s, from the same capacity.
    assert [r["requests_per_s"] for r in case["rates"]] == pytest.approx([2, 3000])
    for r in case["rates"]:
        assert r["requests_per_s"] == pytest.approx(r["capacity_multiple"]
                                                    * case["capacity_requests_per_s"])
    assert case["warmup_requests"] == 4  # one per pool user
    assert set(case["runs"]) == {"c", "d"}
    for key, runs in case["runs"].items():
        assert [r["rate_index"] for r in runs] == [0, 1]
        light, heavy = runs
        for run in runs:
            assert set(run) >= RUN_KEYS, RUN_KEYS - set(run)
            assert run["io_errors"] == 0 and run["warmup_requests"] == 4
            assert run["ttft_p99_s"] >= run["ttft_p50_s"] > 0
            # The TTFT breakdown of the measured requests that got a first token.
            assert run["breakdown_requests"] == run["measured_requests"] - run[
                "no_first_token"]
            if run["breakdown_requests"]:
                assert run["breakdown_parts_sum_s_mean"] == pytest.approx(
                    run["breakdown_ttft_s_mean"], abs=1e-9)
            if key == "c" and run["breakdown_requests"]:  # no disk: nothing to park on
                assert run["breakdown_parked_s_mean"] == run["breakdown_prefetch_s_mean"] == 0
        # Light load: every request served, and the window sustains what was offered.
        assert light["requests"] == 16  # --min-requests: 2/s x 4 s is fewer
        assert light["unfinished"] == 0 and light["busy_skips"] == 0
        assert light["measured_requests"] == light["requests"] - 4
        assert light["breakdown_requests"] == light["measured_requests"]
        assert 0.8 <= light["sustained_vs_offered"] <= 1.2, light
        assert light["ttft_p99_s"] <= 0.5
        # Overload: it fell behind; requests cut off by the drain make p99 a lower bound.
        assert heavy["requests"] == 3000 and heavy["unfinished"] > 0
        assert heavy["sustained_vs_offered"] < 0.5
        assert heavy["ttft_p99_s"] > 0.5 and heavy["ttft_p99_lower_bound"]
        assert heavy["joined_for_load"] > 0  # every user busy: new users joined
        # The knee lies inside the sweep: goodput is the light rate.
        row = case["goodput"][key]
        assert row["status"] == "below_next" and row["run_index"] == 0
        assert row["requests_per_s"] == pytest.approx(case["rates"][0]["requests_per_s"])
        expected = goodput([r["requests_per_s"] for r in runs],
                           [r["ttft_p99_s"] for r in runs], 0.5)
        assert (row["status"], row["run_index"]) == (expected.status, expected.index)
    assert case["runs"]["c"][0]["tokens_disk"] == 0  # (c) has no disk tier
    assert {(row["case"], row["config"]) for row in results["goodput_table"]} == {
        ("tiny-x2-h48", "c"), ("tiny-x2-h48", "d")}
    # The plot, drawn with the results and again from the file alone.
    png = out / f"{path.stem}-tiny-x2-h48.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    assert main(["--plot", str(path)]) == 0
    assert png.stat().st_size > 10_000


def test_a_deadline_stops_cleanly_and_keeps_what_was_measured(tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = [*TINY, "--configs", "c", "--rates-rps", "2", "--deadline-s", "1",
            "--out", str(out), "--dir", str(tmp_path / "disk")]
    assert main(argv) == 0
    (path,) = out.glob("sweep-cpu-*.json")
    results = json.loads(path.read_text())
    assert "--deadline-s" in results["cut_short"]
    (case,) = results["cases"]
    assert case["runs"]["c"] == [] and results["goodput_table"] == []
