"""Tensor-parallel check: the ranks' caches agree, and a head-split model serves identically.

Three phases on every rank, then one verdict:

1. **agreement** -- each rank drives its own cache (own pools, own ``rank_<r>`` slot
   directory) through the same request sequence while its slot store delays every read and
   write by a random, per-rank amount; rank 1 fails one read and rank 0 one write.  Every
   rank must take the same decision at every step (which requests were admitted, their
   prefix hits by tier, which became ready), end with identical prefix trees and counters,
   and read back its own bytes.  Each rank's clock is skewed and rank 0's jumps backwards
   once: only the agreed clock may decide retention.
2. **serving** -- the serving loop runs a multi-round chat on the model with its attention
   heads (and FFN) split across the ranks, KV in statekv with a disk tier: every rank must
   run identical batches (same tokens, positions, page tables) and produce identical tokens.
3. **reference** -- rank 0 serves the same chat on one device with the whole model; its
   tokens must equal the tensor-parallel run's.

Launch (each rank uses the GPU of its local rank; NCCL for the model, gloo for the cache's
agreement)::

    torchrun --nproc_per_node 2 -m bench.tp_check            # 2 GPUs, NCCL
    python -m bench.tp_check --nproc 2                        # the same, spawning itself
    python -m bench.tp_check --nproc 2 --device cpu           # CPUs, gloo

Rank 0 prints one PASS/FAIL line per check and ``RESULT: PASS`` or ``RESULT: FAIL``; the
exit status is 0 only for PASS.  Every rank has a watchdog (``--deadline``): a hang ends as
a FAIL with status 124, never as a stuck job.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache, CacheAPI
from io_actors.storage.faults import FaultPlan, FaultRule, FaultyStore
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore
from io_actors.storage.open_store import open_slot_store
from io_actors.storage.slot_format import SlotMeta
from io_actors.tensor_parallel.agreement import ParallelLayout, RankGroup, TensorParallelCache
from models.config import ModelConfig
from models.model import Chunk, PagedDecoder, StepOutput
from models.serving_loop import RequestResult, ServeRequest, ServingLoop
from statekv.config import KVLayout
from statekv.errors import OutOfBlocks
from statekv.ids import BlockHash, SlotId

PINNED_ENV: Final = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""Set on every rank before any process group exists (NVLink multicast stays off)."""

TINY: Final = ModelConfig(
    vocab_size=256, hidden=64, ffn=128, num_layers=2, num_heads=4, num_kv_heads=4,
    head_dim=16, dtype="float32", seed=11,
)
"""Runs on CPUs; 4 kv heads split over 2 or 4 ranks."""
SMALL: Final = ModelConfig(
    vocab_size=2048, hidden=512, ffn=1024, num_layers=4, num_heads=8, num_kv_heads=8,
    head_dim=64, dtype="float32", seed=11,
)
"""The GPU default: float32, so that the single-device reference is comparable token for
token (bf16 sums in a different order would flip near-ties)."""
MODELS: Final = {"tiny": TINY, "small": SMALL}

AGREEMENT_LAYOUT: Final = KVLayout(num_layers=1, num_kv_heads=1, head_dim=128, dtype="float32")
BLOCK_SIZE: Final = 4


def pin_environment() -> None:
    for key, value in PINNED_ENV.items():
        os.environ[key] = value


# ---------------------------------------------------------------------------- slot stores


class JitterStore:
    """A SlotStore that sleeps a random time before each read and write (seeded per rank),
    so that transfers land at different moments on different ranks."""

    def __init__(self, inner: SlotStore, seed: int, max_read_s: float,
                 max_write_s: float) -> None:
        self._inner = inner
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._max_read_s = max_read_s
        self._max_write_s = max_write_s

    @property
    def device_reads(self) -> bool:
        return self._inner.device_reads

    def _pause(self, most: float) -> None:
        with self._lock:
            delay = self._rng.uniform(0.0, most)
        time.sleep(delay)

    def write(
        self, slot: SlotId, key: BlockHash, src: Tensor, meta: SlotMeta | None = None
    ) -> None:
        self._pause(self._max_write_s)
        self._inner.write(slot, key, src, meta)

    def read(self, slot: SlotId, key: BlockHash, dst: Tensor) -> None:
        self._pause(self._max_read_s)
        self._inner.read(slot, key, dst)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        self._pause(self._max_write_s)
        return self._inner.write_many(writes)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        self._pause(self._max_read_s)
        return self._inner.read_many(reads)

    def discard(self, slot: SlotId) -> None:
        self._inner.discard(slot)

    def close(self) -> None:
        self._inner.close()


def make_store(
    config: StateKVConfig,
    *,
    seed: int,
    max_read_s: float,
    max_write_s: float,
    fail_read: int | None = None,
    fail_write: int | None = None,
) -> SlotStore:
    """The rank's POSIX store in its own directory, jittered, failing the given calls."""
    directory = config.rank_directory()
    assert directory is not None
    store: SlotStore = JitterStore(
        open_slot_store("posix", directory, config.core_config()),
        seed, max_read_s, max_write_s,
    )
    rules = []
    if fail_read is not None:
        rules.append(FaultRule(op="read", fault="eio", nth=fail_read))
    if fail_write is not None:
        rules.append(FaultRule(op="write", fault="enospc", nth=fail_write))
    if rules:
        store = FaultyStore(store, FaultPlan(rules=tuple(rules), seed=seed))
    return store


# ---------------------------------------------------------------------------- records


def normalized(record: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists, as after a JSON round trip: records compare the same either way."""
    out: dict[str, Any] = json.loads(json.dumps(record))
    return out


def cache_record(cache: CacheAPI) -> dict[str, Any]:
    """What must be identical on every rank: counters and the prefix index."""
    stats = attrs.asdict(cache.statistics().cache)
    blocks = sorted(
        [b.key.hex(), b.state.name, b.ref_count, b.reuse_count, b.expiry, b.depth, b.priority]
        for b in cache.cached_blocks()
    )
    return normalized({"stats": stats, "blocks": blocks})


class SkewedClock:
    """time.time() plus a per-rank offset; on rank 0 it also steps back 50 ms once (the
    agreed clock must not follow it backwards)."""

    def __init__(self, rank: int) -> None:
        self._offset = 1000.0 * rank
        self._jump_at = 20 if rank == 0 else -1
        self._calls = 0

    def __call__(self) -> float:
        self._calls += 1
        back = 0.05 if self._calls >= self._jump_at >= 0 else 0.0
        return time.time() + self._offset - back


# ---------------------------------------------------------------------------- phase 1


def _payload(rank: int, tokens: Sequence[int], nbytes: int, device: torch.device) -> Tensor:
    """The KV bytes of the block that ends `tokens` on `rank` (each rank's shard differs)."""
    digest = hashlib.blake2b(repr((rank, list(tokens))).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    data = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return data.to(device)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def _agreement_requests(seed: int, users: int, rounds: int) -> list[tuple[str, list[int],
                                                                          float | None]]:
    """Multi-round conversations, interleaved: the same list on every rank."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(8)]
    history = {u: system + [rng.randrange(1000) for _ in range(rng.randrange(4, 12))]
               for u in range(users)}
    ttl = {u: (None if u % 3 == 0 else rng.choice([0.02, 0.2, 3.0])) for u in range(users)}
    out: list[tuple[str, list[int], float | None]] = []
    for r in range(rounds):
        for u in range(users):
            if r:
                history[u] = history[u] + [rng.randrange(1000) for _ in range(rng.randrange(3,
                                                                                          9))]
            out.append((f"u{u}r{r}", list(history[u]), ttl[u]))
    return out


def run_agreement(
    group: RankGroup,
    disk_dir: Path,
    *,
    device: str,
    seed: int = 1,
    users: int = 10,
    rounds: int = 4,
    drop_on_pressure: bool = False,
    max_read_s: float = 0.012,
    max_write_s: float = 0.006,
    per_step: int = 1,
    step_s: float = 0.002,
    gpu_blocks: int = 24,
    max_steps: int = 5000,
) -> dict[str, Any]:
    """Phase 1 on this rank; returns its record (see the module docstring)."""
    rank = group.rank
    config = StateKVConfig(
        layout=AGREEMENT_LAYOUT, block_size=BLOCK_SIZE, gpu=gpu_blocks, host=4,
        reserved_host=2, disk=32, disk_dir=disk_dir, device=device, writers=2, readers=2,
        write_queue_depth=4, drop_on_pressure=drop_on_pressure, namespace="agreement",
        model_fingerprint="tp-agreement",
    )
    store = make_store(
        attrs.evolve(config, rank=rank), seed=1000 * seed + rank, max_read_s=max_read_s,
        max_write_s=max_write_s, fail_read=3 if rank == 1 else None,
        fail_write=5 if rank == 0 else None,
    )
    steps: list[Any] = []
    clock_seen: list[float] = []
    bad_pages = 0
    try:
        with TensorParallelCache(config, group, store=store) as tp:
            cache = tp.cache
            pool = cache.kv_pool
            nbytes = pool[0].numel() * pool.element_size()
            pending = deque(_agreement_requests(seed, users, rounds))
            parked: set[str] = set()
            tokens_of: dict[str, list[int]] = {}
            finishing: list[str] = []
            for _ in range(max_steps):
                # A request computed last step (its "forward pass") finishes now.
                for rid in finishing:
                    cache.release(rid)
                    del tokens_of[rid]
                finishing = []
                if not pending and not tokens_of:
                    break
                admitted: list[list[Any]] = []
                # Admission as the serving loop does it: only while the pages every admitted
                # request still needs are sure, so no request waits on another's pages.
                spare = cache.obtainable_gpu_blocks() - sum(
                    _blocks(len(t)) - len(cache.block_table(r)) for r, t in tokens_of.items()
                )
                while pending and len(tokens_of) < 3 and len(admitted) < per_step:
                    rid, tokens, ttl = pending[0]
                    if _blocks(len(tokens)) > spare:
                        break
                    try:
                        match = cache.add_request(rid, tokens, ttl_seconds=ttl)
                    except OutOfBlocks:
                        break
                    pending.popleft()
                    spare -= _blocks(len(tokens))
                    tokens_of[rid] = tokens
                    if not match.ready:
                        parked.add(rid)
                    admitted.append([rid, match.gpu_tokens, match.host_tokens,
                                     match.disk_tokens, match.ready])
                ready = tp.ready_everywhere(sorted(parked))
                clock_seen.append(tp.clock())
                parked -= ready
                done = []
                for rid in sorted(tokens_of):
                    if rid in parked or cache.request_status(rid).num_computed_tokens == len(
                        tokens_of[rid]
                    ):
                        continue
                    tokens = tokens_of[rid]
                    table = cache.block_table(rid)
                    have = cache.request_status(rid).num_computed_tokens // BLOCK_SIZE
                    for i in range(have):
                        page = pool[table[i]].reshape(-1).view(torch.uint8)
                        expected = _payload(rank, tokens[: (i + 1) * BLOCK_SIZE], nbytes,
                                            pool.device)
                        bad_pages += int(not torch.equal(page, expected))
                    try:
                        cache.allocate_nowait(rid, len(tokens))
                    except OutOfBlocks:
                        continue
                    table = cache.block_table(rid)
                    for i in range(have, len(table)):
                        end = min((i + 1) * BLOCK_SIZE, len(tokens))
                        pool[table[i]].reshape(-1).view(torch.uint8).copy_(
                            _payload(rank, tokens[:end], nbytes, pool.device))
                    cache.commit(rid, len(tokens))
                    finishing.append(rid)
                    done.append(rid)
                steps.append([admitted, sorted(ready), done])
                # The step's forward pass: transfers make progress meanwhile.
                time.sleep(step_s)
            else:
                raise TimeoutError(f"the agreement scenario did not finish in {max_steps} steps")
            tp.quiesce()
            tp.check_agreement()
            record = cache_record(cache)
            agreement = attrs.asdict(tp.statistics())
    finally:
        store.close()
    return normalized({
        **record, "steps": steps, "bad_pages": bad_pages, "agreement": agreement,
        "clock_monotonic": all(a <= b for a, b in itertools.pairwise(clock_seen)),
    })


# ---------------------------------------------------------------------------- phases 2, 3


class RecordingDecoder(PagedDecoder):
    """A PagedDecoder that records every batch it runs (tokens, positions, page tables)."""

    def __init__(self, config: ModelConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.batches: list[list[Any]] = []

    def forward(self, pool: Tensor, chunks: Sequence[Chunk], *,
                all_logits: bool = False) -> StepOutput:
        self.batches.append(
            [[list(c.token_ids), c.start, list(c.block_table)] for c in chunks]
        )
        return super().forward(pool, chunks, all_logits=all_logits)


def _chat_rounds(seed: int, users: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Each user's first prompt (a shared system prompt, then their own text) and the
    length of the question each later round adds."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(10)]
    firsts = [system + [rng.randrange(vocab) for _ in range(rng.randrange(6, 14))]
              for _ in range(users)]
    return firsts, [rng.randrange(4, 9) for _ in range(users)]


def run_serving(
    group: RankGroup | None,
    disk_dir: Path,
    *,
    device: str,
    model: ModelConfig = TINY,
    seed: int = 3,
    users: int = 6,
    rounds: int = 3,
    max_new_tokens: int = 4,
    gpu_blocks: int = 28,
    jitter: bool = True,
    namespace: str = "serving",
) -> dict[str, Any]:
    """Phase 2 (group given: this rank's share of the model) or 3 (no group: the whole
    model on one device); returns the record."""
    rank = group.rank if group is not None else 0
    world = group.world_size if group is not None else 1
    config = StateKVConfig(
        layout=model.kv_layout(world), block_size=BLOCK_SIZE, gpu=gpu_blocks, host=6,
        reserved_host=2, disk=96, disk_dir=disk_dir, device=device,
        model_fingerprint=model.fingerprint(), namespace=namespace,
    )
    store = (
        make_store(attrs.evolve(config, rank=rank), seed=77 + rank, max_read_s=0.01,
                   max_write_s=0.005)
        if jitter else None
    )
    results: list[RequestResult] = []
    tp: TensorParallelCache | None = None
    cache: BlockingCache
    try:
        with contextlib.ExitStack() as stack:
            # The tensor-parallel cache closes its BlockingCache itself (after letting held
            # completions through): never close that one directly.
            if group is not None:
                tp = stack.enter_context(TensorParallelCache(config, group, store=store))
                cache = tp.cache
            else:
                cache = stack.enter_context(BlockingCache(config, store=store))
            net = RecordingDecoder(
                model, device=cache.device, tp_rank=rank, tp_size=world,
                all_reduce=group.model_all_reduce if group is not None and world > 1 else None,
            )
            loop = ServingLoop(
                net, cache, max_step_tokens=64, prefill_chunk=32, max_running=3,
                batch_invariant=True,
                clock=tp.clock if tp is not None else time.perf_counter,
                ready_everywhere=tp.ready_everywhere if tp is not None else None,
            )
            prompts, questions = _chat_rounds(seed, users, model.vocab_size)
            rng = random.Random(seed + 1)
            for r in range(rounds):
                for u in range(users):
                    loop.submit(ServeRequest(
                        request_id=f"u{u}r{r}", prompt=tuple(prompts[u]),
                        max_new_tokens=max_new_tokens,
                        ttl_seconds=None if u % 2 else 30.0,
                    ))
                finished = loop.drain(timeout=600.0)
                results += finished
                by_id = {res.request_id: res for res in finished}
                for u in range(users):
                    answer = by_id[f"u{u}r{r}"].output
                    prompts[u] = prompts[u] + answer + [
                        rng.randrange(model.vocab_size) for _ in range(questions[u])
                    ]
            if tp is not None:
                tp.quiesce()
                tp.check_agreement()
            record = cache_record(cache)
            agreement = attrs.asdict(tp.statistics()) if tp is not None else None
    finally:
        if store is not None:
            store.close()
    outputs = {res.request_id: res.output for res in results}
    timeline = sorted((attrs.asdict(res) for res in results), key=lambda d: d["request_id"])
    return normalized({
        **record, "batches": net.batches, "outputs": outputs, "agreement": agreement,
        "results": timeline if tp is not None else None,
    })


# ---------------------------------------------------------------------------- verdicts


def _same(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> str | None:
    """None when every rank's record has the same value at each key, else what differs."""
    for key in keys:
        for rank, rec in enumerate(records[1:], start=1):
            if rec[key] != records[0][key]:
                return f"rank {rank} differs from rank 0 in {key!r}"
    return None


def verdicts(
    agreement: Sequence[dict[str, Any]],
    serving: Sequence[dict[str, Any]],
    reference: dict[str, Any] | None,
) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for each check of the three phases' records."""
    out: list[tuple[str, bool, str]] = []
    a0 = agreement[0]
    diff = _same(agreement, ["steps", "stats", "blocks"])
    s = a0["stats"]
    held = sum(r["agreement"]["held_over"] for r in agreement)
    out.append((
        "agreement: identical decisions, trees and counters on every rank",
        diff is None,
        diff or f"{len(a0['steps'])} steps, {s['onboards']} onboards, {s['spills']} spills, "
                f"{s['requests_parked']} parked, {s['expirations']} expirations; completions "
                f"held until every rank had them: {held}",
    ))
    bad = [r["bad_pages"] for r in agreement]
    out.append(("agreement: every rank read back its own bytes", not any(bad),
                f"mismatched pages per rank: {bad}"))
    failures = [r["stats"]["onboard_failures"] + r["stats"]["spill_failures"] for r in agreement]
    elsewhere = sum(r["agreement"]["failed_elsewhere"] for r in agreement)
    out.append((
        "agreement: a transfer failed on one rank is failed on every rank",
        min(failures) >= 2 and elsewhere >= 2 and len(set(failures)) == 1,
        f"I/O failures applied per rank: {failures}; succeeded here but failed elsewhere: "
        f"{elsewhere}",
    ))
    monotonic = all(r["clock_monotonic"] for r in agreement)
    out.append(("agreement: the agreed clock never ran backwards", monotonic,
                "rank 0's clock stepped back 50 ms once"))
    diff = _same(serving, ["batches", "outputs", "results", "stats", "blocks"])
    s0 = serving[0]["stats"]
    out.append((
        "serving: identical batches and tokens on every rank (heads split)",
        diff is None,
        diff or f"{len(serving[0]['batches'])} forward passes, {len(serving[0]['outputs'])} "
                f"requests, hits gpu/host/disk blocks {s0['hit_blocks_gpu']}/"
                f"{s0['hit_blocks_host']}/{s0['hit_blocks_disk']}, "
                f"{s0['requests_parked']} parked",
    ))
    if reference is not None:
        ref, tp = reference["outputs"], serving[0]["outputs"]
        wrong = sorted(rid for rid in tp if ref.get(rid) != tp[rid])
        out.append((
            "reference: tokens equal to the single-device run of the whole model",
            not wrong and ref.keys() == tp.keys(),
            f"{len(tp) - len(wrong)}/{len(tp)} requests identical"
            + (f"; first differing: {wrong[0]} {tp[wrong[0]]} vs {ref.get(wrong[0])}"
               if wrong else ""),
        ))
    return out


# ---------------------------------------------------------------------------- ranks


def _watchdog(seconds: float, rank: int) -> None:
    def expire() -> None:
        print(f"[rank {rank}] FAIL: no verdict after {seconds:.0f} s (hang); exiting",
              flush=True)
        os._exit(124)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def rank_main(rank: int, world: int, local_rank: int, init_method: str, args: Any) -> int:
    """One rank: the three phases, then rank 0 prints the verdict.  Returns the status."""
    pin_environment()
    _watchdog(args.deadline, rank)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    device = "cuda" if use_cuda else "cpu"
    model = MODELS[args.model or ("small" if use_cuda else "tiny")]
    own_workdir = args.workdir is None
    if own_workdir:
        # Under torchrun: one fresh directory for every rank of this launch (they share the
        # node's disk, as a serving engine's disk_cache_path is); rank 0 names it.
        holder = [tempfile.mkdtemp(prefix="statekv-tp-") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        args.workdir = holder[0]
    workdir = Path(args.workdir)
    status = 1
    try:
        with RankGroup(ParallelLayout(tensor_parallel=world), timeout_s=args.timeout,
                       time_source=SkewedClock(rank)) as group:
            agreement = run_agreement(group, workdir, device=device)
            serving = run_serving(group, workdir, device=device, model=model,
                                  gpu_blocks=args.gpu_blocks)
            reference = (
                run_serving(None, workdir, device=device, model=model, jitter=False,
                            gpu_blocks=args.gpu_blocks, namespace="reference")
                if rank == 0 else None
            )
            records = group.all_gather_object((agreement, serving))
            lines = verdicts([r[0] for r in records], [r[1] for r in records], reference)
            # Every rank has finished with the disk: each must have had a directory of its own.
            dirs = sorted(p.name for p in (workdir / "agreement").iterdir())
            lines.append(("disk: one slot directory per rank under the shared disk_dir",
                          dirs == [f"rank_{r}" for r in range(world)], f"{dirs}"))
            passed = all(ok for _name, ok, _detail in lines)
            if rank == 0:
                print(f"tp_check: {world} ranks, backend {backend}, device {device}, "
                      f"model {model.hidden}x{model.num_layers} ({model.num_heads} heads, "
                      f"{model.num_heads // world} per rank), torch {torch.__version__}, "
                      + ", ".join(f"{k}={os.environ.get(k)}" for k in PINNED_ENV))
                for name, ok, detail in lines:
                    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")
                print(f"RESULT: {'PASS' if passed else 'FAIL'}", flush=True)
            status = 0 if passed else 1
    except Exception:
        print(f"[rank {rank}] FAIL: {traceback.format_exc()}", flush=True)
        status = 1
    finally:
        dist.destroy_process_group()
        if own_workdir and rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
    return status


def _spawned(rank: int, world: int, init_method: str, args: Any) -> None:
    sys.exit(rank_main(rank, world, rank, init_method, args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node 2 -m bench.tp_check",
                           description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to spawn when not launched by torchrun (default 2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--model", choices=tuple(MODELS), default=None,
                        help="model shape (default: small on GPUs, tiny on CPUs)")
    parser.add_argument("--gpu-blocks", type=int, default=28,
                        help="GPU pages per rank in the serving phases (small: forces disk)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for the other ranks")
    parser.add_argument("--deadline", type=float, default=540.0,
                        help="seconds after which a rank gives up (watchdog)")
    parser.add_argument("--workdir", default=None, help="disk tier directory (default: temp)")
    args = parser.parse_args(argv)
    pin_environment()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        rank = int(os.environ["RANK"])
        return rank_main(rank, int(os.environ["WORLD_SIZE"]),
                         int(os.environ.get("LOCAL_RANK", rank)), "env://", args)
    with tempfile.TemporaryDirectory(prefix="statekv-tp-") as tmp:
        if args.workdir is None:
            args.workdir = tmp
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [ctx.Process(target=_spawned, args=(r, args.nproc, init, args))
                 for r in range(args.nproc)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.deadline + 30
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        codes = [proc.exitcode for proc in procs]
        if any(codes):
            print(f"RESULT: FAIL (rank exit codes {codes})", flush=True)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
