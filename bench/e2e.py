"""End to end: a multi-round chat whose KV working set is several times GPU + host.

    python -m bench.e2e --model 70b-class --layers 8 --users 64 [--load 0.7] [--write]
    python -m bench.e2e --plot bench/results/e2e-h200-YYYYMMDD.json

Five configurations at the same pool sizes, same workload, same offered load:

  a  no reuse                    every request its own cache salt: everything recomputed
  b  GPU-only prefix cache       no host, no disk
  c  GPU + host                  no disk
  d  GPU + host + disk           statekv's asynchronous spill and onboard
  e  GPU + host + disk, naive    the same tier, but disk reads and writes run inside the
                                 cache calls on the serving loop's thread

For each: TTFT p50 / p99, output tok/s, input tok/s sustained vs offered, prompt tokens by
the tier they came from.  The offered load is set from a calibration in the same run: the
model's prefill rate (tokens/s) and the compute each request needs when its history is
reused; `--load` is the fraction of that capacity offered.

Why the model: per DEVICE.md, the KV of a 70B-class layer (8 kv heads x 128, bf16) costs
4 KiB per token and recomputing it takes long enough that reading it back at about 1.6 GB/s
or more breaks even at 4k-token prefixes; the disk there reads at about 2 GB/s.  A few
layers keep the ratio (FLOPs per KV byte is a property of one layer) and fit one GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from bench.disk_limits import raw_read_rate
from bench.flags import (
    OneLineParser,
    int_at_least,
    positive_number,
)
from bench.plots import load_results
from bench.results_files import machine_name, source_commit
from bench.serving import (
    CONFIGS,
    NAMES,
    SYNCHRONOUS_IO,
    add_run_flags,
    breakdown_line,
    budgets_for,
    chat_config,
    full_reuse_capacity,
    pool_blocks,
    prefill_rate,
    pyplot,
    run_config,
    step_parts_line,
    summarize,
)
from models.config import preset
from models.model import PagedDecoder
from models.serving_loop import TTFTBreakdown


def plot(results: dict[str, Any], path: Path) -> bool:
    """Draw `results` (a results file of this benchmark: its "summaries" and metadata) to
    `path`; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig = draw(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def draw(results: dict[str, Any]) -> Any:
    """TTFT p50/p99 bars (linear axis from 0, labelled with their values) and prompt tokens by
    tier, one bar per configuration in the file; a tier that served no token in any of them
    says so in the legend.  The title names the machine, the date and the commit."""
    plt = pyplot()
    assert plt is not None
    summaries: dict[str, dict[str, float]] = results["summaries"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    keys = [k for k in CONFIGS if k in summaries]
    labels = [f"({k}) {NAMES[k]}" for k in keys]
    p50 = [summaries[k]["ttft_p50_s"] for k in keys]
    p99 = [summaries[k]["ttft_p99_s"] for k in keys]
    x = range(len(keys))
    for offset, values, label in ((-0.2, p50, "TTFT p50"), (0.2, p99, "TTFT p99")):
        bars = ax1.bar([i + offset for i in x], values, width=0.4, label=label)
        ax1.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax1.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=8)
    ax1.set_ylabel("TTFT (s)")
    ax1.set_ylim(0, 1.2 * max(p50 + p99, default=1.0))
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title("time to first token")
    bottom = [0.0] * len(keys)
    for tier, color in (("tokens_gpu", "#4c72b0"), ("tokens_host", "#55a868"),
                        ("tokens_disk", "#c44e52"), ("tokens_computed", "#8c8c8c")):
        values = [summaries[k][tier] / 1e3 for k in keys]
        name = {"tokens_gpu": "from GPU", "tokens_host": "from host",
                "tokens_disk": "from disk"}.get(tier, "computed")
        if not any(values):
            name += " (0 in every configuration)"
        ax2.bar(list(x), values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax2.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=8)
    ax2.set_ylabel("prompt tokens (thousands)")
    ax2.set_ylim(0, 1.35 * max(bottom, default=1.0))
    ax2.legend(loc="upper right", fontsize=8, ncol=2)
    ax2.set_title("where prompt tokens came from")
    missing = [k for k in CONFIGS if k not in summaries]
    title = (f"bench.e2e on {results.get('machine', '?')}, {results.get('date', '?')}, "
             f"commit {str(results.get('commit') or '?')[:7]}")
    if missing:
        title += f"; not in this run: {', '.join(f'({k})' for k in missing)}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_from_file(p: argparse.ArgumentParser, path: Path) -> int:
    """`--plot`: the PNG beside a results file, drawn from the file alone."""
    results = load_results(p, path, "e2e", "summaries", dict)
    png = path.with_suffix(".png")
    if not plot(results, png):
        p.error("argument --plot: matplotlib is not installed (pip install matplotlib)")
    print(f"wrote {png}")
    return 0


def main() -> int:
    p = OneLineParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="70b-class")
    p.add_argument("--history-tokens", type=int_at_least(0), default=3072)
    p.add_argument("--load", type=positive_number, default=0.7,
                   help="fraction of capacity offered")
    p.add_argument("--write", action="store_true")
    add_run_flags(p, layers=8)
    p.add_argument("--plot", type=Path, default=None, metavar="RESULTS_JSON",
                   help="only draw the PNG of a results file, beside it")
    args = p.parse_args()
    if args.plot is not None:
        return plot_from_file(p, args.plot)

    from io_actors.embed import resolve_device

    device = resolve_device(args.device)
    if args.machine is None:
        args.machine = machine_name(device)
    if args.cuda_graphs and device.type != "cuda":
        p.error(f"argument --cuda-graphs: CUDA graphs need a CUDA device, not {str(device)!r}")
    model_config = preset(args.model, num_layers=args.layers)
    started = time.perf_counter()
    model = PagedDecoder(model_config, device=device, cuda_graphs=args.cuda_graphs)
    print(f"model {args.model} x{args.layers} layers on {device}: built in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    kv_token = model_config.kv_bytes_per_token()
    block_bytes = kv_token * args.block_size
    blocks = pool_blocks(model_config, args.block_size, args.gpu_gib, args.host_gib,
                         args.disk_gib)

    # Same-run calibration: the model's prefill rate and the disk's raw read rate.
    context = args.system_tokens + args.history_tokens
    tps = prefill_rate(model, args.block_size, 2048, context)
    disk_dir = args.dir or Path("/tmp/statekv-e2e")
    disk_dir.mkdir(parents=True, exist_ok=True)
    disk = raw_read_rate(disk_dir, block_bytes=block_bytes, threads=args.readers,
                         total_bytes=2 * 2**30)
    recompute_s_per_token = 1 / tps
    read_s_per_token = kv_token / (disk.gb_per_s * 1e9)
    print(f"prefill {tps:,.0f} tok/s at context {context}; disk read {disk.gb_per_s:.2f} GB/s; "
          f"per token: recompute {recompute_s_per_token * 1e6:.1f} us vs read "
          f"{read_s_per_token * 1e6:.1f} us ({kv_token} bytes of KV)", flush=True)

    # Offered load: the compute a request needs when its history is reused.
    vocab = model_config.vocab_size
    capacity = full_reuse_capacity(
        chat_config(args, vocab, 1.0, history_tokens=args.history_tokens), tps)
    rate = args.load * capacity
    new_later = args.question_tokens + args.answer_tokens
    working_set = args.users * (context + args.rounds * new_later) * kv_token
    print(f"offered {rate:.2f} requests/s ({args.load:.0%} of {capacity:.2f}); working set "
          f"{working_set / 2**30:.1f} GiB vs GPU+host {args.gpu_gib + args.host_gib:.1f} GiB",
          flush=True)

    summaries: dict[str, dict[str, float]] = {}
    for key in args.configs:
        started = time.perf_counter()
        run = run_config(model, key,
                         chat_config(args, vocab, rate, history_tokens=args.history_tokens),
                         budgets_for(key, args, blocks), device=str(device), disk_dir=disk_dir,
                         args=args)
        arrivals = max(r.arrival for r in run.results) or 1.0
        offered = sum(r.prompt_tokens for r in run.results) / arrivals
        summaries[key] = summarize(run, offered)
        s = summaries[key]
        print(f"({key}) {NAMES[key]:<30} TTFT p50 {s['ttft_p50_s']:7.2f} s  p99 "
              f"{s['ttft_p99_s']:7.2f} s  in {s['input_tok_per_s']:9,.0f} tok/s "
              f"({s['sustained_vs_offered']:.2f}x offered)  out "
              f"{s['output_tok_per_s']:7,.0f} tok/s  tiers gpu/host/disk/computed "
              f"{s['tokens_gpu']:.0f}/{s['tokens_host']:.0f}/{s['tokens_disk']:.0f}/"
              f"{s['tokens_computed']:.0f}  [{time.perf_counter() - started:.0f} s]",
              flush=True)
        print(f"    {breakdown_line(s)}", flush=True)
        print(f"    {step_parts_line(s)}", flush=True)
        # (e) reads inside the cache calls: no read is ever in flight between its steps.
        if key not in SYNCHRONOUS_IO and s["queued_on_disk_s"] > 0:
            print(f"    queued on disk {s['queued_on_disk_s']:.2f} s, disk reading "
                  f"{s['queued_on_disk_reading_s'] / s['queued_on_disk_s']:.0%} of it",
                  flush=True)

    if args.write:
        # Only a run asked to write leaves files (a run without --write once left a plot
        # in bench/results/ under another machine's name).
        args.out.mkdir(parents=True, exist_ok=True)
        today = dt.date.today()
        png = args.out / f"e2e-{args.machine}-{today:%Y%m%d}.png"
        if plot({"bench": "e2e", "machine": args.machine, "date": today.isoformat(),
                 "commit": source_commit(), "summaries": summaries}, png):
            print(f"wrote {png}")
        figures: dict[str, dict[str, object]] = {}
        if "c" in summaries and "d" in summaries:
            ratio = summaries["d"]["ttft_p50_s"] / summaries["c"]["ttft_p50_s"]
            figures["ttft_p50_d_vs_c"] = {"value": round(ratio, 3), "unit": "x",
                                          "ratio": round(ratio, 3)}
        for key, s in summaries.items():
            figures[f"{key}_sustained_input_vs_offered"] = {
                "value": round(s["input_tok_per_s"], 1), "unit": "tok/s",
                "limit": round(s["offered_input_tok_per_s"], 1),
                "limit_name": "offered input tokens/s, same run",
                "ratio": round(s["sustained_vs_offered"], 3),
            }
            figures[f"{key}_ttft_p50"] = {"value": round(s["ttft_p50_s"], 4), "unit": "s"}
            figures[f"{key}_ttft_p99"] = {"value": round(s["ttft_p99_s"], 4), "unit": "s"}
            figures[f"{key}_output_tok_per_s"] = {"value": round(s["output_tok_per_s"], 1),
                                                  "unit": "tok/s"}
            for part in TTFTBreakdown.PARTS if s["breakdown_requests"] else ():
                figures[f"{key}_ttft_mean_{part[:-2]}"] = {
                    "value": round(s[f"breakdown_{part}_mean"], 4), "unit": "s",
                    "limit": round(s["breakdown_ttft_s_mean"], 4),
                    "limit_name": "mean TTFT, same run",
                    "ratio": round(s[f"breakdown_{part}_share"], 3)}
            if key not in SYNCHRONOUS_IO and s["queued_on_disk_s"] > 0:
                figures[f"{key}_disk_reading_while_queued_on_disk"] = {
                    "value": round(s["queued_on_disk_reading_s"], 3), "unit": "s",
                    "limit": round(s["queued_on_disk_s"], 3),
                    "limit_name": "time the prefetch window waited on disk, same run",
                    "ratio": round(s["queued_on_disk_reading_s"] / s["queued_on_disk_s"], 3)}
        figures["disk_read_raw"] = {"value": round(disk.gb_per_s, 3), "unit": "GB/s"}
        figures["prefill_rate"] = {"value": round(tps, 1), "unit": "tok/s"}
        commit = source_commit()
        out = args.out / f"e2e-{args.machine}-{today:%Y%m%d}.json"
        out.write_text(json.dumps({
            "bench": "e2e", "machine": args.machine, "date": today.isoformat(),
            "commit": commit, "command": "python -m bench.e2e " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if k not in ("write", "dir", "out", "plot")),
            "figures": figures, "summaries": summaries,
        }, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
