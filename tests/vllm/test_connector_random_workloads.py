"""StateKVConnector on the real engine under seeded random workloads: the greedy tokens of
every request are those of an engine without a connector.

The other connector tests each build one case.  Here a seed draws a workload of the kinds
users send: several rounds of 1-6 requests stepped through the engine together, with
prompts of any length (rarely block aligned) that extend earlier prompts (a chat's next
round), share one of a few system prompts, or share nothing; answers of 1-9 tokens; vLLM's
own pool cut to 30-64 blocks, so that a long prompt crowds out (or preempts) the others;
host and disk tiers drawn small or large; requests aborted a few steps in (while their loads
may be in flight); and engine restarts between rounds on the same disk directory.  No load
may fail (a failed load is recomputed under ``kv_load_failure_policy="recompute"``, which
would hide it from the tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from tests.vllm import engine

SEEDS = (3, 5, 13, 15)  # each serves blocks from statekv's tiers (asserted below)


@dataclass(frozen=True)
class Round:
    requests: list[tuple[list[int], int]]
    """(prompt token ids, max_tokens) of the requests added to the engine together."""
    restart: bool
    """statekv's engine is shut down and a new one opened on the same tiers before it."""
    aborts: dict[int, int]
    """Engine step (from 1) -> the request aborted after it (a no-op once it finished):
    aborted while its loads or its saves may be in flight."""


@dataclass(frozen=True)
class Workload:
    rounds: list[Round]
    pool_blocks: int
    tiers: dict[str, int]


def draw(seed: int) -> Workload:
    rng = random.Random(seed)
    vocab = engine.TINY_LLAMA["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    systems = [tokens(rng.randrange(1, 200)) for _ in range(4)]
    asked: list[list[int]] = []
    rounds = []
    for _ in range(rng.randrange(3, 6)):
        requests = []
        for _ in range(rng.randrange(1, 7)):
            kind = rng.random()
            if kind < 0.4 and asked:
                prompt = rng.choice(asked) + tokens(rng.randrange(1, 80))
            elif kind < 0.8:
                prompt = rng.choice(systems) + tokens(rng.randrange(0, 150))
            else:
                prompt = tokens(rng.randrange(2, 400))
            if len(prompt) < 2:  # the connector's floor
                prompt += tokens(2)
            prompt = prompt[: engine.MAX_MODEL_LEN - 16]  # room left for the answer
            requests.append((prompt, rng.randrange(1, 10)))
        rounds.append(Round(requests, restart=rng.random() < 0.3, aborts={}))
        asked += [prompt for prompt, _ in requests]
    choose = random.Random(seed + 1000)
    pool, host, disk = (choose.choice([30, 40, 64]), choose.choice([4, 16, 64]),
                        choose.choice([16, 64, 256]))
    for round_ in rounds:  # drawn apart, so the requests above stay what they were
        if choose.random() < 0.5:
            for step in choose.sample(range(1, 6), choose.randrange(1, 3)):
                round_.aborts[step] = choose.randrange(len(round_.requests))
    return Workload(rounds, pool_blocks=pool, tiers={"host": host, "disk": disk})


def run_round(llm: Any, round_: Round, number: int) -> dict[int, list[int]]:
    """The round's requests, each with its own answer length (so they finish apart), stepped
    through the engine with the round's aborts; the tokens of each one that finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    core = llm.llm_engine
    ids = [f"{number}-{i}" for i in range(len(round_.requests))]
    for rid, (prompt, n) in zip(ids, round_.requests, strict=True):
        core.add_request(rid, TokensPrompt(prompt_token_ids=prompt), SamplingParams(
            max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True))
    done: dict[int, list[int]] = {}
    step = 0
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished and out.outputs[0].finish_reason == "length":
                done[ids.index(out.request_id)] = list(cast(list[int], out.outputs[0].token_ids))
        step += 1
        if step in round_.aborts:
            core.abort_request([ids[round_.aborts[step]]])
    return done


def serve(model_dir: Path, work: Workload, kv_transfer: dict[str, Any] | None,
          ) -> tuple[list[dict[int, list[int]]], list[Any]]:
    """Every round's tokens, and statekv's statistics of each engine (none without it)."""
    answers: list[dict[int, list[int]]] = []
    stats: list[Any] = []
    llm: Any = None

    def close() -> None:
        if kv_transfer is not None:
            stats.append(engine.statekv_statistics(llm))
        engine.shutdown(llm)

    try:
        for round_ in work.rounds:
            if llm is None or (round_.restart and kv_transfer is not None):
                if llm is not None:
                    close()
                llm = engine.make_llm(model_dir, kv_transfer=kv_transfer,
                                      num_gpu_blocks_override=work.pool_blocks)
            answers.append(run_round(llm, round_, len(answers)))
    finally:
        if llm is not None:
            close()
    return answers, stats


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_workload_gives_the_tokens_of_an_engine_without_statekv(
    model_dir: Path, tmp_path: Path, seed: int,
) -> None:
    work = draw(seed)
    expected, _ = serve(model_dir, work, None)
    tiers = {**work.tiers, "disk_dir": str(tmp_path / "disk")}
    got, stats = serve(model_dir, work, engine.kv_transfer_config(
        "io_actors.vllm.connector", "StateKVConnector", tiers,
        kv_load_failure_policy="recompute"))
    finished = 0
    for number, (want, have) in enumerate(zip(expected, got, strict=True)):
        both = want.keys() & have.keys()  # an abort may come after one run finished it
        finished += len(both)
        assert {i: have[i] for i in both} == {i: want[i] for i in both}, (
            f"round {number}: tokens differ from the engine's own")
    assert finished >= len(work.rounds)
    assert sum(s.onboard_failures + s.fetch_failures + s.prefetch_failures for s in stats) == 0
    # Not vacuous: statekv served blocks from its own tiers in this workload.
    assert sum(s.hit_blocks_host + s.hit_blocks_disk for s in stats) > 0
