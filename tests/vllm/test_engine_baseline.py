"""The engine the connector tests stand on, without a connector: its greedy tokens are
reproducible within an engine, across engines made from the same model directory (a restart),
and across the in-process and multiprocess layouts, and they depend on the whole prompt, so a
test that compares tokens notices KV that is wrong."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.vllm import engine

# Two prompts that share their last 40 tokens: only the KV of the first 60 tells them apart.
PROMPT_A = engine.prompt_ids(100, seed=1)
PROMPT_B = engine.prompt_ids(60, seed=2) + PROMPT_A[60:]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def in_process_tokens(model_dir: Path) -> list[list[int]]:
    with engine.running_llm(model_dir) as llm:
        first = engine.generate(llm, [PROMPT_A, PROMPT_B], max_tokens=8)
        again = engine.generate(llm, [PROMPT_A, PROMPT_B], max_tokens=8)
    assert again.token_ids == first.token_ids
    # The second call found the prompts' full blocks in vLLM's own prefix cache.
    assert first.num_cached_tokens == [0, 0]
    assert again.num_cached_tokens == [96, 96]
    return first.token_ids


def test_the_tokens_depend_on_the_whole_prompt(in_process_tokens: list[list[int]]) -> None:
    tokens_a, tokens_b = in_process_tokens
    assert tokens_a != tokens_b
    assert len(set(tokens_a)) > 1


def test_a_restarted_engine_gives_the_same_tokens(
    model_dir: Path, in_process_tokens: list[list[int]], tmp_path: Path
) -> None:
    rewritten = engine.write_tiny_llama(tmp_path / "again")
    assert _digest(rewritten / "model.safetensors") == _digest(model_dir / "model.safetensors")
    with engine.running_llm(rewritten) as llm:
        assert engine.generate(llm, [PROMPT_A, PROMPT_B], max_tokens=8).token_ids == (
            in_process_tokens
        )


def test_the_multiprocess_engine_gives_the_same_tokens(
    model_dir: Path, in_process_tokens: list[list[int]]
) -> None:
    with engine.running_llm(model_dir, in_process=False) as llm:
        assert engine.generate(llm, [PROMPT_A, PROMPT_B], max_tokens=8).token_ids == (
            in_process_tokens
        )


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
