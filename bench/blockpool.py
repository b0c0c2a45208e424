"""The core's GPU-tier bookkeeping against vLLM v1's prefix-caching block pool, one trace.

    python -m bench.blockpool [--repeats 21] [--write]      (in .venv-vllm: it imports vLLM)
    python -m bench.blockpool --statekv-only --profile      (any venv: statekv's side alone)

One seeded multi-round chat trace is driven through

(a) vLLM v1's ``KVCacheManager`` (its ``BlockPool`` beneath, a single full-attention group)
    as vLLM's scheduler calls it: per admitted request ``get_computed_blocks`` then
    ``allocate_slots(request, new tokens, hit tokens, hit blocks)``, per decode step
    ``new_step_starts`` once and ``allocate_slots(request, 1)`` for each running request,
    ``free`` when it finishes; between steps the request's ``num_computed_tokens`` advances
    and ``append_output_token_ids`` adds the sampled token (vLLM hashes new full blocks
    there, with ``get_request_block_hasher`` over its default ``sha256``, as its engine core
    does);
(b) statekv's ``KVCacheManager`` with a GPU pool only, the same sizes: ``add_request``,
    ``allocate_nowait`` + ``commit`` for the prompt and then once per decode step,
    ``append_tokens`` for each sampled token, ``release`` when it finishes.

The trace: ``--users`` users, ``--rounds`` rounds; a user's prompt in a round is their
previous prompt, the previous answer and a new turn, so each round matches the earlier rounds'
blocks again (each user has a cache salt of their own on both sides).  A round serves the
users in a seeded order, ``--batch`` at a time: the batch is admitted, then decoded in lock
step, each request freed after its last token.  Two shapes of the same trace: *per_token*
decodes one token per step (every step calls each side once per running request), and
*per_chunk* computes each answer in one step (the same blocks allocated, cached, evicted and
freed, in a few calls per request: the per-block bookkeeping, with the per-call costs
amortized away).  The GPU pool holds ``--pool-fraction`` of the trace's distinct blocks
(never fewer than the largest batch needs), so both sides evict.
vLLM gets one block more than statekv: its block 0 is a placeholder it never hands out.

Timed region (``time.thread_time``, gc off, both sides alike): every call above, and the
loop driving them; the managers and vLLM's ``Request`` objects are made before it (vLLM's
request intake -- sampling parameters, output buffers -- is the engine's, not the block
pool's).  statekv's ``add_request`` and ``append_tokens`` also check their arguments and
encode the tokens into its own request record: that stays in, counted against statekv.  Two
figures per shape, each the median over ``--repeats`` pairs of runs of (statekv CPU time /
vLLM CPU time), the two sides interleaved (a, b; b, a; ...) in one process, a first pair
uncounted (warm-up):

* **bookkeeping** -- both block hashers replaced by a lookup of keys computed before the
  timed region with each side's own hasher (vLLM: ``block_hasher`` returns the precomputed
  slice; statekv: ``statekv.prefix_index.extend_chain`` extends from the precomputed list),
  so neither side hashes inside it (statekv still makes one blake2b root key per request
  from the salt);
* **with hashing** -- each side's real hasher (vLLM: pickle + sha256 per block; statekv:
  blake2b-256 over little-endian uint32 tokens per block).

Both sides must see the same prefix hits; the run fails if their hit tokens differ by more
than 1%.
"""

from __future__ import annotations

import cProfile
import datetime as dt
import gc
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

import statekv.prefix_index as prefix_index_module
from bench.flags import OneLineParser, fraction, int_at_least
from statekv import CacheConfig, KVCacheManager
from statekv.hashing import extend_chain, root_key, token_bytes
from statekv.ids import BlockHash

BLOCK_SIZE = 16
VOCAB = 32_000


@attrs.frozen
class Turn:
    """One request of the trace: a user's prompt this round and the answer it generates."""

    rid: str
    user: int
    prompt: list[int]
    answer: list[int]


@attrs.frozen
class Step:
    """One request's share of one engine step after its prefill: `extra` tokens known
    before the step (a chunk's tokens past the first), KV computed up to `total` tokens, then
    `sampled` appended; `last` when the request finishes with it."""

    index: int
    """Of the request within its batch."""
    extra: list[int]
    total: int
    sampled: list[int]
    last: bool

    @property
    def sampled_id(self) -> int:
        return self.sampled[0]


@attrs.frozen
class Trace:
    batches: list[list[Turn]]
    steps: list[list[list[Step]]]
    """For each batch, its engine steps after the prefill: what each running request does."""
    conversations: list[list[int]]
    """Each user's whole token sequence (the last round's prompt and answer): every prompt
    of the user is a prefix of it, so the keys of its blocks are prefixes of its keys."""
    pool_blocks: int
    distinct_blocks: int


def chat_trace(*, seed: int, users: int, rounds: int, batch: int,
               pool_fraction: float, chunk: int) -> Trace:
    """`chunk`: tokens a running request computes per step (1: decoding as a serving loop
    does; more: the same blocks in fewer calls, as a chunked prefill or a speculative step
    would)."""
    rng = random.Random(seed)
    history: list[list[int]] = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(200, 600))] for _ in range(users)
    ]
    batches: list[list[Turn]] = []
    for r in range(rounds):
        order = list(range(users))
        rng.shuffle(order)
        turns = []
        for u in order:
            if r:
                history[u] += [rng.randrange(VOCAB) for _ in range(rng.randint(20, 120))]
            answer = [rng.randrange(VOCAB) for _ in range(rng.randint(30, 150))]
            turns.append(Turn(f"u{u}r{r}", u, list(history[u]), answer))
            history[u] += answer
        batches += [turns[i:i + batch] for i in range(0, len(turns), batch)]
    steps = [_steps(turns, chunk) for turns in batches]
    distinct = sum(len(h) // BLOCK_SIZE for h in history)
    widest = max(sum(-(-(len(t.prompt) + len(t.answer)) // BLOCK_SIZE) for t in b)
                 for b in batches)
    pool = max(int(distinct * pool_fraction), widest + batch)
    return Trace(batches, steps, history, pool, distinct)


def _steps(turns: list[Turn], chunk: int) -> list[list[Step]]:
    """After its prefill (the prompt computed, the first answer token sampled), a request
    computes its answer but the last token, `chunk` tokens a step, one sampled each step."""
    plans: list[list[Step]] = []
    for i, t in enumerate(turns):
        n, answer = len(t.prompt), t.answer
        done, appended, end = n, 1, n + len(answer) - 1
        plan = []
        while done < end:
            k = min(chunk, end - done)
            extra = answer[appended:appended + k - 1]
            appended += k - 1
            done += k
            plan.append(Step(i, extra, done, answer[appended:appended + 1], done == end))
            appended += 1
        plans.append(plan)
    width = max(len(p) for p in plans)
    return [[p[k] for p in plans if k < len(p)] for k in range(width)]


class _TimedRegion:
    """The timed region of both sides: garbage collected and then gc off, `profile` (when
    given) on, and the calling thread's CPU time from entering to leaving it in `elapsed`."""

    def __init__(self, profile: cProfile.Profile | None) -> None:
        self.profile = profile
        self.elapsed = 0.0
        self._start = 0.0

    def __enter__(self) -> _TimedRegion:
        gc.collect()
        gc.disable()
        if self.profile is not None:
            self.profile.enable()
        self._start = time.thread_time()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.elapsed = time.thread_time() - self._start
        if self.profile is not None:
            self.profile.disable()
        gc.enable()


# ---------------------------------------------------------------------- statekv's side

def statekv_keys(trace: Trace) -> dict[bytes, list[BlockHash]]:
    """Each user's chained keys (by their root key, which their salt makes their own)."""
    out: dict[bytes, list[BlockHash]] = {}
    for user, tokens in enumerate(trace.conversations):
        root = root_key("", f"user{user}", None)
        keys: list[BlockHash] = []
        extend_chain(keys, root, token_bytes(tokens), BLOCK_SIZE, len(tokens) // BLOCK_SIZE)
        out[root] = keys
    return out


def run_statekv(trace: Trace, keys: dict[bytes, list[BlockHash]] | None,
                profile: cProfile.Profile | None = None) -> tuple[float, int]:
    """CPU seconds of the timed region, and the prompt tokens matched."""
    cache = KVCacheManager(CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=trace.pool_blocks))
    salts = [f"user{u}" for u in range(len(trace.conversations))]
    # The prefix index calls its module's extend_chain: swapped there for the lookup.
    namespace = vars(prefix_index_module)
    saved = namespace["extend_chain"]
    if keys is not None:
        def lookup(out: list[BlockHash], root: BlockHash, encoded_tokens: bytes | bytearray,
                   block_size: int, upto: int) -> None:
            out += keys[root][len(out):upto]
        namespace["extend_chain"] = lookup
    add, allocate, commit = cache.add_request, cache.allocate_nowait, cache.commit
    append, release = cache.append_tokens, cache.release
    matched = 0
    now = 0.0
    try:
        with _TimedRegion(profile) as timed:
            for turns, steps in zip(trace.batches, trace.steps, strict=True):
                for t in turns:
                    matched += add(t.rid, t.prompt, now=now,
                                   cache_salt=salts[t.user]).matched_tokens
                    n = len(t.prompt)
                    allocate(t.rid, n, now=now)
                    commit(t.rid, n, now=now)
                    append(t.rid, t.answer[:1])
                for step in steps:
                    now += 1.0
                    for s in step:
                        rid = turns[s.index].rid
                        if s.extra:
                            append(rid, s.extra)
                        allocate(rid, s.total, now=now)
                        commit(rid, s.total, now=now)
                        append(rid, s.sampled)
                        if s.last:
                            release(rid, now=now)
    finally:
        namespace["extend_chain"] = saved
    return timed.elapsed, matched


# ---------------------------------------------------------------------- vLLM's side

class VllmSide:
    """vLLM's KVCacheManager, made as its scheduler makes it (one full-attention group)."""

    def __init__(self) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.request import Request, RequestStatus

        self.torch = torch
        self.manager_class = VllmManager
        self.config_class = KVCacheConfig
        self.group = KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32))
        hash_fn = get_hash_fn_by_name("sha256")  # CacheConfig.prefix_caching_hash_algo
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.request_class = Request
        self.running = RequestStatus.RUNNING
        self.sampling = SamplingParams(max_tokens=1 << 20, detokenize=False, ignore_eos=True)

    def keys(self, trace: Trace) -> list[list[Any]]:
        """Each user's block hashes, computed with vLLM's own hasher."""
        out = []
        for user, tokens in enumerate(trace.conversations):
            req = self.request_class(f"keys{user}", list(tokens), self.sampling, None,
                                     cache_salt=f"user{user}", block_hasher=self.hasher)
            out.append(req.block_hashes)
        return out

    def run(self, trace: Trace, keys: list[list[Any]] | None,
            profile: cProfile.Profile | None = None) -> tuple[float, int]:
        manager = self.manager_class(
            self.config_class(num_blocks=trace.pool_blocks + 1, kv_cache_tensors=[],
                              kv_cache_groups=[self.group]),
            max_model_len=1 << 20, scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE, enable_caching=True)
        hashers: list[Callable[[Any], list[Any]]] = []
        for user in range(len(trace.conversations)):
            if keys is None:
                hashers.append(self.hasher)
            else:
                def lookup(request: Any, pre: list[Any] = keys[user]) -> list[Any]:
                    return pre[len(request.block_hashes):request.num_tokens // BLOCK_SIZE]
                hashers.append(lookup)
        # Made outside the timed region, without a hasher: the hashing Request.__init__
        # would do is done inside it (update_block_hashes), once the hasher is set.
        requests = {
            t.rid: self.request_class(t.rid, list(t.prompt), self.sampling, None,
                                      cache_salt=f"user{t.user}")
            for turns in trace.batches for t in turns
        }
        get_computed, allocate = manager.get_computed_blocks, manager.allocate_slots
        new_step, free = manager.new_step_starts, manager.free
        running = self.running
        matched = 0
        with _TimedRegion(profile) as timed:
            for turns, steps in zip(trace.batches, trace.steps, strict=True):
                new_step()
                reqs = []
                for t in turns:
                    req = requests[t.rid]
                    req._block_hasher = hashers[t.user]
                    req.update_block_hashes()
                    blocks, hit, _ = get_computed(req)
                    new_blocks = allocate(req, req.num_tokens - hit, hit, blocks)
                    assert new_blocks is not None
                    matched += hit
                    req.status = running
                    req.num_computed_tokens = req.num_tokens
                    req.append_output_token_ids(t.answer[0])
                    reqs.append(req)
                for step in steps:
                    new_step()
                    for s in step:
                        req = reqs[s.index]
                        if s.extra:
                            req.append_output_token_ids(s.extra)
                        new_blocks = allocate(req, s.total - req.num_computed_tokens)
                        assert new_blocks is not None
                        req.num_computed_tokens = s.total
                        req.append_output_token_ids(s.sampled_id)
                        if s.last:
                            free(req)
        return timed.elapsed, matched


# ---------------------------------------------------------------------- the comparison

def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


# The figures: (trace shape, tokens a running request computes per step, hashing on).
SHAPES = {"per_token": 1, "per_chunk": 1 << 30}
MODES = {"bookkeeping": False, "with_hashing": True}


def compare(traces: dict[str, Trace], repeats: int) -> dict[str, dict[str, Any]]:
    """Every (shape, mode) figure: the pairs of runs of one figure follow each other, a
    first pair warming both sides up uncounted, the side that runs first alternating."""
    vllm = VllmSide()
    out: dict[str, dict[str, Any]] = {}
    for shape, trace in traces.items():
        vllm_keys = vllm.keys(trace)
        ours_keys = statekv_keys(trace)
        for mode, hashed in MODES.items():
            ratios, ours_s, theirs_s = [], [], []
            hits: tuple[int, int] = (0, 0)
            v_keys = None if hashed else vllm_keys
            s_keys = None if hashed else ours_keys
            for i in range(repeats + 1):
                if i % 2:
                    ours, ours_hit = run_statekv(trace, s_keys)
                    theirs, theirs_hit = vllm.run(trace, v_keys)
                else:
                    theirs, theirs_hit = vllm.run(trace, v_keys)
                    ours, ours_hit = run_statekv(trace, s_keys)
                if abs(ours_hit - theirs_hit) > 0.01 * max(theirs_hit, 1):
                    raise SystemExit(f"the sides diverged: statekv matched {ours_hit} tokens, "
                                     f"vLLM {theirs_hit}")
                hits = (ours_hit, theirs_hit)
                if i:
                    ratios.append(ours / theirs)
                    ours_s.append(ours)
                    theirs_s.append(theirs)
            med, lo, hi = _spread(ratios)
            name = f"{shape}_{mode}"
            out[name] = {"ratio": med, "ratio_min": lo, "ratio_max": hi,
                         "statekv_s": statistics.median(ours_s),
                         "vllm_s": statistics.median(theirs_s),
                         "statekv_hit_tokens": hits[0], "vllm_hit_tokens": hits[1]}
            print(f"{name:<24} statekv {out[name]['statekv_s'] * 1e3:7.1f} ms  "
                  f"vLLM {out[name]['vllm_s'] * 1e3:7.1f} ms  ratio {med:.3f}x "
                  f"(min {lo:.3f}, max {hi:.3f}, {repeats} pairs)  hit tokens {hits[0]}")
    return out


def _profile_statekv(trace: Trace, hashed: bool) -> None:
    profile = cProfile.Profile()
    run_statekv(trace, None if hashed else statekv_keys(trace), profile)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.blockpool",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int_at_least(0), default=20261202)
    parser.add_argument("--users", type=int_at_least(1), default=48)
    parser.add_argument("--rounds", type=int_at_least(1), default=6)
    parser.add_argument("--batch", type=int_at_least(1), default=8)
    parser.add_argument("--pool-fraction", type=fraction, default=0.5)
    parser.add_argument("--repeats", type=int_at_least(1), default=21)
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append",
                        help="only these trace shapes (default: all)")
    parser.add_argument("--statekv-only", action="store_true",
                        help="time statekv's side alone (no vLLM needed)")
    parser.add_argument("--profile", action="store_true",
                        help="with --statekv-only: cProfile one run of each figure")
    parser.add_argument("--core-commit", default="",
                        help="for --write: the commit of the statekv measured, when it is not "
                             "this checkout's (a before-and-after run)")
    parser.add_argument("--write", action="store_true",
                        help="write bench/results/blockpool-cpu-<date>.json")
    args = parser.parse_args(argv)
    traces = {
        shape: chat_trace(seed=args.seed, users=args.users, rounds=args.rounds,
                          batch=args.batch, pool_fraction=args.pool_fraction, chunk=chunk)
        for shape, chunk in SHAPES.items() if not args.shape or shape in args.shape
    }
    trace = next(iter(traces.values()))
    requests = sum(len(b) for b in trace.batches)
    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
          f"python {platform.python_version()}; trace: {requests} requests, "
          f"{trace.distinct_blocks} distinct blocks, GPU pool {trace.pool_blocks} blocks")
    if args.statekv_only:
        for shape, trace in traces.items():
            keys = statekv_keys(trace)
            for mode, hashed in MODES.items():
                k = None if hashed else keys
                if args.profile:
                    print(f"--- {shape}_{mode}")
                    _profile_statekv(trace, hashed)
                    continue
                runs = [run_statekv(trace, k) for _ in range(args.repeats)]
                med, lo, hi = _spread([sec for sec, _ in runs])
                print(f"{shape + '_' + mode:<24} statekv {med * 1e3:7.1f} ms "
                      f"(min {lo * 1e3:.1f}, max {hi * 1e3:.1f}), hit tokens {runs[0][1]}")
        return 0
    figures = compare(traces, args.repeats)
    if args.write:
        import vllm

        from bench.results_files import source_commit, write_new_results

        commit = source_commit()
        today = dt.date.today()
        shape_names = {"per_token": "decoding one token per step",
                       "per_chunk": "each answer in one step"}
        mode_names = {"bookkeeping": "hashing left out on both sides",
                      "with_hashing": "each side's own block hashing included"}
        figs: dict[str, dict[str, Any]] = {}
        for shape in traces:
            for mode in MODES:
                f = figures[f"{shape}_{mode}"]
                figs[f"{shape}_{mode}_vs_vllm"] = {
                    "value": round(f["ratio"], 3), "unit": "x", "ratio": round(f["ratio"], 3),
                    "min": round(f["ratio_min"], 3), "max": round(f["ratio_max"], 3),
                    "limit_name": "statekv CPU time over vLLM v1 KVCacheManager/BlockPool's, "
                                  f"same trace, same run ({shape_names[shape]}; "
                                  f"{mode_names[mode]}), median of the pairs",
                    "statekv_cpu_s": round(f["statekv_s"], 4),
                    "vllm_cpu_s": round(f["vllm_s"], 4),
                    "hit_tokens": f["statekv_hit_tokens"],
                    "repeats": args.repeats,
                }
        result = {
            "bench": "blockpool", "machine": "cpu", "date": today.isoformat(), "commit": commit,
            "command": "python -m bench.blockpool " + " ".join(sys.argv[1:]),
            "core_commit": args.core_commit or commit,
            "vllm": vllm.__version__,
            "trace": {"seed": args.seed, "users": args.users, "rounds": args.rounds,
                      "batch": args.batch, "requests": requests,
                      "distinct_blocks": trace.distinct_blocks,
                      "pool_blocks": trace.pool_blocks, "block_size": BLOCK_SIZE},
            "figures": figs,
        }
        print(f"wrote {write_new_results('blockpool', 'cpu', today, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
