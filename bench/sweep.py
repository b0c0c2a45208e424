"""Offered-load sweep: TTFT, throughput and goodput of configurations a-e, light to overload.

    python -m bench.sweep --models 70b-class,8b-class --histories 4096,16384 \\
        [--rates 0.25,0.35,...,4] [--duration-s 12] [--slo-ttft-p99 2] [--configs abcde] \\
        [--deadline-s 540]
    python -m bench.sweep --plot bench/results/sweep-h200-YYYYMMDD.json

As vLLM's serving benchmark and LMBenchmark do it: for each layer shape and history length
(a *case*), one seeded multi-round chat is served by each configuration of bench/e2e.py (a no
reuse, b GPU-only prefix cache, c GPU + host, d GPU + host + disk, e the same disk tier with
synchronous I/O), at the same pool sizes, at a ladder of offered rates.

**Open loop.**  Arrivals come from a seeded Poisson process fixed before the run
(models.workloads.OpenChatWorkload): the load offered does not wait on the server.  Each
arrival is the next round of the free user who asked longest ago, so a user's rounds never
overlap; when every user waits for an answer a new user joins.  At a given rate every
configuration gets the same arrival times, and the same requests as long as it keeps up
(``busy_skips`` and ``joined_for_load`` count where a run's requests left that common
schedule).  The pool has enough users for a KV working set of ``--pressure`` times GPU +
host (or ``--users``).

**Steady state.**  A run offers ``max(--min-requests, rate x --duration-s)`` requests (at most
``--max-requests``).  The first ``--warmup-requests`` (default: one per pool user, the cold
first round of each conversation) warm the cache up and are not measured; the window runs
from the next arrival to the last one.  TTFT p50/p99 and ITL p50 are over the requests that
arrived in the window; input/output tokens/s and ``sustained_vs_offered`` (requests finished
in the window / requests that arrived in it) over what the server did inside it.  A run stops
``--drain-s`` after its last arrival: a request without its first token by then counts with
the time it waited, and its run's TTFT p99 is flagged as a lower bound (``--drain-s`` is
above the SLO, so such a p99 is a certain miss).

**Rates** are multiples of the case's *recompute capacity* (or given in requests/s with
``--rates-rps``), calibrated in the same run: the model's prefill rate at the case's context
over the tokens of a request computed in full (serving.recompute_capacity): about where (a)
saturates; configurations that reuse saturate higher.  With ``--search climb`` (the
default) each configuration climbs every other rate of ``--rates`` until TTFT p99 misses
the SLO, then runs the rate just below that miss: the knee to one step of the grid for
about half the runs.  ``--search grid`` runs every rate.

**Goodput** of a configuration is the highest rate it ran at which TTFT p99 is within the SLO
(``--slo-ttft-p99`` seconds) *and every lower rate it ran met it too*, no interpolation.  Its
status: ``below_next`` (the next rate missed: the knee lies between them), ``every_rate``
(no rate missed: goodput is at least the highest rate), ``never_met`` (the lowest rate
already missed: no goodput figure).  A configuration whose climb was cut short has none.

The results file (shared/BENCH_FORMAT.md, ``sweep-<machine>-<date>.json`` in ``--out``) is
rewritten after every run, so a run cut short (``--deadline-s``, or a kill) keeps what it
measured.  It records per case the disk's raw O_DIRECT read rate and the model's prefill
rate measured in this run, every run's figures, and the goodput table.  One PNG per case
(TTFT p99 and sustained throughput against offered load, one line per configuration) is
drawn next to it when matplotlib is installed, or later from the file with ``--plot``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from tqdm import tqdm

from bench.plots import load_results
from bench.serving import (
    CONFIGS,
    NAMES,
    OneLineParser,
    add_run_flags,
    budgets_for,
    chat_config,
    full_reuse_capacity,
    git_commit,
    int_at_least,
    mean_prompt_tokens,
    pool_blocks,
    positive_number,
    prefill_rate,
    pyplot,
    recompute_capacity,
    results_tag,
    run_config,
    shape_preset,
    steady_summary,
)
from statekv.errors import UsageError

CALIBRATION_CHUNK: Final = 2048
"""Tokens per forward pass of the prefill calibration: the serving loop's prefill chunk."""

GOODPUT_STATUSES: Final = ("below_next", "every_rate", "never_met")


# ---------------------------------------------------------------------- goodput


@attrs.frozen(kw_only=True)
class Goodput:
    """A configuration's goodput over one sweep (see the module docstring)."""

    rate: float | None
    """The offered rate (the unit of the rates given), None when never met."""
    index: int | None
    """Its position among the swept rates."""
    status: str


def goodput(rates: Sequence[float], ttft_p99: Sequence[float | None], slo: float) -> Goodput:
    """The highest of `rates` (ascending) at which, and below which, TTFT p99 <= `slo`.

    A p99 that is None or NaN (nothing finished) is a miss.
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


# ---------------------------------------------------------------------- flags


def _csv(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        parts = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in parts):
            raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {text!r}")
        values = [item(t) for t in parts]
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"a value is given twice in {text!r}")
        return values

    return parse


DEFAULT_RATES: Final = (0.25, 0.35, 0.5, 0.71, 1.0, 1.41, 2.0, 2.83, 4.0)
"""Multiples of the recompute capacity, sqrt(2) apart: light load to past full reuse."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    n1 = int_at_least(1)
    p.add_argument("--models", type=_csv(shape_preset), default=["70b-class", "8b-class"],
                   help="layer shapes (models/config.py presets), comma-separated")
    p.add_argument("--histories", type=_csv(int_at_least(0)), default=[4096, 16384],
                   help="per-user history lengths in tokens, comma-separated")
    p.add_argument("--rates", type=_csv(positive_number), default=list(DEFAULT_RATES),
                   help="offered rates as multiples of the calibrated recompute capacity")
    p.add_argument("--rates-rps", type=_csv(positive_number), default=None,
                   help="offered rates in requests/s instead (the same for every case)")
    p.add_argument("--search", choices=("climb", "grid"), default="climb",
                   help="climb: every other rate up to the first miss, then the rate below "
                        "it; grid: every rate for every configuration")
    p.add_argument("--duration-s", type=positive_number, default=12.0,
                   help="seconds of arrivals per run (rate x this many requests)")
    p.add_argument("--min-requests", type=n1, default=40,
                   help="requests per run at least, warm-up included")
    p.add_argument("--max-requests", type=n1, default=2000,
                   help="requests per run at most (overload runs)")
    p.add_argument("--warmup-requests", type=int_at_least(0), default=None,
                   help="first requests of a run not measured (default: the pool's users)")
    p.add_argument("--drain-s", type=positive_number, default=None,
                   help="a run stops this long after its last arrival (default: 2 x SLO)")
    p.add_argument("--deadline-s", type=positive_number, default=None,
                   help="stop cleanly this long after the start, keeping what was measured")
    p.add_argument("--slo-ttft-p99", type=positive_number, default=2.0,
                   help="goodput's SLO: TTFT p99 in seconds")
    p.add_argument("--disk-probe-mib", type=positive_number, default=2048.0,
                   help="bytes moved by the raw disk read-rate measurement")
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


# ---------------------------------------------------------------------- the sweep


def case_name(model: str, layers: int, history: int) -> str:
    return f"{model}-x{layers}-h{history}"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null (they are not JSON)."""
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def missed(p99: float | None, slo: float) -> bool:
    """TTFT p99 over the SLO, or not measured (nothing in the window got a first token)."""
    return p99 is None or math.isnan(p99) or p99 > slo


def climb_order(n: int) -> list[int]:
    """Rate indices a climbing configuration tries, lowest first: every other one, and the
    highest."""
    order = list(range(0, n, 2))
    if order[-1] != n - 1:
        order.append(n - 1)
    return order


def goodput_rows(case: dict[str, Any], slo: float) -> dict[str, dict[str, Any]]:
    """Goodput of every configuration whose search is complete, over the rates it ran, in
    requests/s and input tokens/s."""
    table: dict[str, dict[str, Any]] = {}
    done = case.get("search_done", {})
    for key, runs in case["runs"].items():
        if not runs or not done.get(key, False):
            continue  # cut short: the search of this configuration is incomplete
        g = goodput([r["requests_per_s"] for r in runs], [r["ttft_p99_s"] for r in runs], slo)
        table[key] = goodput_row(g, runs, "run_index")
    return table


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


def figures(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The BENCH_FORMAT figures: same-run limits and goodput against capacity."""
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        name = case["case"]
        out[f"{name}_disk_read_raw"] = {"value": round(case["disk_read_gb_per_s"], 3),
                                        "unit": "GB/s"}
        out[f"{name}_prefill_rate"] = {"value": round(case["prefill_tok_per_s"], 1),
                                       "unit": "tok/s"}
        capacity = case["capacity_requests_per_s"]
        for key, row in case["goodput"].items():
            if row["requests_per_s"] is None:
                continue  # never met: not measured, so absent
            out[f"{name}_goodput_{key}"] = {
                "value": round(row["requests_per_s"], 4), "unit": "requests/s",
                "limit": round(capacity, 4),
                "limit_name": "recompute capacity from the prefill rate, same run",
                "ratio": round(row["requests_per_s"] / capacity, 3),
                "lower_bound": row["status"] == "every_rate",
            }
        for hi, lo in (("d", "c"), ("e", "d")):
            a, b = case["goodput"].get(hi), case["goodput"].get(lo)
            # A ratio needs the denominator's knee inside the sweep; a numerator that met
            # the SLO at every rate makes it a lower bound.
            if a and b and a["requests_per_s"] and b["status"] == "below_next":
                ratio = a["requests_per_s"] / b["requests_per_s"]
                out[f"{name}_goodput_{hi}_vs_{lo}"] = {
                    "value": round(ratio, 3), "unit": "x", "ratio": round(ratio, 3),
                    "lower_bound": a["status"] == "every_rate"}
    return out


def requests_for(rate: float, args: argparse.Namespace, warmup: int) -> int:
    """Requests a run at `rate` offers: --duration-s of arrivals, within the bounds, and
    always a window of at least two arrivals after the warm-up."""
    wanted = max(int(args.min_requests), round(rate * float(args.duration_s)))
    return max(warmup + 2, min(int(args.max_requests), wanted))


def run_seconds(rate: float, requests: int, *, overloaded: bool, drain: float) -> float:
    """A rough wall time of one run: its arrivals, then a drain when overloaded, and about a
    second to set the tiers up."""
    return requests / rate + (drain if overloaded else 0.5) + 1.0


def estimate_seconds(rates_rps: Sequence[float], knees_rps: dict[str, float],
                     args: argparse.Namespace, warmup: int, drain: float) -> float:
    """A case's wall time if each configuration's knee lies at `knees_rps` (a guess made
    before measuring: printed to size a run, never recorded as a result)."""
    total = 0.0
    for knee in knees_rps.values():
        if args.search == "grid":
            tried = list(range(len(rates_rps)))
        else:
            tried = []
            for i in climb_order(len(rates_rps)):
                tried.append(i)
                if rates_rps[i] > knee:
                    if i > 0 and i - 1 not in tried:
                        tried.append(i - 1)
                    break
        for i in tried:
            rate = rates_rps[i]
            total += run_seconds(rate, requests_for(rate, args, warmup),
                                 overloaded=rate > knee, drain=drain)
    return total


def write_results(path: Path, header: dict[str, Any], cases: list[dict[str, Any]],
                  slo: float) -> None:
    for case in cases:
        case["goodput"] = goodput_rows(case, slo)
    doc = {**header, "figures": figures(cases), "slo_ttft_p99_s": slo,
           "goodput_table": [
               {"case": case["case"], "config": key, **row}
               for case in cases for key, row in case["goodput"].items()],
           "cases": cases}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(doc), indent=2) + "\n")
    tmp.replace(path)


class _Deadline(Exception):
    """The next run would end past --deadline-s."""


def sweep(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    import torch

    from bench.disk_limits import raw_read_rate
    from io_actors.embed import resolve_device
    from models.config import preset
    from models.model import PagedDecoder
    from models.workloads import OpenChatWorkload

    began = time.perf_counter()
    device = resolve_device(args.device)
    today = dt.date.today()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path: Path = args.out / f"sweep-{args.machine}-{today:%Y%m%d}{tag}.json"
    disk_dir = args.dir or Path("/tmp/statekv-sweep")
    disk_dir.mkdir(parents=True, exist_ok=True)
    multiples = sorted(args.rates)
    slo: float = args.slo_ttft_p99
    drain: float = args.drain_s if args.drain_s is not None else 2 * slo
    if drain <= slo:
        raise SweepError(f"argument --drain-s: must be above --slo-ttft-p99 ({slo:g} s), so "
                         f"that a request cut off by the drain is a certain miss; got {drain:g}")
    header = {"bench": "sweep", "machine": args.machine, "date": today.isoformat(),
              "commit": git_commit(), "command": "python -m bench.sweep " + " ".join(argv),
              "method": {"arrivals": "open loop, seeded Poisson (OpenChatWorkload)",
                         "search": args.search, "duration_s": args.duration_s,
                         "min_requests": args.min_requests, "max_requests": args.max_requests,
                         "drain_s": drain, "deadline_s": args.deadline_s},
              "cut_short": None}
    for model_name in args.models:  # every case checked before the first run
        blocks = pool_blocks(preset(model_name, num_layers=args.layers), args.block_size,
                             args.gpu_gib, args.host_gib, args.disk_gib)
        for history in args.histories:
            check_fits(args, history, blocks[0])
    cases: list[dict[str, Any]] = []
    disable = {"auto": None, "always": False, "never": True}[args.progress]
    bar = tqdm(desc="sweep", unit="run", disable=disable, position=0)
    say = tqdm.write

    def left() -> float:
        return math.inf if args.deadline_s is None else (
            args.deadline_s - (time.perf_counter() - began))

    try:
        for model_name in args.models:
            model_config = preset(model_name, num_layers=args.layers)
            started = time.perf_counter()
            model = PagedDecoder(model_config, device=device)
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
                _run_case(args, model, model_name, history, blocks, kv_token, disk,
                          multiples, drain, path, header, cases, bar, disk_dir, str(device),
                          left, OpenChatWorkload)
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    except _Deadline as stop:
        header["cut_short"] = str(stop)
        say(f"stopped: {stop}")
        write_results(path, header, cases, slo)
    bar.close()
    for case in cases:
        say(goodput_text(case, slo))
    say(f"sweep took {time.perf_counter() - began:.0f} s")
    return path


def _run_case(args: argparse.Namespace, model: Any, model_name: str, history: int,
              blocks: tuple[int, int, int], kv_token: int, disk: Any, multiples: list[float],
              drain: float, path: Path, header: dict[str, Any], cases: list[dict[str, Any]],
              bar: tqdm[Any], disk_dir: Path, device: str, left: Callable[[], float],
              open_chat: Any) -> dict[str, Any]:
    """Calibrate one case, then climb (or sweep) its rates for every configuration; the
    case is appended to `cases` before its first run, so the file always holds it."""
    say = tqdm.write
    slo: float = args.slo_ttft_p99
    context = args.system_tokens + history
    tps = prefill_rate(model, args.block_size, CALIBRATION_CHUNK, context)
    case_args = argparse.Namespace(**{**vars(args),
                                      "users": users_for(args, history, kv_token)})
    base = chat_config(case_args, model.config.vocab_size, 1.0, history_tokens=history)
    capacity = recompute_capacity(base, tps)
    prompt = mean_prompt_tokens(base)
    warmup = base.num_users if args.warmup_requests is None else int(args.warmup_requests)
    working_set = base.num_users * user_kv_bytes(args, history, kv_token)
    if args.rates_rps is not None:
        multiples = [r / capacity for r in sorted(args.rates_rps)]
    rates = [{"capacity_multiple": m, "requests_per_s": m * capacity,
              "input_tok_per_s": m * capacity * prompt} for m in multiples]
    case: dict[str, Any] = {
        "case": case_name(model_name, args.layers, history), "model": model_name,
        "layers": args.layers, "history_tokens": history,
        "context_tokens": context, "users": base.num_users, "rounds": args.rounds,
        "warmup_requests": warmup, "kv_bytes_per_token": kv_token,
        "block_size": args.block_size,
        "pool_blocks": {"gpu": blocks[0], "host": blocks[1], "disk": blocks[2]},
        "disk_tier_policies": {"prefetch_ahead": args.prefetch_ahead,
                               "reclaim_prefetched": args.reclaim_prefetched,
                               "cost_aware_onboarding": not args.no_cost_aware},
        "working_set_gib": working_set / 2**30,
        "disk_read_gb_per_s": disk.gb_per_s, "disk_read_direct": disk.direct,
        "prefill_tok_per_s": tps,
        "recompute_us_per_token": 1e6 / tps,
        "read_us_per_token": kv_token / (disk.gb_per_s * 1e9) * 1e6,
        "capacity_requests_per_s": capacity,
        "full_reuse_requests_per_s": full_reuse_capacity(base, tps),
        "rates": rates,
        "runs": {key: [] for key in args.configs},
        "search_done": {key: False for key in args.configs},
    }
    cases.append(case)
    rps = [r["requests_per_s"] for r in rates]
    # The guess behind the estimate: (d) and (e) at the full-reuse ceiling, the rest at the
    # recompute one.
    knees = {k: case["full_reuse_requests_per_s"] if k in "de" else capacity
             for k in args.configs}
    estimate = estimate_seconds(rps, knees, args, warmup, drain)
    say(f"{case['case']}: prefill {tps:,.0f} tok/s at context {context} "
        f"({case['recompute_us_per_token']:.1f} us/token vs disk read "
        f"{case['read_us_per_token']:.1f}); recompute capacity {capacity:.2f} requests/s "
        f"(full reuse {case['full_reuse_requests_per_s']:.2f}); {base.num_users} users, "
        f"{warmup} warm-up requests; working set {case['working_set_gib']:.2f} GiB vs GPU+host "
        f"{args.gpu_gib + args.host_gib:.2f} GiB; estimated {estimate:.0f} s"
        + ("" if left() == math.inf else f" ({left():.0f} s left before --deadline-s)"))

    def run_at(key: str, index: int) -> bool:
        """Run configuration `key` at rate `index`; True when it missed the SLO."""
        rate = rates[index]
        rate_rps: float = rate["requests_per_s"]
        requests = requests_for(rate_rps, args, warmup)
        workload = open_chat(
            chat_config(case_args, model.config.vocab_size, rate_rps, history_tokens=history),
            num_requests=requests)
        last = workload.arrival_times[-1]
        budget = left()
        if budget < min(run_seconds(rate_rps, requests, overloaded=False, drain=drain),
                        last + drain + 1.0):
            raise _Deadline(f"--deadline-s reached before {case['case']} ({key}) "
                            f"x{rate['capacity_multiple']:g}")
        bar.set_description(f"{case['case']} ({key}) x{rate['capacity_multiple']:g}")
        inner = tqdm(total=requests, desc="requests", unit="req", leave=False,
                     disable=bar.disable, position=1)

        def tick(done: int, _total: int) -> None:
            inner.update(done - inner.n)

        run = run_config(model, key, workload, budgets_for(key, args, blocks),
                         device=device, disk_dir=disk_dir, args=args, progress=tick,
                         stop_at=min(last + drain, budget - 1.0))
        inner.close()
        s: dict[str, Any] = steady_summary(run, workload.arrival_times, warmup)
        s.update(rate_index=index, capacity_multiple=rate["capacity_multiple"],
                 requests_per_s=rate_rps, users_started=workload.users_started,
                 busy_skips=workload.busy_skips, joined_for_load=workload.joined_for_load)
        runs = case["runs"][key]
        runs.append(s)
        runs.sort(key=lambda r: r["rate_index"])
        bar.update()
        miss = missed(_finite(s["ttft_p99_s"]), slo)
        say(f"  x{rate['capacity_multiple']:<5g} ({key}) {NAMES[key]:<28} TTFT p50 "
            f"{s['ttft_p50_s']:7.3f} s p99 {'>=' if s['ttft_p99_lower_bound'] else '  '}"
            f"{s['ttft_p99_s']:7.3f} s{' MISS' if miss else '     '}  ITL p50 "
            f"{s['itl_p50_s'] * 1e3:6.1f} ms  in {s['input_tok_per_s']:9,.0f} tok/s  "
            f"{s['sustained_vs_offered']:.2f}x offered  out {s['output_tok_per_s']:7,.0f} "
            f"tok/s  gpu/host/disk/computed {s['tokens_gpu']}/{s['tokens_host']}/"
            f"{s['tokens_disk']}/{s['tokens_computed']}  {s['measured_requests']} measured "
            f"[{s['seconds']:.1f} s]")
        return miss

    def record() -> None:
        write_results(path, header, cases, slo)

    if args.search == "grid":
        for index in range(len(rates)):  # rates outer: a cut keeps every config compared
            for key in args.configs:
                run_at(key, index)
                record()
        for key in args.configs:
            case["search_done"][key] = True
    else:
        for index in climb_order(len(rates)):
            for key in args.configs:
                if case["search_done"][key]:
                    continue
                tried = {r["rate_index"] for r in case["runs"][key]}
                if run_at(key, index):
                    if index > 0 and index - 1 not in tried:
                        record()
                        run_at(key, index - 1)  # the knee to one step of the grid
                    case["search_done"][key] = True
                elif index == len(rates) - 1:
                    case["search_done"][key] = True
                record()
    return case


def goodput_text(case: dict[str, Any], slo: float) -> str:
    lines = [f"goodput, {case['case']} (TTFT p99 <= {slo:g} s; recompute capacity "
             f"{case['capacity_requests_per_s']:.2f} requests/s):"]
    for key in case["runs"]:
        row = case.get("goodput", {}).get(key)
        if row is None:
            lines.append(f"  ({key}) {NAMES[key]:<28} not measured: its search was cut short")
        elif row["requests_per_s"] is None:
            lines.append(f"  ({key}) {NAMES[key]:<28} none: the lowest rate missed the SLO")
        else:
            at_least = "at least " if row["status"] == "every_rate" else ""
            lines.append(f"  ({key}) {NAMES[key]:<28} {at_least}{row['requests_per_s']:.2f} "
                         f"requests/s ({row['capacity_multiple']:g}x capacity, "
                         f"{row['input_tok_per_s']:,.0f} input tok/s)")
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


def draw_case(results: dict[str, Any], case: dict[str, Any], *, run: str) -> Any:
    """The figure of one case: TTFT p99 (log) and sustained input tokens/s (linear, from 0)
    against offered requests/s (log, ticked at the sweep's rates).  Every line and marker
    style has a legend entry; the title names the machine, the date, the commit and `run`
    (the results file's name)."""
    plt = pyplot()
    assert plt is not None
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullLocator

    from bench.plots import plain_log_axis, thin_tick_labels

    slo = results["slo_ttft_p99_s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 6))
    ran = [r["requests_per_s"] for runs in case["runs"].values() for r in runs or []]
    top = max(ran, default=max(r["requests_per_s"] for r in case["rates"]))
    rates = [r for r in case["rates"] if r["requests_per_s"] <= top * (1 + 1e-9)]
    any_bound = any_star = False
    for key in CONFIGS:
        runs = case["runs"].get(key) or []
        if not runs:
            continue
        x = [r["requests_per_s"] for r in runs]
        p99 = [math.nan if r["ttft_p99_s"] is None else r["ttft_p99_s"] for r in runs]
        label = f"({key}) {NAMES[key]}"
        (line,) = ax1.plot(x, p99, marker="o", label=label)
        ax2.plot(x, [r["input_tok_per_s"] for r in runs], marker="o", label=label,
                 color=line.get_color())
        bounds = [i for i, r in enumerate(runs) if r.get("ttft_p99_lower_bound")]
        if bounds:  # a request had no first token when the run stopped: p99 at least
            any_bound = True
            ax1.plot([x[i] for i in bounds], [p99[i] for i in bounds], linestyle="none",
                     marker="^", markersize=10, markerfacecolor="none",
                     color=line.get_color(), label="_bound")
        row = case.get("goodput", {}).get(key)
        at = row.get("run_index") if row else None
        if at is not None:
            any_star = True
            ax1.plot([x[at]], [p99[at]], marker="*", markersize=16, linestyle="none",
                     color=line.get_color(), label="_goodput")
    ax1.axhline(slo, color="black", linestyle=":", label=f"SLO: TTFT p99 {slo:g} s")
    ax2.plot([r["requests_per_s"] for r in rates], [r["input_tok_per_s"] for r in rates],
             color="black", linestyle="--", label="offered (sustained = offered)")
    handles, _ = ax1.get_legend_handles_labels()
    handles += [h for h in ax2.get_lines() if h.get_linestyle() == "--"]
    if any_star:
        handles.append(Line2D([], [], marker="*", markersize=12, linestyle="none",
                              color="grey", label="goodput (highest rate within the SLO)"))
    if any_bound:
        handles.append(Line2D([], [], marker="^", markersize=9, linestyle="none",
                              markerfacecolor="none", color="grey",
                              label="TTFT p99 a lower bound (requests unanswered at the stop)"))
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
