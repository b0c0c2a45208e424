"""StateKVConnector on the real engine where requests share a prefix: a connector load after
a local prefix hit, two requests of one step loading the same host block, and two reading
the same disk slot after a restart.  Every case compares tokens with an engine without a
connector (greedy; the tiny Llama's tokens depend on the whole prompt's KV)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm import engine

PREFIX = engine.prompt_ids(128, seed=100)  # four full blocks
TAILS = [engine.prompt_ids(100, seed=1), engine.prompt_ids(100, seed=2)]
FLOOD = [engine.prompt_ids(300, seed=200 + i) for i in range(3)]
POOL = 24  # blocks: 768 tokens, so the flood evicts the prefix from vLLM's own pool


def _statekv(tiers: dict[str, Any]) -> dict[str, Any]:
    return engine.kv_transfer_config("io_actors.vllm.connector", "StateKVConnector", tiers,
                                     kv_load_failure_policy="recompute")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, list[list[int]]]:
    with engine.running_llm(model_dir) as llm:
        return {
            "shared": engine.generate(llm, [PREFIX + t for t in TAILS]).token_ids,
            "history": engine.generate(llm, [PREFIX + TAILS[0] + TAILS[1]]).token_ids,
        }


def test_a_load_after_a_local_hit_lands_past_it(
    model_dir: Path, reference: dict[str, list[list[int]]],
) -> None:
    # PREFIX stays in vLLM's pool (the flood is shorter than the pool's free part) while
    # PREFIX + TAILS[0] was evicted: the engine's hit is PREFIX, the connector's the rest.
    with engine.running_llm(model_dir, kv_transfer=_statekv({"host": 64}),
                            num_gpu_blocks_override=POOL) as llm:
        engine.generate(llm, [PREFIX + TAILS[0]])
        for flood in FLOOD:
            engine.generate(llm, [PREFIX + flood[:200]])
        out = engine.generate(llm, [PREFIX + TAILS[0] + TAILS[1]])
    assert out.token_ids == reference["history"]
    assert out.num_cached_tokens[0] >= 224  # PREFIX and TAILS[0]'s full blocks


def test_two_requests_of_a_step_load_one_host_block(
    model_dir: Path, reference: dict[str, list[list[int]]],
) -> None:
    with engine.running_llm(model_dir, kv_transfer=_statekv({"host": 64}),
                            num_gpu_blocks_override=POOL) as llm:
        engine.generate(llm, [PREFIX + engine.prompt_ids(40, seed=101)])
        for flood in FLOOD:
            engine.generate(llm, [flood])
        out = engine.generate(llm, [PREFIX + t for t in TAILS])
    assert out.token_ids == reference["shared"]
    assert out.num_cached_tokens == [128, 128]


def test_two_requests_after_a_restart_read_one_disk_slot(
    model_dir: Path, reference: dict[str, list[list[int]]], tmp_path: Path,
) -> None:
    tiers = {"host": 16, "disk": 64, "disk_dir": str(tmp_path / "disk")}
    with engine.running_llm(model_dir, kv_transfer=_statekv(tiers),
                            num_gpu_blocks_override=POOL) as llm:
        engine.generate(llm, [PREFIX + engine.prompt_ids(40, seed=101)])
        engine.generate(llm, [FLOOD[0][:8]])  # keeps the engine stepping: the save runs
    with engine.running_llm(model_dir, kv_transfer=_statekv(tiers),
                            num_gpu_blocks_override=POOL) as llm:
        out = engine.generate(llm, [PREFIX + t for t in TAILS])
    assert out.token_ids == reference["shared"]
    assert out.num_cached_tokens == [128, 128]
