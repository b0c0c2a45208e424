"""The offered-load sweep (bench/sweep.py): p99's interval, verdicts, the search and the
goodput claims from hand-made tables, the CLI's errors, and one small sweep end to end on the
CPU (tiny shapes, 2 rates, 2 configurations, 2 seeds), cut short and resumed."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from bench.sweep import (
    arrivals_fingerprint,
    figures,
    final_verdict,
    main,
    p99_interval,
    quantile_ci_ranks,
    ratio_row,
    summarize_case,
    verdict,
    walk,
)
from statekv.errors import UsageError

# ---------------------------------------------------------------------- p99's interval


def _below(n: int, k: int) -> Fraction:
    """P(B < k), B ~ binomial(n, 0.99), exactly."""
    p = Fraction(99, 100)
    return sum((Fraction(math.comb(n, j)) * p**j * (1 - p) ** (n - j) for j in range(k)),
               Fraction(0))


@pytest.mark.parametrize("n", [50, 200, 368, 1000])
def test_the_p99_interval_is_the_binomial_rule(n: int) -> None:
    low, high = quantile_ci_ranks(n)
    tail = Fraction(1, 40)
    assert low is not None
    # The largest rank whose order statistic lies below the p99 with >= 97.5%...
    assert _below(n, low) <= tail < _below(n, low + 1)
    # ... and the smallest above it with >= 97.5%, or none among n samples.
    if high is None:
        assert _below(n, n) < 1 - tail
    else:
        assert _below(n, high) >= 1 - tail > _below(n, high - 1)


def test_at_200_samples_the_p99_upper_end_lies_above_the_largest() -> None:
    assert quantile_ci_ranks(200) == (195, None)
    ttfts = [i / 100 for i in range(1, 201)]
    assert p99_interval(ttfts) == {"ttft_p99_ci_low_s": 1.95, "ttft_p99_ci_high_s": None,
                                   "ttft_p99_ci_ranks": [195, None]}
    assert quantile_ci_ranks(1000) == (983, 997)
    with pytest.raises(UsageError):
        quantile_ci_ranks(0)


# ---------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(("p99", "arrived", "finished", "expected"), [
    (1.0, 200, 200, "met"),
    (1.0, 200, 191, "met"),         # 0.955x sustained
    (1.0, 200, 189, "unsettled"),   # met while falling behind
    (3.0, 200, 120, "missed"),      # overload
    (3.0, 200, 210, "missed"),      # 1.05x: no sign of a backlog draining
    (3.0, 200, 244, "unsettled"),   # the 1.22x of a warm-up still draining
    (None, 200, 0, "missed"),
    (math.nan, 200, 0, "missed"),
    (1.0, 7, 6, "met"),             # one request behind is no sign either way
    (3.0, 7, 8, "missed"),
    (1.0, 0, 0, "unsettled"),
])
def test_verdicts(p99: float | None, arrived: int, finished: int, expected: str) -> None:
    assert verdict(p99, arrived, finished, 2.0) == expected


def test_a_rerun_allows_the_in_system_count_its_noise() -> None:
    # 16 arrivals, 4 in the system at the end: on the rerun 4 behind is within
    # 1 + 2 x sqrt(4) = 5...
    assert verdict(0.5, 16, 12, 2.0, (0, 4), attempt=2) == "met"
    assert verdict(0.5, 16, 10, 2.0, (0, 6), attempt=2) == "unsettled"  # 6 > 1 + 2 sqrt(6)
    # ... while at 200 arrivals and ~9 in the system the 5% decides, as the rule says.
    assert verdict(0.5, 200, 189, 2.0, (9, 9), attempt=2) == "unsettled"
    assert verdict(3.0, 200, 260, 2.0, (70, 10), attempt=2) == "unsettled"  # draining


def test_a_first_attempt_that_kept_up_by_less_than_five_percent_is_measured_again() -> None:
    # A (d) point on the H200: 219 arrivals, 205 finished (0.936x), the queue growing
    # from 34 to 47 -- within 1 + 2 x sqrt(47) = 14.7, so the allowance alone let it pass.
    # A first attempt has none: it is unsettled and measured again, longer.
    assert verdict(1.93, 219, 205, 2.0, (34, 47), attempt=1) == "unsettled"
    assert verdict(1.93, 219, 205, 2.0, (34, 47), attempt=2) == "met"
    # Draining alike: a miss that finished more than 1/0.95x of its arrivals.
    assert verdict(3.0, 200, 215, 2.0, (60, 45), attempt=1) == "unsettled"
    assert verdict(3.0, 200, 215, 2.0, (60, 45), attempt=2) == "missed"
    # One request straddling the window's end is no sign on either attempt, and a point
    # within 5% is settled on its first.
    assert verdict(1.0, 7, 6, 2.0, (0, 1), attempt=1) == "met"
    assert verdict(1.0, 200, 191, 2.0, (30, 39), attempt=1) == "met"


# ---------------------------------------------------------------------- the search

GRID = [0.5, 1.0, 2.0, 4.0]


def _search(knee: float, grid: list[float] = GRID, precision: float = 0.1,
            odd: dict[float, str] | None = None) -> tuple[list[float], Any]:
    """Run the search against a server that meets the SLO up to `knee` (`odd` overrides a
    rate's verdict); the rates it measured, in order, and its final state."""
    seen: dict[str, str] = {}
    order: list[float] = []
    while True:
        w = walk(grid, lambda m: seen.get(f"{m:.12g}"), precision)
        if w.next is None:
            return order, w
        order.append(w.next)
        seen[f"{w.next:.12g}"] = (odd or {}).get(w.next, "met" if w.next <= knee else "missed")


@pytest.mark.parametrize(("knee", "grid_points"), [
    (0.6, [1.0, 0.5]), (0.99, [1.0, 0.5]), (1.0, [1.0, 2.0]), (1.3, [1.0, 2.0]),
    (2.7, [1.0, 2.0, 4.0]), (3.9, [1.0, 2.0, 4.0]),
])
def test_the_search_brackets_the_knee_within_the_precision(
        knee: float, grid_points: list[float]) -> None:
    order, w = _search(knee)
    assert w.status == "below_next" and w.high_verdict == "missed"
    assert w.low <= knee < w.high and w.high / w.low <= 1.1
    assert len(order) == len(set(order))  # no rate twice
    # From x1 along the grid to the first change, then 3 bisections of a factor-2 bracket.
    assert order[:len(grid_points)] == grid_points and len(order) == len(grid_points) + 3


def test_the_search_when_every_rate_or_none_is_met() -> None:
    order, w = _search(10.0)
    assert order == [1.0, 2.0, 4.0] and (w.status, w.low, w.high) == ("every_rate", 4.0, None)
    # Below the grid by its first step, to 1/8 of its lowest rate, before giving up.
    order, w = _search(0.01)
    assert order == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert (w.status, w.low, w.high) == ("never_met", None, 0.0625)
    # The start is the grid rate nearest --start on a log scale.
    assert walk(GRID, lambda m: None, 0.1, start=1.6).next == 2.0
    assert walk(GRID, lambda m: None, 0.1, start=0.1).next == 0.5


@pytest.mark.parametrize("knee", [0.3, 0.1])
def test_a_knee_below_the_grid_is_still_bracketed(knee: float) -> None:
    # A grid set too high (the lowest rate already missed) still finds the goodput.
    order, w = _search(knee)
    assert w.status == "below_next" and w.low <= knee < w.high and w.high / w.low <= 1.1
    assert order[:2] == [1.0, 0.5] and len(order) == len(set(order))


def test_an_unsettled_rate_ends_the_claim_without_counting_as_a_miss() -> None:
    _order, w = _search(10.0, odd={2.0: "unsettled"})
    assert w.status == "below_unsettled" and w.high_verdict == "unsettled"
    assert w.low >= 1.0 and w.high / w.low <= 1.1


def test_a_replayed_search_takes_the_same_path() -> None:
    order, _ = _search(1.3)
    # Cut after any number of points: the verdicts recorded so far give the next rate.
    for cut in range(len(order)):
        seen = {f"{m:.12g}": "met" if m <= 1.3 else "missed" for m in order[:cut]}

        def recorded(m: float, seen: dict[str, str] = seen) -> str | None:
            return seen.get(f"{m:.12g}")

        assert walk(GRID, recorded, 0.1).next == order[cut]


def test_an_unsettled_point_is_measured_once_more() -> None:
    runs = [{"seed": 0, "capacity_multiple": 1.0, "attempt": 1, "verdict": "unsettled"}]
    assert final_verdict(runs, 0, 1.0) is None  # to be rerun
    assert final_verdict(runs, 1, 1.0) is None  # another seed: not measured
    runs.append({"seed": 0, "capacity_multiple": 1.0, "attempt": 2, "verdict": "met"})
    assert final_verdict(runs, 0, 1.0) == "met"
    runs[1]["verdict"] = "unsettled"
    assert final_verdict(runs, 0, 1.0) == "unsettled"  # twice: it stays so


def test_the_search_rejects_bad_input() -> None:
    with pytest.raises(UsageError) as err:
        walk([2.0, 1.0], lambda m: None, 0.1)
    assert err.value.field == "rates"
    with pytest.raises(UsageError) as err:
        walk([1.0], lambda m: None, 0.0)
    assert err.value.field == "precision"


# ---------------------------------------------------------------------- goodput over seeds


def _row(goodput: float | None, high: float | None, status: str = "below_next"
         ) -> dict[str, Any]:
    return {"goodput_requests_per_s": goodput, "bracket_high_requests_per_s": high,
            "status": status}


def test_a_ratio_is_claimed_only_beyond_the_spread() -> None:
    c = [_row(10.0, 10.9), _row(11.0, 12.0), _row(10.5, 11.5)]
    d = [_row(15.0, 16.0), _row(16.0, 17.0), _row(14.0, 15.0)]
    r = ratio_row(d, c)
    assert r is not None and r["claim"] == "above, beyond the spread"
    assert r["value"] == pytest.approx(15.0 / 10.5)
    assert (r["min"], r["max"]) == pytest.approx((14.0 / 11.0, 16.0 / 10.0))
    # One seed's (d) inside (c)'s brackets: within spread, whatever the medians say.
    d[2] = _row(11.5, 12.5)
    r = ratio_row(d, c)
    assert r is not None and r["claim"] == "within spread" and r["value"] > 1.3
    assert ratio_row(c, d)["claim"] == "within spread"  # type: ignore[index]
    low = [_row(5.0, 5.4), _row(5.2, 5.6)]
    assert ratio_row(low, c)["claim"] == "below, beyond the spread"  # type: ignore[index]
    # No ratio without every seed's goodput, or with a denominator that met every rate.
    assert ratio_row(d, [*c, _row(None, 0.5, "never_met")]) is None
    assert ratio_row(d, [*c, _row(40.0, None, "every_rate")]) is None
    top = ratio_row([*d, _row(40.0, None, "every_rate")], c)
    assert top is not None and top["lower_bound"]


def test_one_seed_claims_no_ratio_beyond_a_spread_it_did_not_measure() -> None:
    # Brackets far apart, but one search each: the resolution, not a spread.
    one = ratio_row([_row(15.0, 16.0)], [_row(10.0, 10.9)])
    assert one is not None and one["claim"] == "above, one seed: no spread measured"
    low = ratio_row([_row(5.0, 5.4)], [_row(10.0, 10.9), _row(11.0, 12.0)])
    assert low is not None and low["claim"] == "below, one seed: no spread measured"
    near = ratio_row([_row(10.5, 11.5)], [_row(10.0, 10.9)])
    assert near is not None and near["claim"] == "within spread"


def _case(points: dict[str, list[tuple[int, float, str]]]) -> dict[str, Any]:
    """A case whose runs are (seed, multiple, verdict) points, capacity 10 requests/s."""
    return {
        "case": "x", "capacity_requests_per_s": 10.0, "mean_prompt_tokens": 100.0,
        "rates": [{"capacity_multiple": m} for m in GRID], "seeds": [0, 1],
        "runs": {k: [{"seed": s, "capacity_multiple": m, "attempt": 1, "verdict": v}
                     for s, m, v in pts] for k, pts in points.items()},
        "disk_read_gb_per_s": 2.0, "prefill_tok_per_s": 5e4,
    }


def _climb(seed: int, knee: float) -> list[tuple[int, float, str]]:
    order, _ = _search(knee)
    return [(seed, m, "met" if m <= knee else "missed") for m in order]


def test_goodput_spread_table_and_figures() -> None:
    case = _case({"c": _climb(0, 1.0) + _climb(1, 1.05),
                  "d": _climb(0, 2.1) + _climb(1, 2.5),
                  "e": _climb(0, 1.0)})  # seed 1 not measured: cut short
    summarize_case(case, 0.1)
    assert set(case["goodput"]) == {"c", "d"}  # (e)'s search is incomplete
    c = case["goodput"]["c"]
    assert c["seeds"] == 2 and c["statuses"] == ["below_next", "below_next"]
    assert 10.0 <= c["min"] <= c["median"] <= c["max"] <= 11.0
    assert case["search"]["e"]["1"]["done"] is False
    ratio = case["ratios"]["d_vs_c"]
    assert ratio["claim"] == "above, beyond the spread" and ratio["value"] > 1.9
    figs = figures([case])
    d = figs["x_goodput_d"]
    assert d["min"] <= d["value"] <= d["max"]
    assert figs["x_goodput_d"]["ratio"] == pytest.approx(figs["x_goodput_d"]["value"] / 10,
                                                         abs=1e-3)
    assert figs["x_goodput_d_vs_c"]["claim"] == "above, beyond the spread"
    assert "x_goodput_e" not in figs and "x_goodput_e_vs_d" not in figs
    assert figs["x_disk_read_raw"]["unit"] == "GB/s"


def test_a_configuration_never_met_at_one_seed_has_no_figure() -> None:
    case = _case({"c": _climb(0, 1.0) + _climb(1, 0.01)})
    summarize_case(case, 0.1)
    assert case["goodput"]["c"]["median"] is None
    assert "x_goodput_c" not in figures([case])  # absent, not zero


def test_the_arrivals_fingerprint_names_the_schedule() -> None:
    a = arrivals_fingerprint([0.5, 1.0, 1.5])
    assert a == arrivals_fingerprint([0.5, 1.0, 1.5])
    assert a["sha256"] != arrivals_fingerprint([0.5, 1.0, 1.6])["sha256"]
    assert (a["count"], a["first_s"], a["last_s"]) == (3, 0.5, 1.5)


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
    (["--min-requests", "1"], "--min-requests"),
    (["--max-requests", "x"], "--max-requests"),
    (["--warmup-requests", "-1"], "--warmup-requests"),
    (["--drain-s", "nan"], "--drain-s"),
    (["--deadline-s", "-5"], "--deadline-s"),
    (["--seeds", "0"], "--seeds"),
    (["--seeds", "two"], "--seeds"),
    (["--precision", "0"], "--precision"),
    (["--start", "0"], "--start"),
    (["--points", "0"], "--points"),
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
# from run to run, and the loop runs far below it anyway, bound by per-step overheads): 4/s
# is light load (each request a few ms of work, a tenth of what the loop serves loaded) and
# 3000/s is far past what the loop serves (40/s on a loaded 2-core machine, about 150/s on
# an idle one).  The overload run offers 3000 measured requests within about a second and
# stops 4 s (the drain) after its last arrival: they cannot all get a first token within
# the 2 s SLO unless the loop served about 1,000 requests/s, while the light run's requests
# take milliseconds (tenths of a second on a machine loaded with other work).  Both
# outcomes rest on orders of magnitude, not on timing.  --precision 2000 leaves the bracket
# [4, 3000) as it is: no bisection (the search's tests above bisect).
TINY = [
    "--models", "tiny", "--layers", "2", "--histories", "48", "--rates-rps", "3000,4",
    "--configs", "dc", "--users", "4", "--rounds", "2", "--system-tokens", "16",
    "--question-tokens", "8", "--answer-tokens", "4", "--block-size", "4",
    "--gpu-gib", "0.00005", "--host-gib", "0.00003", "--disk-gib", "0.001",
    "--readers", "2", "--writers", "2", "--disk-probe-mib", "1", "--device", "cpu",
    "--machine", "cpu", "--progress", "never", "--slo-ttft-p99", "2", "--drain-s", "4",
    "--duration-s", "1", "--min-requests", "8", "--max-requests", "3000",
    "--precision", "2000", "--seeds", "2",
]
RUN_KEYS = {
    "ttft_p50_s", "ttft_p99_s", "ttft_p99_lower_bound", "itl_p50_s", "input_tok_per_s",
    "output_tok_per_s", "offered_input_tok_per_s", "sustained_vs_offered",
    "sustained_requests_per_s", "arrived_requests_per_s", "window_s", "tokens_gpu",
    "tokens_host", "tokens_disk", "tokens_computed", "requests", "warmup_requests",
    "measured_requests", "unfinished", "no_first_token", "seconds", "io_errors",
    "capacity_multiple", "requests_per_s", "users_started", "busy_skips",
    "joined_for_load", "seed", "attempt", "phase", "verdict", "ttft_p99_ci_low_s",
    "run_queued_on_disk_s", "run_queued_on_disk_reading_s",
    "ttft_p99_ci_high_s", "ttft_p99_ci_ranks", "warmup_balance", "warmup_steady",
    "window_arrived", "window_finished", "arrivals", "restored_slots",
    "in_system_at_window_start", "in_system_at_window_end",
}


def _expected_arrivals(seed: int, rate: float, count: int) -> dict[str, Any]:
    """The schedule a point at `rate` gets after its seed's prepare pass, built here from
    the workload alone (arrivals do not depend on the answers)."""
    from models.workloads import ChatWorkloadConfig, OpenChatWorkload

    config = ChatWorkloadConfig(num_users=4, num_rounds=2, system_prompt_tokens=16,
                                user_history_tokens=48, question_tokens=8, answer_tokens=4,
                                arrival_rate=1e6, vocab_size=512, seed=seed)
    prepared = OpenChatWorkload(config, num_requests=4)
    for r in prepared.poll(1.0):
        prepared.complete(r.request_id, [1], now=1.0)
    times = prepared.continued(arrival_rate=rate, num_requests=count).arrival_times
    return arrivals_fingerprint(times)


def test_a_small_sweep_cut_short_and_resumed(tmp_path: Path) -> None:
    out, disk = tmp_path / "results", tmp_path / "disk"
    argv = [*TINY, "--out", str(out), "--dir", str(disk)]
    # The first call, of one seed, stops after 3 points, as a deadline would; the file says
    # so.  The second resumes it with a second seed: every search gains it.
    assert main([*argv, "--seeds", "1", "--points", "3"]) == 0
    (path,) = out.glob("sweep-cpu-*.json")
    first = json.loads(path.read_text())
    assert "--points 3" in first["cut_short"] and first["cases"][0]["seeds"] == [0]
    before = [r for runs in first["cases"][0]["runs"].values() for r in runs]
    assert len(before) == 3
    assert main([*argv, "--resume", str(path)]) == 0
    assert list(out.glob("sweep-cpu-*.json")) == [path]  # extended in place
    results = json.loads(path.read_text())
    for key in ("bench", "machine", "date", "commit", "command", "figures", "cases",
                "goodput_table", "ratio_table", "slo_ttft_p99_s", "method", "signature",
                "calls"):
        assert key in results, key
    assert results["cut_short"] is None and len(results["calls"]) == 2
    assert results["calls"][0]["measured"] == 3
    (case,) = results["cases"]
    assert case["case"] == "tiny-x2-h48" and case["seeds"] == [0, 1]
    assert len(case["calibrations"]) == 2  # each call's, the first one's used
    assert case["capacity_requests_per_s"] == \
        case["calibrations"][0]["capacity_requests_per_s"]
    assert [r["requests_per_s"] for r in case["rates"]] == pytest.approx([4, 3000])
    points = [r for runs in case["runs"].values() for r in runs]
    # Every point of the first call read back as it was, none measured twice.
    assert all(p in points for p in before)
    ids = [(k, r["seed"], r["capacity_multiple"], r["attempt"])
           for k, runs in case["runs"].items() for r in runs]
    assert len(ids) == len(set(ids)) == sum(c["measured"] for c in results["calls"])
    assert sum(1 for r in points if r["attempt"] == 1) == 8  # 2 configs x 2 seeds x 2 rates
    for key, runs in case["runs"].items():
        for run in runs:
            assert set(run) >= RUN_KEYS, RUN_KEYS - set(run)
            assert run["io_errors"] == 0 and run["warmup_requests"] == 4
            # The TTFT breakdown of the measured requests that got a first token.
            assert run["breakdown_requests"] == run["measured_requests"] - run[
                "no_first_token"]
            if run["breakdown_requests"]:
                assert run["breakdown_parts_sum_s_mean"] == pytest.approx(
                    run["breakdown_ttft_s_mean"], abs=1e-9)
            if key == "c" and run["breakdown_requests"]:  # no disk: nothing to park on
                assert run["breakdown_parked_s_mean"] == run["breakdown_prefetch_s_mean"] == 0
            # The disk read during part of the time the prefetch window waited on it (none
            # of either without a disk tier).
            assert 0 <= run["run_queued_on_disk_reading_s"] <= run["run_queued_on_disk_s"]
            if key == "c":
                assert run["run_queued_on_disk_s"] == 0
            # Same seed and rate, same arrivals, in either call.
            assert run["arrivals"] == _expected_arrivals(
                run["seed"], run["requests_per_s"], run["requests"])
        light = [r for r in runs if r["requests_per_s"] < 10]
        heavy = [r for r in runs if r["requests_per_s"] > 10]
        assert {r["seed"] for r in light} == {r["seed"] for r in heavy} == {0, 1}
        for r in light:  # light load: served, and the window sustains what was offered
            assert r["verdict"] == "met", r
            assert r["measured_requests"] == 8 * r["attempt"] and r["unfinished"] == 0
            assert r["ttft_p99_s"] <= 2.0
        for r in heavy:  # overload: fell behind, cut off by the drain
            assert r["verdict"] == "missed" and r["ttft_p99_lower_bound"]
            assert r["requests"] == 3004 and r["unfinished"] > 0
            assert r["sustained_vs_offered"] < 0.5 and r["joined_for_load"] > 0
        for row in case["search"][key].values():
            assert row["done"] and row["status"] == "below_next"
            assert row["goodput_requests_per_s"] == pytest.approx(4)
            assert row["bracket_high_requests_per_s"] == pytest.approx(3000)
        g = case["goodput"][key]
        assert (g["min"], g["median"], g["max"]) == pytest.approx((4, 4, 4))
    # (d) starts every point from its prepared disk tier, restored at open; (c) has none.
    assert all(r["restored_slots"] > 0 for r in case["runs"]["d"])
    assert all(r["restored_slots"] is None and r["tokens_disk"] == 0
               for r in case["runs"]["c"])
    assert case["ratios"]["d_vs_c"]["claim"] == "within spread"
    assert results["figures"]["tiny-x2-h48_goodput_d_vs_c"]["value"] == pytest.approx(1.0)
    assert {(row["config"], row["seed"]) for row in results["goodput_table"]} == {
        ("c", 0), ("c", 1), ("d", 0), ("d", 1)}
    assert not list(disk.glob("prepared-*")) and not list(disk.glob("run-*"))
    # The plot, drawn with the results and again from the file alone.
    png = out / f"{path.stem}-tiny-x2-h48.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    assert main(["--plot", str(path)]) == 0
    assert png.stat().st_size > 10_000


def test_a_resumed_sweep_measures_a_configuration_again_keeping_its_old_points(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--remeasure: a configuration whose points a bug spoiled is searched again from the
    start in the same file; its earlier points stay there, with the reason."""
    out, disk = tmp_path / "results", tmp_path / "disk"
    argv = [*TINY, "--seeds", "1", "--out", str(out), "--dir", str(disk)]
    assert main(argv) == 0
    (path,) = out.glob("sweep-cpu-*.json")
    first = json.loads(path.read_text())
    old_d = first["cases"][0]["runs"]["d"]
    old_c = first["cases"][0]["runs"]["c"]
    assert old_d and old_c
    why = "its reads failed their checksum (a bug since fixed)"
    assert main([*argv, "--resume", str(path), "--remeasure", "d",
                 "--remeasure-why", why]) == 0
    results = json.loads(path.read_text())
    (case,) = results["cases"]
    assert case["runs"]["c"] == old_c                    # untouched, not measured again
    assert case["dropped_runs"] == [{"config": "d", "why": why, "dropped_by_call": 2,
                                     "runs": old_d}]
    new_d = case["runs"]["d"]
    assert len(new_d) == len(old_d) and all(r not in old_d for r in new_d)
    assert results["calls"][1]["remeasured"] == {"configs": "d", "why": why}
    assert results["calls"][1]["measured"] == len(new_d)
    # The flag's misuses: one line each.
    for extra, words in ((["--remeasure", "d", "--remeasure-why", why], "only with --resume"),
                         (["--resume", str(path), "--remeasure", "d"], "--remeasure-why"),
                         (["--resume", str(path), "--remeasure-why", why],
                          "only with --remeasure")):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, *extra])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
        assert words in err, err


def test_a_resume_of_another_sweep_is_one_line(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    argv = [*TINY, "--out", str(tmp_path), "--dir", str(tmp_path), "--resume", str(path)]
    for content, words in ((None, "cannot read"), ("{not", "not JSON"),
                           ('{"bench": "e2e", "cases": []}', "not a results file")):
        if content is not None:
            path.write_text(content)
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
        assert "--resume" in err and words in err, err
    # A file of the same sweep but another --configs and --min-requests: the first named.
    from bench.sweep import build_parser, signature

    other = build_parser().parse_args([*TINY, "--configs", "c", "--min-requests", "9"])
    path.write_text(json.dumps({"bench": "sweep", "cases": [], "signature": signature(other)}))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--resume" in err and "--min-requests 9, not 8" in err, err
    # Fewer seeds than the file has: one line naming --seeds (more would extend it).
    path.write_text(json.dumps({"bench": "sweep", "cases": [],
                                "signature": signature(build_parser().parse_args(
                                    [*TINY, "--seeds", "3"]))}))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--seeds" in err and "at least" in err, err
    # A --tag would name a file the resumed sweep never writes: refused, not ignored.
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--tag", "again"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--tag" in err and "leave --tag out" in err, err


def test_a_disk_tier_smaller_than_the_working_set_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY, "--disk-gib", "0.00001", "--out", str(tmp_path), "--dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "--disk-gib" in err, err


def test_a_deadline_stops_cleanly_and_keeps_what_was_measured(tmp_path: Path) -> None:
    out = tmp_path / "results"
    base = [*TINY, "--configs", "c", "--seeds", "1", "--out", str(out),
            "--dir", str(tmp_path / "disk")]
    assert main([*base, "--deadline-s", "1"]) == 0
    (path,) = out.glob("sweep-cpu-*.json")
    results = json.loads(path.read_text())
    assert "--deadline-s" in results["cut_short"]
    (case,) = results["cases"]
    assert case["runs"]["c"] == [] and case["goodput"] == {}
    assert results["goodput_table"][0]["done"] is False
    # The file a deadline left resumes cleanly (without the deadline) to a finished search.
    assert main([*base, "--resume", str(path)]) == 0
    results = json.loads(path.read_text())
    (case,) = results["cases"]
    assert results["cut_short"] is None and case["search"]["c"]["0"]["done"]
    assert [r["requests_per_s"] for r in case["runs"]["c"]] in (
        pytest.approx([4, 3000]), pytest.approx([4, 4, 3000]))  # a rerun of an unsettled 4/s


def test_cuda_graphs_without_cuda_is_one_line(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--cuda-graphs", "--out", str(tmp_path), "--dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--cuda-graphs" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("sweep-*.json")), "a refused sweep wrote a results file"


def test_a_file_measured_before_cuda_graphs_were_a_flag_resumes_as_eager(
    tmp_path: Path,
) -> None:
    # Files measured before --cuda-graphs joined the signature have no such field: their
    # points ran the eager pass, so an eager resume is theirs and a graph resume is not.
    from bench.sweep import SweepError, build_parser, read_resumed, signature

    old = signature(build_parser().parse_args(TINY))
    del old["cuda_graphs"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"bench": "sweep", "cases": [], "signature": old}))
    assert read_resumed(path, build_parser().parse_args(TINY))["signature"] == old
    with pytest.raises(SweepError, match="measured with --cuda-graphs False, not True"):
        read_resumed(path, build_parser().parse_args([*TINY, "--cuda-graphs"]))


def test_a_file_measured_before_page_waits_resumes_only_with_every_copy_waited_for(
    tmp_path: Path,
) -> None:
    # Points measured before --compute-waits existed waited for every copy: only a sweep
    # that keeps doing so (the default, all) may add points to them.
    from bench.sweep import SweepError, build_parser, read_resumed, signature

    old = signature(build_parser().parse_args(TINY))
    del old["compute_waits"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"bench": "sweep", "cases": [], "signature": old}))
    assert read_resumed(path, build_parser().parse_args(TINY))
    with pytest.raises(SweepError, match="measured with --compute-waits all, not pages"):
        read_resumed(path, build_parser().parse_args([*TINY, "--compute-waits", "pages"]))


def test_a_file_measured_before_copy_kernel_resumes_only_with_the_engines_choice(
    tmp_path: Path,
) -> None:
    # Points measured before --copy-kernel existed let the copy engine choose (auto).
    from bench.sweep import SweepError, build_parser, read_resumed, signature

    old = signature(build_parser().parse_args(TINY))
    del old["copy_kernel"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"bench": "sweep", "cases": [], "signature": old}))
    assert read_resumed(path, build_parser().parse_args(TINY))
    with pytest.raises(SweepError, match="measured with --copy-kernel auto, not off"):
        read_resumed(path, build_parser().parse_args([*TINY, "--copy-kernel", "off"]))


def test_a_file_measured_before_the_foreground_resumes_only_with_it_off(
    tmp_path: Path,
) -> None:
    # Points measured before the serving loop held the cache's foreground ran without it:
    # only a sweep that keeps it off (--foreground off) may add points to them.
    from bench.sweep import SweepError, build_parser, read_resumed, signature

    old = signature(build_parser().parse_args([*TINY, "--foreground", "off"]))
    del old["foreground"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"bench": "sweep", "cases": [], "signature": old}))
    assert read_resumed(path, build_parser().parse_args([*TINY, "--foreground", "off"]))
    with pytest.raises(SweepError, match="measured with --foreground off, not auto"):
        read_resumed(path, build_parser().parse_args(TINY))


def test_a_new_sweep_never_replaces_an_earlier_ones_file(tmp_path: Path) -> None:
    """Two fresh sweeps of one day and tag (an A/B run twice in one call): each keeps its own
    file, the second named -2, and each file holds its own run's points."""
    out, disk = tmp_path / "results", tmp_path / "disk"
    argv = [*TINY, "--out", str(out), "--dir", str(disk), "--seeds", "1", "--points", "1",
            "--tag", "ab"]
    assert main(argv) == 0
    assert main(argv) == 0
    files = sorted(out.glob("sweep-cpu-*-ab*.json"))
    assert [f.name.split("-ab")[1] for f in files] == ["-2.json", ".json"]
    for f in files:
        doc = json.loads(f.read_text())
        assert len(doc["calls"]) == 1
        assert sum(len(runs) for runs in doc["cases"][0]["runs"].values()) == 1


def test_points_run_with_the_startup_heap_frozen_as_the_server_does_unless_told_not_to(
    tmp_path: Path,
) -> None:
    # `statekv serve` freezes its start-up heap; the sweep measures what it serves, so its
    # points run frozen too.  A file measured before the flag (no freeze) resumes only
    # with --no-gc-freeze.
    from bench.sweep import SweepError, build_parser, read_resumed, signature

    assert build_parser().parse_args(TINY).gc_freeze is True
    assert build_parser().parse_args([*TINY, "--no-gc-freeze"]).gc_freeze is False
    old = signature(build_parser().parse_args(TINY))
    del old["gc_freeze"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"bench": "sweep", "cases": [], "signature": old}))
    assert read_resumed(path, build_parser().parse_args([*TINY, "--no-gc-freeze"]))
    with pytest.raises(SweepError, match="measured with --gc-freeze False, not True") as info:
        read_resumed(path, build_parser().parse_args(TINY))
    assert "(--no-gc-freeze)" in str(info.value)
