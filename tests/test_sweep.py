"""The offered-load sweep (bench/sweep.py): goodput from hand-made tables, the CLI's errors,
and one small sweep end to end on the CPU (tiny shapes, 2 rates, 2 configurations)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.sweep import Goodput, figures, goodput, goodput_rows, main
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


def _case(p99: dict[str, list[float]]) -> dict[str, Any]:
    rates = [0.5, 1.0, 2.0]
    return {
        "case": "x", "capacity_requests_per_s": 10.0,
        "rates": [{"capacity_multiple": m, "requests_per_s": 10 * m,
                   "input_tok_per_s": 1000 * m} for m in rates],
        "runs": {k: [{"ttft_p99_s": v} for v in vs] for k, vs in p99.items()},
        "disk_read_gb_per_s": 2.0, "prefill_tok_per_s": 5e4,
    }


def test_goodput_table_and_figures() -> None:
    case = _case({"a": [3.0, 4.0, 5.0], "c": [0.5, 3.0, 4.0], "d": [0.5, 1.0, 2.5],
                  "e": [0.5, 1.0, 1.5]})
    case["goodput"] = goodput_rows(case, 2.0)
    assert case["goodput"]["a"]["status"] == "never_met"
    assert case["goodput"]["a"]["requests_per_s"] is None
    assert case["goodput"]["c"] == {"status": "below_next", "rate_index": 0,
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
    case = _case({"c": [0.5, 1.0, 1.5], "d": [0.5]})
    assert set(goodput_rows(case, 2.0)) == {"c"}


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


# ---------------------------------------------------------------------- end to end

TINY = [
    "--models", "tiny", "--layers", "2", "--histories", "48", "--rates", "2,0.5",
    "--configs", "dc", "--users", "4", "--rounds", "2", "--system-tokens", "16",
    "--question-tokens", "8", "--answer-tokens", "4", "--block-size", "4",
    "--gpu-gib", "0.00005", "--host-gib", "0.00003", "--disk-gib", "0.001",
    "--readers", "2", "--writers", "2", "--disk-probe-mib", "1", "--device", "cpu",
    "--machine", "cpu", "--progress", "never",
]
RUN_KEYS = {
    "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "input_tok_per_s", "output_tok_per_s",
    "offered_input_tok_per_s", "sustained_vs_offered", "tokens_gpu", "tokens_host",
    "tokens_disk", "tokens_computed", "requests", "seconds", "io_errors",
    "arrived_requests_per_s", "capacity_multiple", "requests_per_s",
}


def test_a_small_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert main([*TINY, "--out", str(out), "--dir", str(tmp_path / "disk")]) == 0
    (path,) = out.glob("sweep-cpu-*.json")
    results = json.loads(path.read_text())
    for key in ("bench", "machine", "date", "commit", "command", "figures", "cases",
                "goodput_table", "slo_ttft_p99_s"):
        assert key in results, key
    assert results["bench"] == "sweep" and results["machine"] == "cpu"
    assert results["slo_ttft_p99_s"] == 2.0
    (case,) = results["cases"]
    assert case["case"] == "tiny-x2-h48"
    assert case["disk_read_gb_per_s"] > 0 and case["prefill_tok_per_s"] > 0
    assert results["figures"]["tiny-x2-h48_disk_read_raw"]["value"] > 0
    assert results["figures"]["tiny-x2-h48_prefill_rate"]["value"] > 0
    # Rates sorted ascending, in requests/s and input tokens/s, from the same capacity.
    multiples = [r["capacity_multiple"] for r in case["rates"]]
    assert multiples == [0.5, 2.0]
    for r in case["rates"]:
        assert r["requests_per_s"] == pytest.approx(r["capacity_multiple"]
                                                    * case["capacity_requests_per_s"])
        assert r["input_tok_per_s"] > r["requests_per_s"]
    assert set(case["runs"]) == {"c", "d"}
    for key, runs in case["runs"].items():
        assert len(runs) == 2
        for run in runs:
            assert set(run) >= RUN_KEYS, RUN_KEYS - set(run)
            assert run["requests"] == 8 and run["io_errors"] == 0
            assert run["ttft_p99_s"] >= run["ttft_p50_s"] > 0
        # The table agrees with the goodput function over the recorded runs.
        expected = goodput([r["requests_per_s"] for r in case["rates"]],
                           [r["ttft_p99_s"] for r in runs], 2.0)
        assert case["goodput"][key]["status"] == expected.status
        assert case["goodput"][key]["rate_index"] == expected.index
    assert case["runs"]["c"][0]["tokens_disk"] == 0  # (c) has no disk tier
    assert {(row["case"], row["config"]) for row in results["goodput_table"]} == {
        ("tiny-x2-h48", "c"), ("tiny-x2-h48", "d")}
    # The plot, drawn with the results and again from the file alone.
    png = out / f"{path.stem}-tiny-x2-h48.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    assert main(["--plot", str(path)]) == 0
    assert png.stat().st_size > 10_000
