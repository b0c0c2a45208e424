"""Offered-load sweep: TTFT, throughput and goodput of configurations a-e, light to overload.

    python -m bench.sweep --models 70b-class --histories 4096 --pressure 3 --configs cd \\
        [--rates 0.5,1,2,4] [--seeds 3] [--precision 0.1] [--min-requests 200] \\
        [--slo-ttft-p99 2] [--deadline-s 530] [--resume FILE]
    python -m bench.sweep --plot bench/results/sweep-h200-YYYYMMDD.json

As vLLM's serving benchmark and LMBenchmark do it: for each layer shape and history length
(a *case*), one seeded multi-round chat is served by each configuration of bench/e2e.py (a no
reuse, b GPU-only prefix cache, c GPU + host, d GPU + host + disk, e the same disk tier with
synchronous I/O), at the same pool sizes, at offered rates searched for each configuration's
*goodput*: the highest rate at which TTFT p99 meets the SLO.

**Open loop.**  Arrivals come from a seeded Poisson process fixed before the run
(models.workloads.OpenChatWorkload): the load offered does not wait on the server.  Each
arrival is the next round of the free user who asked longest ago, so a user's rounds never
overlap; when every user waits for an answer a new user joins.  At a given rate and seed
every configuration gets the same arrival times, and the same requests as long as it keeps
up (``busy_skips`` and ``joined_for_load`` count where a run left that common schedule).
The pool has enough users for a KV working set of ``--pressure`` times GPU + host.

**Prepared, then warmed, then measured.**  Per configuration and seed the conversation's cold
start -- every pool user's first round, a burst of full prefills that no steady state has --
is served once, as fast as the configuration can (*prepare*); its disk tier (d, e) is closed
and kept (under ``--dir``: ``prepared-*``, and each run's ``run-*`` copy, removed when done;
a killed sweep's at the next start).  Every rate's run then starts from a copy of that
directory, restored at open (statekv's persistence, ``persist=True``), and from the
conversations where the prepare left them (OpenChatWorkload.continued): the users' next
rounds, their histories on disk.  The run's first ``--warmup-requests`` (default one per
pool user) refill the GPU and host tiers at the offered rate and are not measured; the
balance of completions over arrivals in the warm-up's second half is recorded
(``warmup_balance``, ``warmup_steady`` when within 0.95-1/0.95).  Then at least
``--min-requests`` (default 200) requests are measured, or ``rate x --duration-s`` when
more (at most ``--max-requests``).  A run stops ``--drain-s`` after its last arrival: a
request without its first token by then counts with the time it waited, and its run's TTFT
p99 is flagged as a lower bound (a certain miss: the drain is above the SLO).

**p99's confidence interval.**  With n measured TTFTs, the number below the true p99 is
binomial(n, 0.99); the distribution-free 95% interval runs between the order statistics at
that binomial's 2.5% and 97.5% quantiles, recorded with every point (``ttft_p99_ci_*``; the
upper end is null when it lies above the largest sample: n < 368 for a 97.5% one-sided end,
so at n = 200 the interval is [X(195), above the maximum)).  The verdict uses the point
estimate; the interval says how far to trust it.

**Verdicts.**  ``met``: TTFT p99 <= ``--slo-ttft-p99`` and the measured window sustained >=
0.95x of its offered load (requests finished in the window / requests that arrived in it).
``missed``: p99 over the SLO and <= 1/0.95x sustained.  ``unsettled``: met while falling
behind (< 0.95x: the window ended before the backlog showed), or missed while draining a
backlog from before the window (> 1/0.95x): neither counts as a miss.  (One request
straddling the window's end is no sign either way.)  An unsettled point is run once more
with twice the measured requests; there a difference between arrivals and completions
within the in-system count's own noise -- one request plus twice the square root of the
requests in the system at the window's start or end -- is no sign either way either; if it
is still unsettled it stays so, and the search treats it as the end of what can be claimed
(goodput status ``below_unsettled``).

**Search.**  Per configuration and seed: start at the rate of ``--rates`` (multiples of the
case's recompute capacity, factor 2 apart by default; or ``--rates-rps``) nearest ``--start``
(default x1), climb the grid while it is met or go down it until a rate is met (below its
lowest rate too, by its first step, down to 1/8 of that rate), then bisect
geometrically between the last rate met and the lowest above it not met until the two are
within ``--precision`` (default 10%).  Rates below the start are measured only when the
start is not met: the search assumes what bisection does, that a rate met has every lower
rate met too.  Goodput is the last rate met; status ``below_next`` (the bracket's top
missed), ``below_unsettled``, ``every_rate`` (no grid rate missed: a lower bound),
``never_met`` (no rate down to 1/8 of the grid's lowest was met: no figure).

**Seeds.**  ``--seeds N`` repeats every search with seeds ``--seed`` .. ``--seed + N - 1``
(another conversation and arrival schedule); per configuration the goodput's min / median /
max over seeds is reported.  A ratio of two configurations' goodputs ((d)/(c), (e)/(d)) is
the ratio of medians with its spread (min/max .. max/min), and it is *claimed* only beyond
the spread: (d) above (c) when every seed's (d) bracket lies above every seed's (c) bracket
(the lowest (d) goodput above the highest rate (c) did not meet); otherwise "within spread".
With one seed on either side there is no spread to be beyond ("one seed: no spread
measured"): a search's bracket is its resolution only, and one seed's point can meet in one
run and miss in the next.

**Resume.**  The results file (shared/BENCH_FORMAT.md, ``sweep-<machine>-<date>[-tag].json``
in ``--out``) is rewritten after every point, so a sweep cut short (``--deadline-s``,
``--points``, a kill) keeps what it measured.  ``--resume FILE`` reads it back and goes on:
the same flags are required (one line naming the first that differs; ``--seeds`` may grow,
adding seeds to every search), the calibration of
the first call is kept (so a rate and a seed give the same arrivals), every point measured is
read back, not rerun, and each search continues where it stopped; the file is extended in
place.  Each call's own calibration is recorded beside it.  ``--remeasure CONFIGS`` (with
``--remeasure-why TEXT``) searches those configurations again from the start: their earlier
points move to the case's ``dropped_runs`` with the reason and the call that dropped them
(the file stays the history of what was measured), for points a bug since fixed spoiled.

**Rates** are multiples of the case's *recompute capacity*, calibrated in the first call: the
model's prefill rate at the case's context over the tokens of a request computed in full
(serving.recompute_capacity): about where (a) saturates; configurations that reuse saturate
higher.  One PNG per case (TTFT p99 and sustained throughput against offered load, the median
over seeds with min-max bars, goodput spread at the SLO line) is drawn next to the file when
matplotlib is installed, or later from the file with ``--plot``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from tqdm import tqdm

from bench.flags import (
    OneLineParser,
    comma_list,
    int_at_least,
    positive_number,
    results_tag,
    shape_preset,
)
from bench.gc_pauses import collector_watched
from bench.plots import load_results
from bench.results_files import machine_name, source_commit, unused_path
from bench.serving import (
    CONFIGS,
    NAMES,
    add_run_flags,
    breakdown_line,
    budgets_for,
    chat_config,
    config_letters,
    full_reuse_capacity,
    mean_prompt_tokens,
    pool_blocks,
    prefill_rate,
    pyplot,
    recompute_capacity,
    residency_line,
    run_config,
    steady_summary,
    step_parts_line,
    window_ttfts,
)
from statekv.errors import UsageError

CALIBRATION_CHUNK: Final = 2048
"""Tokens per forward pass of the prefill calibration: the serving loop's prefill chunk."""

SETTLED: Final = 0.95
"""A met point must sustain this fraction of its offered load, and a missed one at most its
inverse, or the point is unsettled."""

QUANTILE: Final = 0.99
CONFIDENCE: Final = 0.95

PREPARE_RATE: Final = 1e6
"""Arrivals per second of the prepare pass: every pool user's first round at once."""

RATIO_PAIRS: Final = (("d", "c"), ("e", "d"))

BELOW_GRID: Final = 8.0
"""How far below its lowest rate a search may go, as a divisor of that rate."""
GOODPUT_STATUSES: Final = ("below_next", "below_unsettled", "every_rate", "never_met")


# ---------------------------------------------------------------------- statistics


def _log_binomial_pmf(k: int, n: int, p: float) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p))


def quantile_ci_ranks(n: int, q: float = QUANTILE, confidence: float = CONFIDENCE
                      ) -> tuple[int | None, int | None]:
    """1-based ranks (l, u) of the order statistics X(l) <= X(u) that bound the `q` quantile
    of a continuous distribution with at least `confidence`, from n samples, equal-tailed.

    The number B of samples below the true quantile is binomial(n, q); X(l) <= quantile iff
    B >= l, and X(u) >= quantile iff B < u.  l is the largest rank with P(B < l) <= alpha/2,
    u the smallest with P(B < u) >= 1 - alpha/2.  None where no sample bounds that side: l
    below 1, or u above n (the interval reaches past the largest sample).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError("n", f"must be an integer >= 1, got {n!r}")
    if not 0 < q < 1 or not 0 < confidence < 1:
        raise UsageError("q", f"q and confidence must lie in (0, 1), got {q!r}, {confidence!r}")
    tail = (1 - confidence) / 2
    below = 0.0  # P(B < k) for the rank k of the loop
    low: int | None = None
    high: int | None = None
    for k in range(1, n + 1):
        below += math.exp(_log_binomial_pmf(k - 1, n, q))
        if below <= tail:
            low = k
        if below >= 1 - tail:
            high = k
            break
    return low, high


def p99_interval(ttfts: Sequence[float]) -> dict[str, Any]:
    """The p99's distribution-free 95% interval over ascending `ttfts` (see
    quantile_ci_ranks); None ends lie outside the samples."""
    if not ttfts:
        return {"ttft_p99_ci_low_s": None, "ttft_p99_ci_high_s": None,
                "ttft_p99_ci_ranks": [None, None]}
    low, high = quantile_ci_ranks(len(ttfts))
    return {"ttft_p99_ci_low_s": ttfts[low - 1] if low else None,
            "ttft_p99_ci_high_s": ttfts[high - 1] if high else None,
            "ttft_p99_ci_ranks": [low, high]}


def verdict(p99: float | None, arrived: int, finished: int, slo: float,
            in_system: tuple[int, int] = (0, 0), *, attempt: int = 1) -> str:
    """met, missed or unsettled (see the module docstring), from the TTFT p99, the requests
    that arrived in and finished in the measured window, the requests in the system at
    the window's start and end, and which attempt at the rate this is.  A p99 that is None
    or NaN (nothing measured got a first token) is over the SLO.

    Falling behind (or draining) counts when it exceeds 5% of the arrivals and one request
    straddling the window's end.  On a rerun (`attempt` >= 2, twice the requests) it must
    also exceed the in-system count's own noise: arrivals minus completions is that count's
    change over the window, which in a steady state moves by about its square root (twice
    that is allowed).  A first attempt gets no such allowance: a point that kept up by less
    than 5% is unsettled and measured again, longer, where a real backlog has twice the
    time to show and the noise does not grow (a (d) point at 25.6 req/s once passed at
    0.936x sustained on the allowance alone, its queue growing from 34 to 47).  At 200
    measured requests the 5% decides wherever fewer than about 20 requests are in the
    system.
    """
    over = p99 is None or math.isnan(p99) or p99 > slo
    if arrived < 1:
        return "unsettled"
    behind = arrived - finished
    noise = 1 + (2 * math.sqrt(max(0, *in_system)) if attempt >= 2 else 0)
    if not over:
        return "met" if behind <= max((1 - SETTLED) * arrived, noise) else "unsettled"
    return "missed" if -behind <= max((1 / SETTLED - 1) * arrived, noise) else "unsettled"


def window_counts(run: Any, arrival_times: Sequence[float], warmup: int) -> tuple[int, int]:
    """(requests that arrived, requests that finished) in the measured window, as
    serving.steady_summary's ``sustained_vs_offered`` counts them."""
    start, end = arrival_times[warmup], min(arrival_times[-1], run.seconds)
    arrived = sum(1 for t in arrival_times if start <= t < end)
    finished = sum(1 for r in run.results
                   if r.finished is not None and start <= r.finished < end)
    return arrived, finished


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---------------------------------------------------------------------- the search


@attrs.frozen(kw_only=True)
class Walk:
    """Where a configuration's search stands, replayed from its verdicts."""

    next: float | None
    """The next rate to measure (a multiple), None when the search is complete."""
    phase: str | None = None
    """grid or bisect, for `next`."""
    status: str | None = None
    """Once complete: one of GOODPUT_STATUSES."""
    low: float | None = None
    """The goodput: the last rate met (None: never met)."""
    high: float | None = None
    """The lowest rate above `low` not met (None: every rate was met)."""
    high_verdict: str | None = None


def walk(grid: Sequence[float], verdict_at: Callable[[float], str | None],
         precision: float, start: float = 1.0) -> Walk:
    """Replay a search over `grid` (ascending multiples) from the verdicts recorded so far.

    `verdict_at(rate)` is the final verdict at a rate (met, missed, unsettled) or None when
    it is still to be measured.  The search starts at the grid rate nearest `start` (on a
    log scale); from a rate met it climbs the grid to the first rate not met, from one not
    met it goes down to the first rate met (below the grid's lowest rate too, by the grid's
    first step, as far as 1/BELOW_GRID of it).  Then it halves (geometrically) the bracket
    between the last rate met and the lowest above it not met until high / low <= 1 +
    precision.  A pure function: a search cut short and resumed takes the same path from
    the same verdicts.
    """
    if not grid or any(not b > a for a, b in itertools.pairwise(grid)):
        raise UsageError("rates", f"must be a non-empty, strictly ascending list, got {grid}")
    if not (math.isfinite(precision) and precision > 0):
        raise UsageError("precision", f"must be a finite number > 0, got {precision!r}")
    if not (math.isfinite(start) and start > 0):
        raise UsageError("start", f"must be a finite rate > 0, got {start!r}")
    first = min(range(len(grid)), key=lambda i: abs(math.log(grid[i] / start)))
    low: float | None = None
    high: float | None = None
    high_verdict: str | None = None
    v = verdict_at(grid[first])
    if v is None:
        return Walk(next=grid[first], phase="grid")
    if v == "met":
        low = grid[first]
        for rate in grid[first + 1:]:
            v = verdict_at(rate)
            if v is None:
                return Walk(next=rate, phase="grid")
            if v != "met":
                high, high_verdict = rate, v
                break
            low = rate
        if high is None:
            return Walk(next=None, status="every_rate", low=low, high=None)
    else:
        high, high_verdict = grid[first], v
        for rate in [*reversed(grid[:first]), *below_grid(grid)]:
            v = verdict_at(rate)
            if v is None:
                return Walk(next=rate, phase="grid")
            if v == "met":
                low = rate
                break
            high, high_verdict = rate, v
        if low is None:
            return Walk(next=None, status="never_met", low=None, high=high,
                        high_verdict=high_verdict)
    while high / low > 1 + precision:
        mid = math.sqrt(low * high)
        v = verdict_at(mid)
        if v is None:
            return Walk(next=mid, phase="bisect")
        if v == "met":
            low = mid
        else:
            high, high_verdict = mid, v
    return Walk(next=None, status="below_next" if high_verdict == "missed"
                else "below_unsettled", low=low, high=high, high_verdict=high_verdict)


def below_grid(grid: Sequence[float]) -> list[float]:
    """The rates a search goes down to past the grid's lowest, so that a grid set too high
    still finds a goodput: on by the grid's first step, to 1/BELOW_GRID of its lowest."""
    factor = grid[1] / grid[0] if len(grid) > 1 else 2.0
    rates: list[float] = []
    rate = grid[0] / factor
    while rate >= grid[0] / BELOW_GRID * (1 - 1e-9):
        rates.append(rate)
        rate /= factor
    return rates


def rate_key(multiple: float) -> str:
    """A rate's identity across a JSON round trip and a replayed bisection."""
    return f"{multiple:.12g}"


def attempts_at(runs: Sequence[dict[str, Any]], seed: int, multiple: float
                ) -> list[dict[str, Any]]:
    key = rate_key(multiple)
    return sorted((r for r in runs if r["seed"] == seed
                   and rate_key(r["capacity_multiple"]) == key), key=lambda r: r["attempt"])


def final_verdict(runs: Sequence[dict[str, Any]], seed: int, multiple: float) -> str | None:
    """The verdict at a rate once its measuring is complete: None when it was never measured,
    or when its only attempt was unsettled (it is run once more, longer)."""
    tries = attempts_at(runs, seed, multiple)
    if not tries:
        return None
    last: str = tries[-1]["verdict"]
    if last == "unsettled" and len(tries) < 2:
        return None
    return last


def search_state(case: dict[str, Any], key: str, seed: int, precision: float) -> Walk:
    runs = case["runs"][key]
    grid = [r["capacity_multiple"] for r in case["rates"]]
    return walk(grid, lambda m: final_verdict(runs, seed, m), precision,
                case.get("search_start", 1.0))


# ---------------------------------------------------------------------- goodput


@attrs.frozen(kw_only=True)
class Goodput:
    """The goodput over one ladder of rates (bench.replicas' comparison)."""

    rate: float | None
    """The offered rate (the unit of the rates given), None when never met."""
    index: int | None
    """Its position among the rates."""
    status: str


def goodput(rates: Sequence[float], ttft_p99: Sequence[float | None], slo: float) -> Goodput:
    """The highest of `rates` (ascending) at which, and below which, TTFT p99 <= `slo`:
    status below_next, every_rate or never_met.  A p99 that is None or NaN (nothing
    finished) is a miss.
    """
    if isinstance(slo, bool) or not isinstance(slo, int | float) or not (
        math.isfinite(slo) and slo > 0
    ):
        raise UsageError("slo", f"must be a finite number of seconds > 0, got {slo!r}")
    if len(rates) != len(ttft_p99):
        raise UsageError("ttft_p99", f"has {len(ttft_p99)} values for {len(rates)} rates")
    if not rates:
        raise UsageError("rates", "a sweep needs at least one rate")
    if any(not b > a for a, b in itertools.pairwise(rates)):
        raise UsageError("rates", f"must be strictly ascending, got {list(rates)}")
    met = None
    for i, p99 in enumerate(ttft_p99):
        if p99 is None or math.isnan(p99) or p99 > slo:
            break
        met = i
    if met is None:
        return Goodput(rate=None, index=None, status="never_met")
    status = "every_rate" if met == len(rates) - 1 else "below_next"
    return Goodput(rate=rates[met], index=met, status=status)


def goodput_row(g: Goodput, rates: Sequence[dict[str, Any]], index_key: str) -> dict[str, Any]:
    """A results file's goodput row: the status, the index of the rate it names (under
    `index_key`) and that rate's requests/s, input tokens/s and capacity multiple (None
    where no rate met the SLO)."""
    row: dict[str, Any] = {"status": g.status, index_key: g.index, "requests_per_s": None,
                           "input_tok_per_s": None, "capacity_multiple": None}
    if g.index is not None:
        rate = rates[g.index]
        row.update(requests_per_s=rate["requests_per_s"],
                   input_tok_per_s=rate["input_tok_per_s"],
                   capacity_multiple=rate["capacity_multiple"])
    return row



def search_row(case: dict[str, Any], w: Walk) -> dict[str, Any]:
    """One configuration and seed's search: done, its status and its bracket in capacity
    multiples, requests/s and input tokens/s."""
    capacity: float = case["capacity_requests_per_s"]
    prompt: float = case["mean_prompt_tokens"]
    row: dict[str, Any] = {"done": w.next is None, "status": w.status,
                           "high_verdict": w.high_verdict}
    for name, m in (("goodput", w.low), ("bracket_high", w.high)):
        row[f"{name}_multiple"] = m
        row[f"{name}_requests_per_s"] = None if m is None else m * capacity
        row[f"{name}_input_tok_per_s"] = None if m is None else m * capacity * prompt
    row["bracket_ratio"] = (w.high / w.low if w.low is not None and w.high is not None
                            else None)
    return row


def spread_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """min / median / max goodput over seeds' complete searches; values only where every
    seed has a goodput figure."""
    values = [r["goodput_requests_per_s"] for r in rows]
    out: dict[str, Any] = {"seeds": len(rows), "statuses": [r["status"] for r in rows],
                           "min": None, "median": None, "max": None,
                           "lower_bound": any(r["status"] == "every_rate" for r in rows)}
    if rows and all(v is not None for v in values):
        out.update(min=min(values), median=_median(values), max=max(values))
    return out


def ratio_row(num: Sequence[dict[str, Any]], den: Sequence[dict[str, Any]]
              ) -> dict[str, Any] | None:
    """Goodput ratio num / den over seeds: medians' ratio, spread, and the claim.

    None unless both have a goodput at every seed and den's knee lies inside the sweep at
    every seed (an every_rate denominator is only a lower bound).
    """
    nv = [r["goodput_requests_per_s"] for r in num]
    dv = [r["goodput_requests_per_s"] for r in den]
    if not num or not den or any(v is None for v in [*nv, *dv]):
        return None
    if any(r["bracket_high_requests_per_s"] is None for r in den):
        return None
    value = _median(nv) / _median(dv)
    # Brackets: each seed's knee lies in [goodput, bracket_high); a claim needs every one of
    # num's above every one of den's (or below), resolution and seed-to-seed spread both.
    num_high = [math.inf if r["bracket_high_requests_per_s"] is None
                else r["bracket_high_requests_per_s"] for r in num]
    den_high = [r["bracket_high_requests_per_s"] for r in den]
    if min(nv) >= max(den_high):
        claim = "above"
    elif max(num_high) <= min(dv):
        claim = "below"
    else:
        claim = "within spread"
    if claim != "within spread":
        # One seed's brackets give the search's resolution, not the spread: the same seed's
        # point has met in one run and missed in the next (16k-token histories on the H200:
        # TTFT p99 0.81 s and 3.07 s at x0.5).  No claim without a spread to be beyond.
        claim += (", beyond the spread" if min(len(num), len(den)) >= 2
                  else ", one seed: no spread measured")
    return {"value": value, "min": min(nv) / max(dv), "max": max(nv) / min(dv),
            "claim": claim, "lower_bound": any(r["status"] == "every_rate" for r in num)}


def summarize_case(case: dict[str, Any], precision: float) -> None:
    """Fill `case`'s search, goodput and ratio tables from its runs."""
    case["search"] = {
        key: {str(seed): search_row(case, search_state(case, key, seed, precision))
              for seed in case["seeds"]}
        for key in case["runs"]}
    complete = {key: [row for row in by_seed.values()]
                for key, by_seed in case["search"].items()
                if all(row["done"] for row in by_seed.values())}
    case["goodput"] = {key: spread_row(rows) for key, rows in complete.items()}
    case["ratios"] = {}
    for num, den in RATIO_PAIRS:
        if num in complete and den in complete:
            row = ratio_row(complete[num], complete[den])
            if row is not None:
                case["ratios"][f"{num}_vs_{den}"] = row


def figures(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The BENCH_FORMAT figures: same-run limits, goodput (median over seeds, with its
    spread) against the recompute capacity, and the ratios with their claim."""
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        name = case["case"]
        out[f"{name}_disk_read_raw"] = {"value": round(case["disk_read_gb_per_s"], 3),
                                        "unit": "GB/s"}
        out[f"{name}_prefill_rate"] = {"value": round(case["prefill_tok_per_s"], 1),
                                       "unit": "tok/s"}
        capacity = case["capacity_requests_per_s"]
        for key, g in case.get("goodput", {}).items():
            if g["median"] is None:
                continue  # never met at some seed: absent, not zero
            out[f"{name}_goodput_{key}"] = {
                "value": round(g["median"], 3), "unit": "requests/s",
                "min": round(g["min"], 3), "max": round(g["max"], 3), "seeds": g["seeds"],
                "limit": round(capacity, 3),
                "limit_name": "recompute capacity (prefill rate / full-request tokens), "
                              "calibrated in the sweep's first call",
                "ratio": round(g["median"] / capacity, 3), "lower_bound": g["lower_bound"]}
        for pair, r in case.get("ratios", {}).items():
            out[f"{name}_goodput_{pair}"] = {
                "value": round(r["value"], 3), "unit": "x", "ratio": round(r["value"], 3),
                "min": round(r["min"], 3), "max": round(r["max"], 3), "claim": r["claim"],
                "lower_bound": r["lower_bound"]}
    return out


# ---------------------------------------------------------------------- flags


DEFAULT_RATES: Final = (0.5, 1.0, 2.0, 4.0)
"""Multiples of the recompute capacity, factor 2 apart (the bisection refines the knee):
half of (a)'s ceiling to past full reuse."""

SIGNATURE: Final = (
    "models", "histories", "rates", "rates_rps", "start", "seeds", "seed", "precision",
    "duration_s", "min_requests", "max_requests", "warmup_requests", "drain_s",
    "slo_ttft_p99", "pressure", "layers", "users", "rounds", "system_tokens",
    "question_tokens", "answer_tokens", "block_size", "gpu_gib", "host_gib", "disk_gib",
    "readers", "writers", "configs", "prefetch_ahead", "reclaim_prefetched",
    "no_cost_aware", "machine", "cuda_graphs", "foreground", "compute_waits", "gc_freeze",
    "copy_kernel",
)
"""The flags a resumed sweep must share with the file it resumes: what a point measures."""

SIGNATURE_BEFORE: Final[dict[str, Any]] = {"cuda_graphs": False, "foreground": "off",
                                           "compute_waits": "all", "gc_freeze": False,
                                           "copy_kernel": "auto"}
"""What a flag added to the signature later was in files measured before it existed."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    n1 = int_at_least(1)
    p.add_argument("--models", type=comma_list(shape_preset), default=["70b-class", "8b-class"],
                   help="layer shapes (models/config.py presets), comma-separated")
    p.add_argument("--histories", type=comma_list(int_at_least(0)), default=[4096, 16384],
                   help="per-user history lengths in tokens, comma-separated")
    p.add_argument("--rates", type=comma_list(positive_number), default=list(DEFAULT_RATES),
                   help="the search's grid: offered rates as multiples of the calibrated "
                        "recompute capacity")
    p.add_argument("--rates-rps", type=comma_list(positive_number), default=None,
                   help="the grid in requests/s instead (the same for every case)")
    p.add_argument("--start", type=positive_number, default=1.0,
                   help="the grid rate (a capacity multiple) each search starts at: up the "
                        "grid from there while met, down while not")
    p.add_argument("--precision", type=positive_number, default=0.1,
                   help="bisect until the rate met and the rate missed are within this "
                        "fraction of each other")
    p.add_argument("--seeds", type=n1, default=1,
                   help="repeat every search with this many seeds (--seed, --seed + 1, ...)")
    p.add_argument("--duration-s", type=positive_number, default=8.0,
                   help="seconds of measured arrivals per point (rate x this many "
                        "requests, when more than --min-requests)")
    p.add_argument("--min-requests", type=int_at_least(2), default=200,
                   help="measured requests per point at least (after the warm-up)")
    p.add_argument("--max-requests", type=n1, default=2000,
                   help="measured requests per point at most (overload points)")
    p.add_argument("--warmup-requests", type=int_at_least(0), default=None,
                   help="requests of a point's run before the measured ones (default: the "
                        "pool's users)")
    p.add_argument("--drain-s", type=positive_number, default=None,
                   help="a run stops this long after its last arrival (default: 2 x SLO)")
    p.add_argument("--deadline-s", type=positive_number, default=None,
                   help="stop cleanly this long after the start, keeping what was measured")
    p.add_argument("--points", type=n1, default=None,
                   help="stop cleanly after measuring this many points (resume with "
                        "--resume)")
    p.add_argument("--resume", type=Path, default=None, metavar="RESULTS_JSON",
                   help="go on with the sweep of this results file, extending it")
    p.add_argument("--remeasure", type=config_letters, default=None, metavar="CONFIGS",
                   help="with --resume: search these configurations again from the start "
                        "(their earlier points stay in the file, under dropped_runs, with "
                        "the reason given as --remeasure-why)")
    p.add_argument("--remeasure-why", default=None, metavar="TEXT",
                   help="why --remeasure drops the configurations' points (kept in the file)")
    p.add_argument("--slo-ttft-p99", type=positive_number, default=2.0,
                   help="goodput's SLO: TTFT p99 in seconds")
    p.add_argument("--disk-probe-mib", type=positive_number, default=2048.0,
                   help="bytes moved by the raw disk read-rate measurement")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="freeze the collector's generations before each point's run, as "
                        "`statekv serve` (and vLLM's engine) does once started: a full "
                        "collection then walks only the objects made since (the default "
                        "since 2026-12-07; --no-gc-freeze for the method before, and to "
                        "resume its files)")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bars (auto: when stderr is a terminal)")
    p.add_argument("--tag", type=results_tag, default=None,
                   help="appended to the results file's name (runs of one day apart)")
    p.add_argument("--plot", type=Path, default=None, metavar="RESULTS_JSON",
                   help="only draw the PNGs of an existing results file")
    p.add_argument("--pressure", type=positive_number, default=3.0,
                   help="without --users: users enough for a KV working set this many times "
                        "GPU + host, per history length")
    add_run_flags(p, layers=4)
    p.set_defaults(users=None)
    return p


class SweepError(Exception):
    """A flag combination the sweep cannot run, found before any run: one line, naming the
    flag."""


def check_fits(args: argparse.Namespace, history: int, gpu_blocks: int) -> None:
    """A conversation's last round must fit the GPU pool, or the serving loop refuses it
    mid-sweep."""
    tokens: int = args.system_tokens + history + args.rounds * (
        args.question_tokens + args.answer_tokens)
    needed = -(-tokens // args.block_size)
    if needed > gpu_blocks:
        raise SweepError(
            f"argument --gpu-gib: the last round at history {history} needs {needed} blocks "
            f"of {args.block_size} tokens; {args.gpu_gib:g} GiB holds {gpu_blocks}")


def user_kv_bytes(args: argparse.Namespace, history: int, kv_token: int) -> int:
    """KV bytes of one conversation after its last round (the shared system prompt
    counted in each: an upper bound)."""
    tokens: int = args.system_tokens + history + args.rounds * (
        args.question_tokens + args.answer_tokens)
    return tokens * kv_token


def users_for(args: argparse.Namespace, history: int, kv_token: int) -> int:
    """--users, or enough users that their KV is --pressure times GPU + host: each history
    length then loads the disk tier alike."""
    if args.users is not None:
        return int(args.users)
    pools: float = (args.gpu_gib + args.host_gib) * 2**30
    pressure: float = args.pressure
    return max(1, math.ceil(pressure * pools / user_kv_bytes(args, history, kv_token)))


def signature(args: argparse.Namespace) -> dict[str, Any]:
    return {name: _json_safe(getattr(args, name)) for name in SIGNATURE}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def read_resumed(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The results file `--resume` names, checked to be this sweep's: one line naming
    --resume (and the first flag that differs) otherwise."""
    try:
        doc: object = json.loads(path.read_text())
    except OSError as exc:
        raise SweepError(f"argument --resume: cannot read {str(path)!r}: {exc.strerror}"
                         ) from None
    except ValueError:
        raise SweepError(f"argument --resume: {str(path)!r} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("bench") != "sweep" or not isinstance(
            doc.get("cases"), list) or not isinstance(doc.get("signature"), dict):
        raise SweepError(f"argument --resume: {str(path)!r} is not a results file of "
                         f"bench.sweep that can be resumed")
    theirs: dict[str, Any] = doc["signature"]
    ours = json.loads(json.dumps(signature(args)))
    negatable = {action.dest for action in build_parser()._actions
                 if isinstance(action, argparse.BooleanOptionalAction)}
    seeds = theirs.get("seeds")
    if isinstance(seeds, int) and not isinstance(seeds, bool) and args.seeds < seeds:
        raise SweepError(f"argument --seeds: {str(path)!r} was measured with --seeds "
                         f"{seeds}; resume with at least as many")
    for field in SIGNATURE:
        if field == "seeds":
            continue  # more seeds extend the sweep: each case's searches gain seeds
        recorded = theirs.get(field, SIGNATURE_BEFORE.get(field, "<absent>"))
        if recorded != ours[field]:
            # A flag with a --no- form is turned off by it, which the user must be told:
            # "--gc-freeze False" is not a command line.
            hint = f" (--no-{flag_name(field)[2:]})" if (
                field in negatable and recorded is False) else ""
            raise SweepError(
                f"argument --resume: {str(path)!r} was measured with {flag_name(field)} "
                f"{_flag_text(recorded)}, not "
                f"{_flag_text(ours[field])}: resume with the same flags{hint}")
    return doc


def _flag_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


# ---------------------------------------------------------------------- the sweep


def case_name(model: str, layers: int, history: int) -> str:
    return f"{model}-x{layers}-h{history}"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null (they are not JSON); paths become strings."""
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def measured_requests_for(rate: float, args: argparse.Namespace, attempt: int) -> int:
    """Measured requests of a point at `rate`: --duration-s of arrivals within
    --min-requests and --max-requests, twice as many for a second attempt."""
    wanted = max(int(args.min_requests), round(rate * float(args.duration_s)))
    return attempt * min(int(args.max_requests), wanted)


def arrivals_fingerprint(times: Sequence[float]) -> dict[str, Any]:
    """What identifies a run's arrival schedule: the same seed and rate give the same one."""
    digest = hashlib.sha256(struct.pack(f"<{len(times)}d", *times)).hexdigest()[:16]
    return {"count": len(times), "first_s": times[0], "last_s": times[-1], "sha256": digest}


def warmup_balance(run: Any, arrival_times: Sequence[float], warmup: int) -> float | None:
    """Completions over arrivals in the second half of the warm-up: about 1 in a steady
    state, above while a backlog drains, below while one builds."""
    if warmup < 4:
        return None
    start, end = arrival_times[warmup // 2], arrival_times[warmup]
    arrived = sum(1 for t in arrival_times if start <= t < end)
    done = sum(1 for r in run.results if r.finished is not None and start <= r.finished < end)
    return done / arrived if arrived else None


def in_system(run: Any, arrival_times: Sequence[float], t: float) -> int:
    """Requests that had arrived by `t` and not finished by then."""
    arrived = sum(1 for a in arrival_times if a <= t)
    done = sum(1 for r in run.results if r.finished is not None and r.finished <= t)
    return arrived - done


def copy_tier(source: Path, target: Path) -> None:
    """Copy a closed disk tier's directory: the written extents of its files (a preallocated
    data file's unwritten extents read back as holes), the rest allocated as a fresh tier's
    is, flushed, and out of the page cache, so the run reads its slots from the disk."""
    for root, _dirs, files in os.walk(source):
        here = Path(root)
        there = target / here.relative_to(source)
        there.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in files:
            _copy_file(here / name, there / name)


def _copy_file(source: Path, target: Path) -> None:
    mode = source.stat().st_mode & 0o777
    src = os.open(source, os.O_RDONLY)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            size = os.fstat(src).st_size
            offset = 0
            while offset < size:
                try:
                    data = os.lseek(src, offset, os.SEEK_DATA)
                except OSError:  # no data past `offset`
                    break
                hole = os.lseek(src, data, os.SEEK_HOLE)
                at = data
                while at < hole:
                    moved = os.copy_file_range(src, dst, hole - at, at, at)
                    if moved == 0:
                        break
                    at += moved
                offset = hole
            if size:
                os.posix_fallocate(dst, 0, size)
            os.fsync(dst)
            os.posix_fadvise(dst, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(dst)
    finally:
        os.close(src)


class _Deadline(Exception):
    """The next step would end past --deadline-s, or --points were measured."""


@attrs.define
class _Prepared:
    """A configuration's conversation after its cold start, and its disk tier then."""

    workload: Any
    tier: Path | None
    seconds: float


@attrs.define
class _Sweep:
    """What one call of the sweep carries from case to case."""

    args: argparse.Namespace
    path: Path
    header: dict[str, Any]
    cases: list[dict[str, Any]]
    bar: Any
    disk_dir: Path
    device: str
    began: float
    drain: float
    measured_here: int = 0
    setup_s: float = 5.0
    """The longest a run's setup (tier copy, open, restore) took in this call, floored."""

    def left(self) -> float:
        deadline = self.args.deadline_s
        return math.inf if deadline is None else deadline - (time.perf_counter() - self.began)

    def record(self) -> None:
        write_results(self.path, self.header, self.cases, self.args)


def sweep(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    import torch

    from bench.disk_limits import raw_read_rate
    from io_actors.embed import resolve_device
    from models.config import preset
    from models.model import PagedDecoder
    from models.workloads import OpenChatWorkload

    began = time.perf_counter()
    device = resolve_device(args.device)
    if args.machine is None:
        args.machine = machine_name(device)
    today = dt.date.today()
    slo: float = args.slo_ttft_p99
    drain: float = args.drain_s if args.drain_s is not None else 2 * slo
    if args.remeasure is not None:
        if args.resume is None:
            raise SweepError("argument --remeasure: only with --resume (a new sweep measures "
                             "every configuration anyway)")
        if set(args.remeasure) - set(args.configs):
            raise SweepError(f"argument --remeasure: {args.remeasure!r} names a configuration "
                             f"--configs {args.configs!r} does not measure")
        if not (args.remeasure_why or "").strip():
            raise SweepError("argument --remeasure-why: say why the points are dropped (the "
                             "file keeps the reason beside them)")
    elif args.remeasure_why is not None:
        raise SweepError("argument --remeasure-why: only with --remeasure")
    if args.resume is not None and args.tag is not None:
        # It would name a file the resumed sweep never writes: it goes on in its own.
        raise SweepError(f"argument --tag: a resumed sweep goes on in the file --resume names "
                         f"({str(args.resume)!r}); leave --tag out")
    if args.cuda_graphs and device.type != "cuda":
        raise SweepError(f"argument --cuda-graphs: CUDA graphs need a CUDA device, not "
                         f"{str(device)!r}")
    if drain <= slo:
        raise SweepError(f"argument --drain-s: must be above --slo-ttft-p99 ({slo:g} s), so "
                         f"that a request cut off by the drain is a certain miss; got {drain:g}")
    if args.rates_rps is not None and args.rates != list(DEFAULT_RATES):
        raise SweepError("argument --rates-rps: give the grid as --rates or as --rates-rps, "
                         "not both")
    disk_dir = args.dir or Path("/tmp/statekv-sweep")
    disk_dir.mkdir(parents=True, exist_ok=True)
    for model_name in args.models:  # every case checked before the first run
        model_config = preset(model_name, num_layers=args.layers)
        blocks = pool_blocks(model_config, args.block_size, args.gpu_gib, args.host_gib,
                             args.disk_gib)
        for history in args.histories:
            check_fits(args, history, blocks[0])
            kv = model_config.kv_bytes_per_token()
            working = users_for(args, history, kv) * user_kv_bytes(args, history, kv)
            if any(k in "de" for k in args.configs) and working > args.disk_gib * 2**30:
                raise SweepError(
                    f"argument --disk-gib: the working set at history {history} is "
                    f"{working / 2**30:.2f} GiB; {args.disk_gib:g} GiB of disk tier does not "
                    f"hold it")
    for leftover in [*disk_dir.glob("prepared-*"), *disk_dir.glob("run-*")]:
        shutil.rmtree(leftover, ignore_errors=True)  # a killed sweep's tiers (this --dir's)
    if any(k in "de" for k in args.configs):
        free = shutil.disk_usage(disk_dir).free
        if 2 * args.disk_gib * 2**30 > free:
            raise SweepError(
                f"argument --disk-gib: a prepared tier and its copy need "
                f"{2 * args.disk_gib:g} GiB; {str(disk_dir)!r} has {free / 2**30:.1f} GiB free")
    call = {"started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": "python -m bench.sweep " + " ".join(argv), "commit": source_commit(),
            "deadline_s": args.deadline_s, "points": args.points, "cut_short": None,
            "measured": 0}
    if args.resume is not None:
        doc = read_resumed(args.resume, args)
        path: Path = args.resume
        header = {k: v for k, v in doc.items()
                  if k not in ("cases", "figures", "goodput_table", "ratio_table")}
        header["calls"] = [*header.get("calls", []), call]
        header["signature"] = signature(args)
        header["method"]["seeds"] = args.seeds
        cases: list[dict[str, Any]] = doc["cases"]
        if args.remeasure is not None:
            call["remeasured"] = {"configs": args.remeasure, "why": args.remeasure_why}
            for case in cases:
                for key in args.remeasure:
                    dropped = case.get("runs", {}).get(key) or []
                    if dropped:
                        case.setdefault("dropped_runs", []).append(
                            {"config": key, "why": args.remeasure_why,
                             "dropped_by_call": len(header["calls"]), "runs": dropped})
                    case.setdefault("runs", {})[key] = []
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = f"-{args.tag}" if args.tag else ""
        # A new sweep never replaces an earlier one's file (two A/B runs of one call with
        # the same tag did: the second kept only its own points).
        path = unused_path(args.out, f"sweep-{args.machine}-{today:%Y%m%d}{tag}")
        header = {
            "bench": "sweep", "machine": args.machine, "date": today.isoformat(),
            "commit": call["commit"], "command": call["command"],
            "method": {
                "arrivals": "open loop, seeded Poisson (OpenChatWorkload)",
                "prepare": "per configuration and seed, every pool user's first round "
                           "served at once; its disk tier persisted and copied to each run",
                "warmup": "the run's first warmup_requests at the offered rate, not "
                          "measured; balance over their second half recorded",
                "requests": f"measured per point: at least --min-requests "
                            f"({args.min_requests}), or rate x --duration-s, at most "
                            f"--max-requests; no early stop",
                "p99_interval": f"distribution-free {CONFIDENCE:.0%}, order statistics at "
                                f"binomial(n, {QUANTILE}) quantiles",
                "settled": f"met needs >= {SETTLED}x sustained; a miss over "
                           f"{1 / SETTLED:.3f}x sustained, or a met point under {SETTLED}x, "
                           f"is unsettled: rerun once with twice the requests, where a "
                           f"difference within 1 + 2 sqrt(in system) is allowed",
                "search": f"from the grid rate nearest x{args.start:g}, up the grid while "
                          f"met or down it until met, then bisect geometrically to within "
                          f"{args.precision:.0%}",
                "seeds": args.seeds,
                "ratio_claim": "claimed only when every seed's bracket of one lies above "
                               "(or below) every seed's of the other, with at least two "
                               "seeds each; else within spread, or one seed: no spread "
                               "measured",
                "drain_s": drain, "duration_s": args.duration_s,
                "min_requests": args.min_requests, "max_requests": args.max_requests},
            "signature": signature(args), "calls": [call], "cut_short": None}
        cases = []
    disable = {"auto": None, "always": False, "never": True}[args.progress]
    bar = tqdm(desc="sweep", unit="point", disable=disable, position=0)
    state = _Sweep(args=args, path=path, header=header, cases=cases, bar=bar,
                   disk_dir=disk_dir, device=str(device), began=began, drain=drain)
    say = tqdm.write
    header["cut_short"] = None
    try:
        for model_name in args.models:
            model_config = preset(model_name, num_layers=args.layers)
            started = time.perf_counter()
            model = PagedDecoder(model_config, device=device, cuda_graphs=args.cuda_graphs)
            kv_token = model_config.kv_bytes_per_token()
            blocks = pool_blocks(model_config, args.block_size, args.gpu_gib, args.host_gib,
                                 args.disk_gib)
            disk = raw_read_rate(disk_dir, block_bytes=kv_token * args.block_size,
                                 threads=args.readers,
                                 total_bytes=max(1, int(args.disk_probe_mib * 2**20)))
            say(f"{model_name} x{args.layers} layers on {device}: built in "
                f"{time.perf_counter() - started:.1f} s; disk read {disk.gb_per_s:.2f} GB/s "
                f"({'O_DIRECT' if disk.direct else 'buffered'}); pools gpu/host/disk "
                f"{blocks[0]}/{blocks[1]}/{blocks[2]} blocks of {args.block_size} tokens")
            for history in args.histories:
                _run_case(state, model, model_name, history, blocks, kv_token, disk,
                          OpenChatWorkload)
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    except _Deadline as stop:
        header["cut_short"] = call["cut_short"] = str(stop)
        say(f"stopped: {stop}; resume with --resume {path}")
    state.record()
    bar.close()
    for case in cases:
        say(goodput_text(case, slo))
    say(f"sweep took {time.perf_counter() - began:.0f} s")
    return path


def _run_case(state: _Sweep, model: Any, model_name: str, history: int,
              blocks: tuple[int, int, int], kv_token: int, disk: Any, open_chat: Any) -> None:
    """Calibrate one case (or take a resumed case's first calibration), then search every
    configuration's goodput at every seed; the case is in the results before its first
    point, so the file always holds it."""
    args = state.args
    say = tqdm.write
    context = args.system_tokens + history
    tps = prefill_rate(model, args.block_size, CALIBRATION_CHUNK, context)
    case_args = argparse.Namespace(**{**vars(args),
                                      "users": users_for(args, history, kv_token)})
    base = chat_config(case_args, model.config.vocab_size, 1.0, history_tokens=history)
    name = case_name(model_name, args.layers, history)
    calibration = {"call": len(state.header["calls"]) - 1, "prefill_tok_per_s": tps,
                   "disk_read_gb_per_s": disk.gb_per_s,
                   "capacity_requests_per_s": recompute_capacity(base, tps)}
    case = next((c for c in state.cases if c["case"] == name), None)
    if case is not None:
        case["calibrations"].append(calibration)
        case["seeds"] = [args.seed + i for i in range(args.seeds)]  # --seeds may have grown
        say(f"{name}: resumed; rates from the first call's calibration (recompute capacity "
            f"{case['capacity_requests_per_s']:.2f} requests/s; this call's "
            f"{calibration['capacity_requests_per_s']:.2f})")
    else:
        case = _new_case(args, name, model_name, history, base, tps, disk, blocks, kv_token,
                         calibration)
        state.cases.append(case)
        say(f"{name}: prefill {tps:,.0f} tok/s at context {context} "
            f"({case['recompute_us_per_token']:.1f} us/token vs disk read "
            f"{case['read_us_per_token']:.1f}); recompute capacity "
            f"{case['capacity_requests_per_s']:.2f} requests/s (full reuse "
            f"{case['full_reuse_requests_per_s']:.2f}); {base.num_users} users, "
            f"{case['warmup_requests']} warm-up requests; working set "
            f"{case['working_set_gib']:.2f} GiB vs GPU+host "
            f"{args.gpu_gib + args.host_gib:.2f} GiB"
            + ("" if state.left() == math.inf
               else f" ({state.left():.0f} s left before --deadline-s)"))
    state.record()
    for seed in case["seeds"]:
        for key in args.configs:
            _search(state, model, case, case_args, history, key, seed, blocks, open_chat)


def _new_case(args: argparse.Namespace, name: str, model_name: str, history: int, base: Any,
              tps: float, disk: Any, blocks: tuple[int, int, int], kv_token: int,
              calibration: dict[str, Any]) -> dict[str, Any]:
    capacity = recompute_capacity(base, tps)
    prompt = mean_prompt_tokens(base)
    warmup = base.num_users if args.warmup_requests is None else int(args.warmup_requests)
    multiples = (sorted(args.rates) if args.rates_rps is None
                 else [r / capacity for r in sorted(args.rates_rps)])
    return {
        "case": name, "model": model_name, "layers": args.layers, "history_tokens": history,
        "context_tokens": args.system_tokens + history, "users": base.num_users,
        "rounds": args.rounds, "warmup_requests": warmup, "kv_bytes_per_token": kv_token,
        "block_size": args.block_size,
        "pool_blocks": {"gpu": blocks[0], "host": blocks[1], "disk": blocks[2]},
        "disk_tier_policies": {"prefetch_ahead": args.prefetch_ahead,
                               "reclaim_prefetched": args.reclaim_prefetched,
                               "cost_aware_onboarding": not args.no_cost_aware},
        "working_set_gib": base.num_users * user_kv_bytes(args, history, kv_token) / 2**30,
        "disk_read_gb_per_s": disk.gb_per_s, "disk_read_direct": disk.direct,
        "prefill_tok_per_s": tps, "recompute_us_per_token": 1e6 / tps,
        "read_us_per_token": kv_token / (disk.gb_per_s * 1e9) * 1e6,
        "capacity_requests_per_s": capacity,
        "full_reuse_requests_per_s": full_reuse_capacity(base, tps),
        "mean_prompt_tokens": prompt,
        "calibrations": [calibration],
        "rates": [{"capacity_multiple": m, "requests_per_s": m * capacity,
                   "input_tok_per_s": m * capacity * prompt} for m in multiples],
        "seeds": [args.seed + i for i in range(args.seeds)],
        "search_start": args.start,
        "runs": {key: [] for key in args.configs},
    }


def _search(state: _Sweep, model: Any, case: dict[str, Any], case_args: argparse.Namespace,
            history: int, key: str, seed: int, blocks: tuple[int, int, int],
            open_chat: Any) -> None:
    """Measure configuration `key` at seed `seed` until its search is complete."""
    args = state.args
    prepared: _Prepared | None = None
    try:
        while True:
            w = search_state(case, key, seed, args.precision)
            if w.next is None:
                return
            if args.points is not None and state.measured_here >= args.points:
                raise _Deadline(f"--points {args.points} measured")
            if prepared is None:
                prepared = _prepare(state, model, case, case_args, history, key, seed,
                                    blocks, open_chat)
            _measure(state, model, case, case_args, history, key, seed, blocks, prepared,
                     w.next, w.phase or "grid")
    finally:
        if prepared is not None and prepared.tier is not None:
            shutil.rmtree(prepared.tier, ignore_errors=True)


def _prepare(state: _Sweep, model: Any, case: dict[str, Any], case_args: argparse.Namespace,
             history: int, key: str, seed: int, blocks: tuple[int, int, int],
             open_chat: Any) -> _Prepared:
    """Serve the cold start of `key`'s conversation at `seed` once (every pool user's
    first round, all at once), keeping its disk tier."""
    args = state.args
    users: int = case["users"]
    guess = 3 * users * case["mean_prompt_tokens"] / case["prefill_tok_per_s"] + 5
    if state.left() < guess + state.setup_s:
        raise _Deadline(f"--deadline-s reached before preparing {case['case']} ({key}) "
                        f"seed {seed}")
    config = chat_config(argparse.Namespace(**{**vars(case_args), "seed": seed}),
                         model.config.vocab_size, PREPARE_RATE, history_tokens=history)
    workload = open_chat(config, num_requests=users)
    tier = None
    if key in "de":
        tier = state.disk_dir / f"prepared-{key}-s{seed}"
        shutil.rmtree(tier, ignore_errors=True)
        tier.mkdir(mode=0o700)
    state.bar.set_description(f"{case['case']} ({key}) seed {seed}: prepare")
    started = time.perf_counter()
    run = run_config(model, key, workload, budgets_for(key, args, blocks),
                     device=state.device, disk_dir=state.disk_dir, args=args,
                     stop_at=max(1.0, state.left() - state.setup_s), tier_dir=tier)
    seconds = time.perf_counter() - started
    if run.unfinished or not workload.done():
        if tier is not None:
            shutil.rmtree(tier, ignore_errors=True)
        raise _Deadline(f"--deadline-s reached while preparing {case['case']} ({key}) "
                        f"seed {seed}")
    tqdm.write(f"  ({key}) seed {seed}: prepared {users} first rounds in {seconds:.1f} s")
    return _Prepared(workload=workload, tier=tier, seconds=seconds)


def _measure(state: _Sweep, model: Any, case: dict[str, Any], case_args: argparse.Namespace,
             history: int, key: str, seed: int, blocks: tuple[int, int, int],
             prepared: _Prepared, multiple: float, phase: str) -> None:
    """One point: `key` at seed `seed` and rate `multiple`, from the prepared state."""
    args = state.args
    slo: float = args.slo_ttft_p99
    runs: list[dict[str, Any]] = case["runs"][key]
    attempt = len(attempts_at(runs, seed, multiple)) + 1
    rate_rps = multiple * case["capacity_requests_per_s"]
    warmup: int = case["warmup_requests"]
    measured = measured_requests_for(rate_rps, args, attempt)
    workload = prepared.workload.continued(arrival_rate=rate_rps,
                                           num_requests=warmup + measured)
    last = workload.arrival_times[-1]
    if state.left() < last + state.drain + state.setup_s:
        raise _Deadline(f"--deadline-s reached before {case['case']} ({key}) seed {seed} "
                        f"x{multiple:.4g}")
    started = time.perf_counter()
    tier = None
    if prepared.tier is not None:
        tier = state.disk_dir / f"run-{key}-s{seed}"
        shutil.rmtree(tier, ignore_errors=True)
        tier.mkdir(mode=0o700)
        copy_tier(prepared.tier, tier)
    copied = time.perf_counter() - started
    label = f"{case['case']} ({key}) seed {seed} x{multiple:.4g}"
    state.bar.set_description(label)
    inner = tqdm(total=warmup + measured, desc="requests", unit="req", leave=False,
                 disable=state.bar.disable, position=1)

    def tick(done: int, _total: int) -> None:
        inner.update(done - inner.n)

    graphs_before = model.decode_graph_statistics()
    try:
        with collector_watched(freeze=args.gc_freeze) as pauses:
            run = run_config(model, key, workload, budgets_for(key, args, blocks),
                             device=state.device, disk_dir=state.disk_dir, args=args,
                             progress=tick, stop_at=last + state.drain, tier_dir=tier)
    finally:
        inner.close()
        if tier is not None:
            shutil.rmtree(tier, ignore_errors=True)
    setup = time.perf_counter() - started - run.seconds
    state.setup_s = max(state.setup_s, 1.5 * setup)
    times = workload.arrival_times
    s: dict[str, Any] = steady_summary(run, times, warmup)
    s.update(p99_interval(window_ttfts(run, times[warmup])))
    balance = warmup_balance(run, times, warmup)
    arrived, finished = window_counts(run, times, warmup)
    counts = (in_system(run, times, times[warmup]),
              in_system(run, times, min(times[-1], run.seconds)))
    s.update(
        seed=seed, capacity_multiple=multiple, requests_per_s=rate_rps, attempt=attempt,
        phase=phase,
        verdict=verdict(_finite(s["ttft_p99_s"]), arrived, finished, slo, counts,
                        attempt=attempt),
        window_arrived=arrived, window_finished=finished,
        warmup_balance=balance,
        warmup_steady=balance is not None and SETTLED <= balance <= 1 / SETTLED,
        in_system_at_window_start=counts[0], in_system_at_window_end=counts[1],
        arrivals=arrivals_fingerprint(times), users_started=workload.users_started,
        busy_skips=workload.busy_skips, joined_for_load=workload.joined_for_load,
        restored_slots=(len(run.cache.recovery.slots)
                        if run.cache.recovery is not None else None),
        prepare_s=prepared.seconds, copy_s=copied, setup_s=setup,
        # What the GPU pool holds at once: requests of the mean prompt and a whole answer,
        # as admission reserves them (residency_held_mean near it: the pool bounds the rate).
        residency_pool_requests=blocks[0] / -(-(case["mean_prompt_tokens"]
                                                + args.answer_tokens) // args.block_size),
        # The whole run (set-up and warm-up included): every collection stopped the
        # serving thread too.
        run_gc_collections=pauses.collections, run_gc_pause_s=pauses.total,
        run_gc_full_collections=len(pauses.full),
        run_gc_full_pause_max_s=max(pauses.full, default=0.0))
    graphs_after = model.decode_graph_statistics()
    if graphs_before is not None and graphs_after is not None:
        # The whole run's decode-only steps (warm-up included): how many replayed a graph,
        # how many graphs were captured, and how many ran eagerly.
        s.update(run_graph_replays=graphs_after.replayed - graphs_before.replayed,
                 run_graph_captures=graphs_after.captured - graphs_before.captured,
                 run_graph_eager=graphs_after.eager - graphs_before.eager)
    runs.append(s)
    runs.sort(key=lambda r: (r["seed"], r["capacity_multiple"], r["attempt"]))
    state.measured_here += 1
    state.header["calls"][-1]["measured"] = state.measured_here
    state.bar.update()
    state.record()
    high = s["ttft_p99_ci_high_s"]
    tqdm.write(
        f"  x{multiple:<6.4g} ({key}) seed {seed}{' rerun' if attempt > 1 else ''} "
        f"{s['verdict']:<9} TTFT p50 {s['ttft_p50_s']:7.3f} s p99 "
        f"{'>=' if s['ttft_p99_lower_bound'] else '  '}{s['ttft_p99_s']:7.3f} s "
        f"[{s['ttft_p99_ci_low_s'] or math.nan:.3f}, "
        f"{'above max' if high is None else f'{high:.3f}'}]  "
        f"{s['sustained_vs_offered']:.2f}x offered (warm-up "
        f"{math.nan if balance is None else balance:.2f}x)  in "
        f"{s['input_tok_per_s']:9,.0f} tok/s  gpu/host/disk/computed {s['tokens_gpu']}/"
        f"{s['tokens_host']}/{s['tokens_disk']}/{s['tokens_computed']}  "
        f"{s['measured_requests']} measured [{s['seconds']:.1f} s + {setup:.1f} s setup]")
    if s.get("breakdown_requests"):
        tqdm.write("    " + breakdown_line(s))
    if s.get("residency_requests"):
        tqdm.write("    " + residency_line(s))
    waited = s.get("run_queued_on_disk_s")
    if waited:
        reading = s["run_queued_on_disk_reading_s"] / waited
        tqdm.write(f"    the prefetch window waited on disk {waited:.2f} s of the run, the disk "
                   f"reading in {reading:.0%} of it (warm-up included)")
    if "run_steps_prefill" in s:
        tqdm.write("    " + step_parts_line(s, "run_"))
    tqdm.write(f"    garbage collector over the run: {s['run_gc_collections']} collections, "
               f"{s['run_gc_pause_s'] * 1e3:.0f} ms in all; {s['run_gc_full_collections']} full, "
               f"the longest {s['run_gc_full_pause_max_s'] * 1e3:.0f} ms")
    if "run_graph_replays" in s:
        tqdm.write(f"    decode-only steps of the run: {s['run_graph_replays']} graph replays, "
                   f"{s['run_graph_captures']} captures, {s['run_graph_eager']} eager")
    if s.get("io_errors"):
        # No injected faults here: every failed transfer is a fault of the disk or a bug,
        # and the point's figure includes the recomputation it cost.
        tqdm.write(f"    {s['io_errors']} disk transfers failed in this run (each logged above"
                   f"); its figure includes the recomputing they caused")


def write_results(path: Path, header: dict[str, Any], cases: list[dict[str, Any]],
                  args: argparse.Namespace) -> None:
    for case in cases:
        summarize_case(case, args.precision)
    doc = {**header, "figures": figures(cases), "slo_ttft_p99_s": args.slo_ttft_p99,
           "goodput_table": [
               {"case": case["case"], "config": key, "seed": int(seed), **row}
               for case in cases for key, by_seed in case["search"].items()
               for seed, row in by_seed.items()],
           "ratio_table": [
               {"case": case["case"], "ratio": pair, **row}
               for case in cases for pair, row in case["ratios"].items()],
           "cases": cases}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(doc), indent=2) + "\n")
    tmp.replace(path)


def goodput_text(case: dict[str, Any], slo: float) -> str:
    lines = [f"goodput, {case['case']} (TTFT p99 <= {slo:g} s; recompute capacity "
             f"{case['capacity_requests_per_s']:.2f} requests/s; seeds "
             f"{','.join(str(s) for s in case['seeds'])}):"]
    for key in case["runs"]:
        g = case.get("goodput", {}).get(key)
        if g is None:
            lines.append(f"  ({key}) {NAMES[key]:<28} not measured: its search was cut short")
        elif g["median"] is None:
            lines.append(f"  ({key}) {NAMES[key]:<28} none at some seed "
                         f"({', '.join(g['statuses'])})")
        else:
            at_least = "at least " if g["lower_bound"] else ""
            lines.append(
                f"  ({key}) {NAMES[key]:<28} {at_least}min/median/max {g['min']:.2f} / "
                f"{g['median']:.2f} / {g['max']:.2f} requests/s "
                f"(x{g['median'] / case['capacity_requests_per_s']:.3g} capacity; "
                f"{', '.join(g['statuses'])})")
    for pair, r in case.get("ratios", {}).items():
        num, den = pair.split("_vs_")
        lines.append(f"  ({num})/({den}) goodput {'>= ' if r['lower_bound'] else ''}"
                     f"{r['value']:.2f}x (spread {r['min']:.2f}-{r['max']:.2f}x): "
                     f"{r['claim']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots


def plot(results: dict[str, Any], stem: Path) -> list[Path]:
    """One PNG per case, `<stem>-<case>.png`; [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    written: list[Path] = []
    for case in results["cases"]:
        fig = draw_case(results, case, run=stem.name)
        png = stem.parent / f"{stem.name}-{case['case']}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    return written


def final_points(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each rate's points over seeds, the last attempt of each seed, by rate key."""
    last: dict[tuple[int, str], dict[str, Any]] = {}
    for r in runs:  # files of the sweep before seeds: one attempt at seed 0
        k = (r.get("seed", 0), rate_key(r["capacity_multiple"]))
        if k not in last or r.get("attempt", 1) > last[k].get("attempt", 1):
            last[k] = r
    by_rate: dict[str, list[dict[str, Any]]] = {}
    for (_seed, rk), r in sorted(last.items(), key=lambda item: item[1]["requests_per_s"]):
        by_rate.setdefault(rk, []).append(r)
    return by_rate


def draw_case(results: dict[str, Any], case: dict[str, Any], *, run: str) -> Any:
    """The figure of one case: TTFT p99 (log) and sustained input tokens/s (linear, from 0)
    against offered requests/s (log, ticked at the sweep's grid), the median over seeds with
    min-max bars, and each configuration's goodput spread over seeds as a bar on the SLO
    line (its median starred).  Every line and marker style has a legend entry; the title
    names the machine, the date, the commit and `run` (the results file's name)."""
    plt = pyplot()
    assert plt is not None
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullLocator

    from bench.plots import plain_log_axis, thin_tick_labels

    slo = results["slo_ttft_p99_s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 6))
    ran = [r["requests_per_s"] for runs in case["runs"].values() for r in runs or []]
    top = max(ran, default=max(r["requests_per_s"] for r in case["rates"]))
    rates = [r for r in case["rates"] if r["requests_per_s"] <= top * (1 + 1e-9)] or \
        case["rates"][:1]
    any_bound = any_star = any_unsettled = False
    seeds = len(case.get("seeds", [0]))
    for key in CONFIGS:
        runs = case["runs"].get(key) or []
        if not runs:
            continue
        by_rate = final_points(runs)
        x, mid, lo, hi, tmid, tlo, thi = [], [], [], [], [], [], []
        for points in by_rate.values():
            p99 = [math.nan if r["ttft_p99_s"] is None else r["ttft_p99_s"] for r in points]
            tput = [r["input_tok_per_s"] or 0.0 for r in points]
            x.append(points[0]["requests_per_s"])
            mid.append(_median(p99))
            lo.append(mid[-1] - min(p99))
            hi.append(max(p99) - mid[-1])
            tmid.append(_median(tput))
            tlo.append(tmid[-1] - min(tput))
            thi.append(max(tput) - tmid[-1])
        label = f"({key}) {NAMES[key]}"
        bars = ax1.errorbar(x, mid, yerr=[lo, hi], marker="o", label=label)
        color = bars.lines[0].get_color()
        ax2.errorbar(x, tmid, yerr=[tlo, thi], marker="o", label=label, color=color)
        finals = [r for points in by_rate.values() for r in points]
        bounds = [r for r in finals if r.get("ttft_p99_lower_bound")]
        if bounds:  # a request had no first token when the run stopped: p99 at least
            any_bound = True
            ax1.plot([r["requests_per_s"] for r in bounds], [r["ttft_p99_s"] for r in bounds],
                     linestyle="none", marker="^", markersize=10, markerfacecolor="none",
                     color=color, label="_bound")
        unsettled = [r for r in finals if r.get("verdict") == "unsettled"]
        if unsettled:
            any_unsettled = True
            ax1.plot([r["requests_per_s"] for r in unsettled],
                     [r["ttft_p99_s"] for r in unsettled], linestyle="none", marker="x",
                     markersize=10, color=color, label="_unsettled")
        g = case.get("goodput", {}).get(key)
        if g is not None and g.get("median") is None and g.get("requests_per_s"):
            g = {"median": g["requests_per_s"], "min": g["requests_per_s"],
                 "max": g["requests_per_s"]}  # a file of the sweep before seeds
        if g is not None and g.get("median") is not None:
            any_star = True
            ax1.errorbar([g["median"]], [slo], xerr=[[g["median"] - g["min"]],
                                                     [g["max"] - g["median"]]],
                         marker="*", markersize=16, linestyle="none", color=color,
                         label="_goodput")
    ax1.axhline(slo, color="black", linestyle=":", label=f"SLO: TTFT p99 {slo:g} s")
    ax2.plot([r["requests_per_s"] for r in rates], [r["input_tok_per_s"] for r in rates],
             color="black", linestyle="--", label="offered (sustained = offered)")
    handles, _ = ax1.get_legend_handles_labels()
    handles += [h for h in ax2.get_lines() if h.get_linestyle() == "--"]
    handles.append(Line2D([], [], marker="o", linestyle="-", color="grey",
                          label=f"median over {seeds} seed(s); bars: min-max"))
    if any_star:
        handles.append(Line2D([], [], marker="*", markersize=12, linestyle="none",
                              color="grey", label="goodput: median, bar min-max over seeds"))
    if any_bound:
        handles.append(Line2D([], [], marker="^", markersize=9, linestyle="none",
                              markerfacecolor="none", color="grey",
                              label="TTFT p99 a lower bound (requests unanswered at the stop)"))
    if any_unsettled:
        handles.append(Line2D([], [], marker="x", markersize=9, linestyle="none",
                              color="grey", label="unsettled (not a miss)"))
    ax1.set_yscale("log")
    plain_log_axis(ax1.yaxis)
    ax1.set_ylabel("TTFT p99 (s, log scale)")
    ax1.set_title("time to first token, p99")
    ax2.set_ylim(bottom=0)
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax2.set_ylabel("input tokens/s sustained (tok/s)")
    ax2.set_title("throughput")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        plain_log_axis(ax.xaxis, [r["requests_per_s"] for r in rates])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(f"offered load (requests/s, log scale; recompute capacity "
                      f"{case['capacity_requests_per_s']:.2f}/s)")
        ax.grid(True, which="major", alpha=0.3)
    legend = fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8,
                        frameon=False)
    commit = str(results.get("commit") or "?")[:7]
    title = [f"bench.sweep, case {case['case']}: {results['machine']}, {results['date']}, "
             f"commit {commit}",
             f"run {run}: disk read {case['disk_read_gb_per_s']:.2f} GB/s and prefill "
             f"{case['prefill_tok_per_s']:,.0f} tok/s, measured in the same run"]
    if results.get("cut_short"):
        title.append(f"cut short: {results['cut_short']}")
    fig.suptitle("\n".join(title), fontsize=10)
    fig.draw_without_rendering()
    below = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, below + 0.01, 1, 1))
    for ax in (ax1, ax2):
        thin_tick_labels(fig, ax.xaxis)
        thin_tick_labels(fig, ax.yaxis)
    return fig


def _load_results(p: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    return load_results(p, path, "sweep", "cases", list)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    if args.plot is not None:
        results = _load_results(p, args.plot)
        if pyplot() is None:
            p.error("argument --plot: matplotlib is not installed (pip install matplotlib)")
        for png in plot(results, args.plot.with_suffix("")):
            print(f"wrote {png}")
        return 0
    try:
        path = sweep(args, argv)
    except SweepError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")
    print(f"wrote {path}")
    pngs = plot(json.loads(path.read_text()), path.with_suffix(""))
    for png in pngs:
        print(f"wrote {png}")
    if not pngs:
        print(f"no matplotlib here: draw the plots elsewhere with "
              f"python -m bench.sweep --plot {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
