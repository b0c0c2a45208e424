"""Offered-load sweep: TTFT, throughput and goodput of configurations a-e, light to overload.

    python -m bench.sweep --models 70b-class,8b-class --histories 4096,16384 \\
        --rates 0.25,0.5,1,2 [--slo-ttft-p99 2] [--configs abcde]
    python -m bench.sweep --plot bench/results/sweep-h200-YYYYMMDD.json

As vLLM's serving benchmark and LMBenchmark do it: for each layer shape and history length
(a *case*), the same seeded multi-round chat (bench/serving.py, models/workloads.py) is
served by each configuration of bench/e2e.py (a no reuse, b GPU-only prefix cache, c GPU +
host, d GPU + host + disk, e the same disk tier with synchronous I/O), at the same pool
sizes, once per offered rate.  Requests arrive by a seeded Poisson process; the chat is
closed loop (a user's next round waits for its previous answer), so at overload the rate
that actually arrived can fall below the offered one: both are recorded.

Rates are given as multiples of the case's *capacity*, calibrated in the same run: the
model's prefill rate (tokens/s at the case's context length) divided by the tokens a request
costs when everything earlier in its conversation is reused (serving.full_reuse_capacity).
A configuration that recomputes more saturates at a lower multiple; that is the knee the
sweep shows.  Each rate is recorded in requests/s and in input tokens/s.

For every configuration and rate: TTFT p50 / p99, ITL p50 (median of each request's mean
gap between output tokens), input and output tokens/s sustained, prompt tokens by the tier
they came from.

**Goodput** of a configuration is the highest offered rate of the sweep at which TTFT p99 is
within the SLO (``--slo-ttft-p99`` seconds) *and every lower rate of the sweep met it too*:
the rate just before the first miss, with no interpolation between rates.  Its status says
how to read it: ``below_next`` (the next swept rate missed: the knee lies between them),
``every_rate`` (no rate missed: goodput is at least the highest rate swept), ``never_met``
(the lowest rate already missed: no goodput is recorded, and none appears among the
figures).  A rate whose TTFT p99 could not be measured (no request finished) counts as a
miss.

The results file (shared/BENCH_FORMAT.md, ``sweep-<machine>-<date>.json`` in ``--out``) is
rewritten after every run, so a run cut short keeps what it measured.  It records per case
the disk's raw O_DIRECT read rate and the model's prefill rate measured in this run, every
run's figures, and the goodput table.  One PNG per case (TTFT p99 and sustained throughput
against offered load, one line per configuration) is drawn next to it when matplotlib is
installed, or later from the file with ``--plot``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from tqdm import tqdm

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
    run_config,
    summarize,
)
from models.config import PRESETS
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


def _preset(text: str) -> str:
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown shape {text!r} (known: {sorted(PRESETS)})")
    return text


def _tag(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise argparse.ArgumentTypeError(
            f"must be 1 to 64 letters, digits, '.', '_' or '-', got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_csv(_preset), default=["70b-class", "8b-class"],
                   help="layer shapes (models/config.py presets), comma-separated")
    p.add_argument("--histories", type=_csv(int_at_least(0)), default=[4096, 16384],
                   help="per-user history lengths in tokens, comma-separated")
    p.add_argument("--rates", type=_csv(positive_number), default=[0.25, 0.5, 1.0, 2.0],
                   help="offered rates as multiples of the calibrated capacity")
    p.add_argument("--slo-ttft-p99", type=positive_number, default=2.0,
                   help="goodput's SLO: TTFT p99 in seconds")
    p.add_argument("--disk-probe-mib", type=positive_number, default=2048.0,
                   help="bytes moved by the raw disk read-rate measurement")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bars (auto: when stderr is a terminal)")
    p.add_argument("--tag", type=_tag, default=None,
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


def goodput_rows(case: dict[str, Any], slo: float) -> dict[str, dict[str, Any]]:
    """Goodput of every configuration of a case, in requests/s and input tokens/s."""
    rates = case["rates"]
    table: dict[str, dict[str, Any]] = {}
    for key, runs in case["runs"].items():
        if len(runs) < len(rates):
            continue  # cut short: the sweep of this configuration is incomplete
        g = goodput([r["requests_per_s"] for r in rates], [r["ttft_p99_s"] for r in runs], slo)
        row: dict[str, Any] = {"status": g.status, "rate_index": g.index,
                               "requests_per_s": None, "input_tok_per_s": None,
                               "capacity_multiple": None}
        if g.index is not None:
            rate = rates[g.index]
            row.update(requests_per_s=rate["requests_per_s"],
                       input_tok_per_s=rate["input_tok_per_s"],
                       capacity_multiple=rate["capacity_multiple"])
        table[key] = row
    return table


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
                "limit_name": "full-reuse capacity from the prefill rate, same run",
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


def estimate_seconds(requests: int, rates_rps: Sequence[float], prefill_tok_per_s: float,
                     full_cost: float, reuse_cost: float, configs: str) -> float:
    """A rough floor on a case's wall time, printed to help size a run: each run lasts at
    least as long as its arrivals and as its compute at the calibrated prefill rate, in
    tokens per request ((a)-(c) priced as recomputing every prompt, (d)-(e) as reusing
    everything)."""
    total = 0.0
    for key in configs:
        cost = reuse_cost if key in "de" else full_cost
        for rate in rates_rps:
            total += max(requests / rate, requests * cost / prefill_tok_per_s)
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


def sweep(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    import torch

    from bench.disk_limits import raw_read_rate
    from io_actors.embed import resolve_device
    from models.config import preset
    from models.model import PagedDecoder

    device = resolve_device(args.device)
    today = dt.date.today()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path: Path = args.out / f"sweep-{args.machine}-{today:%Y%m%d}{tag}.json"
    disk_dir = args.dir or Path("/tmp/statekv-sweep")
    disk_dir.mkdir(parents=True, exist_ok=True)
    rates = sorted(args.rates)
    header = {"bench": "sweep", "machine": args.machine, "date": today.isoformat(),
              "commit": git_commit(), "command": "python -m bench.sweep " + " ".join(argv)}
    for model_name in args.models:  # every case checked before the first run
        blocks = pool_blocks(preset(model_name, num_layers=args.layers), args.block_size,
                             args.gpu_gib, args.host_gib, args.disk_gib)
        for history in args.histories:
            check_fits(args, history, blocks[0])
    cases: list[dict[str, Any]] = []
    disable = {"auto": None, "always": False, "never": True}[args.progress]
    total_runs = len(args.models) * len(args.histories) * len(args.configs) * len(rates)
    bar = tqdm(total=total_runs, desc="sweep", unit="run", disable=disable, position=0)
    say = tqdm.write
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
            context = args.system_tokens + history
            tps = prefill_rate(model, args.block_size, CALIBRATION_CHUNK, context)
            case_args = argparse.Namespace(**{**vars(args),
                                              "users": users_for(args, history, kv_token)})
            base = chat_config(case_args, model_config.vocab_size, 1.0, history_tokens=history)
            capacity = full_reuse_capacity(base, tps)
            prompt = mean_prompt_tokens(base)
            requests = base.num_users * args.rounds
            working_set = base.num_users * user_kv_bytes(args, history, kv_token)
            case: dict[str, Any] = {
                "case": case_name(model_name, args.layers, history), "model": model_name,
                "layers": args.layers, "history_tokens": history,
                "context_tokens": context, "users": base.num_users, "rounds": args.rounds,
                "requests": requests, "kv_bytes_per_token": kv_token,
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
                "rates": [{"capacity_multiple": m, "requests_per_s": m * capacity,
                           "input_tok_per_s": m * capacity * prompt} for m in rates],
                "runs": {key: [] for key in args.configs},
            }
            cases.append(case)
            full_cost = prompt + 4 * args.answer_tokens
            reuse_cost = tps / capacity
            floor = estimate_seconds(requests, [r["requests_per_s"] for r in case["rates"]],
                                     tps, full_cost, reuse_cost, args.configs)
            say(f"{case['case']}: prefill {tps:,.0f} tok/s at context {context} "
                f"({case['recompute_us_per_token']:.1f} us/token vs disk read "
                f"{case['read_us_per_token']:.1f}); capacity {capacity:.2f} requests/s; "
                f"{requests} requests; working set {case['working_set_gib']:.2f} GiB vs "
                f"GPU+host {args.gpu_gib + args.host_gib:.2f} GiB; at least {floor:.0f} s")
            # Rates outer, ascending: a run cut short still compares every configuration at
            # the rates it reached, and the slowest (overloaded) runs come last.
            for rate in case["rates"]:
                for key in args.configs:
                    bar.set_description(f"{case['case']} ({key}) x{rate['capacity_multiple']:g}")
                    inner = tqdm(total=requests, desc="requests", unit="req", leave=False,
                                 disable=disable, position=1)

                    def tick(done: int, _total: int, inner: tqdm[Any] = inner) -> None:
                        inner.update(done - inner.n)

                    workload = chat_config(case_args, model_config.vocab_size,
                                           rate["requests_per_s"], history_tokens=history)
                    run = run_config(model, key, workload, budgets_for(key, args, blocks),
                                     device=str(device), disk_dir=disk_dir, args=args,
                                     progress=tick)
                    inner.close()
                    s: dict[str, Any] = summarize(run, rate["input_tok_per_s"])
                    last = max((r.arrival for r in run.results), default=0.0)
                    s["arrived_requests_per_s"] = len(run.results) / last if last else None
                    s["capacity_multiple"] = rate["capacity_multiple"]
                    s["requests_per_s"] = rate["requests_per_s"]
                    case["runs"][key].append(s)
                    write_results(path, header, cases, args.slo_ttft_p99)
                    bar.update()
                    say(f"  x{rate['capacity_multiple']:<5g} ({key}) {NAMES[key]:<28} TTFT "
                        f"p50 {s['ttft_p50_s']:7.3f} s p99 {s['ttft_p99_s']:7.3f} s  ITL p50 "
                        f"{s['itl_p50_s'] * 1e3:6.1f} ms  in {s['input_tok_per_s']:9,.0f} "
                        f"tok/s ({s['sustained_vs_offered']:.2f}x offered)  out "
                        f"{s['output_tok_per_s']:7,.0f} tok/s  gpu/host/disk/computed "
                        f"{s['tokens_gpu']}/{s['tokens_host']}/{s['tokens_disk']}/"
                        f"{s['tokens_computed']}  [{s['seconds']:.1f} s]")
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()
    for case in cases:
        say(goodput_text(case, args.slo_ttft_p99))
    return path


def goodput_text(case: dict[str, Any], slo: float) -> str:
    lines = [f"goodput, {case['case']} (TTFT p99 <= {slo:g} s; capacity "
             f"{case['capacity_requests_per_s']:.2f} requests/s):"]
    for key, row in case["goodput"].items():
        if row["requests_per_s"] is None:
            lines.append(f"  ({key}) {NAMES[key]:<28} none: the lowest rate missed the SLO")
            continue
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
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    slo = results["slo_ttft_p99_s"]
    written: list[Path] = []
    for case in results["cases"]:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        offered = [r["requests_per_s"] for r in case["rates"]]
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
            row = case.get("goodput", {}).get(key)
            if row and row["rate_index"] is not None:
                at = row["rate_index"]
                ax1.plot([x[at]], [p99[at]], marker="*", markersize=16, color=line.get_color())
        ax1.axhline(slo, color="black", linestyle=":", label=f"SLO {slo:g} s")
        ax1.set_yscale("log")
        ax1.set_ylabel("TTFT p99 (s)")
        ax1.set_title("time to first token (star: goodput)")
        ax2.plot(offered, [r["input_tok_per_s"] for r in case["rates"]], color="black",
                 linestyle=":", label="offered")
        ax2.set_ylabel("input tokens/s sustained")
        ax2.set_title("throughput")
        for ax in (ax1, ax2):
            ax.set_xscale("log")
            ax.set_xlabel(f"offered requests/s (capacity "
                          f"{case['capacity_requests_per_s']:.2f}/s)")
            ax.grid(True, which="both", alpha=0.3)
            ax.xaxis.set_major_formatter(plain)
        ax1.yaxis.set_major_formatter(plain)
        ax1.legend(fontsize=7)
        fig.suptitle(f"{case['case']}: {results['machine']}, {results['date']}, "
                     f"disk {case['disk_read_gb_per_s']:.2f} GB/s, prefill "
                     f"{case['prefill_tok_per_s']:,.0f} tok/s")
        fig.tight_layout()
        png = stem.parent / f"{stem.name}-{case['case']}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    return written


def _load_results(p: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    try:
        results: object = json.loads(path.read_text())
    except OSError as exc:
        p.error(f"argument --plot: cannot read {str(path)!r}: {exc.strerror}")
    except ValueError:
        p.error(f"argument --plot: {str(path)!r} is not JSON")
    if not isinstance(results, dict) or results.get("bench") != "sweep" or not isinstance(
        results.get("cases"), list
    ):
        p.error(f"argument --plot: {str(path)!r} is not a results file of bench.sweep")
    return results


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
