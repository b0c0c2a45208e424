"""Helpers that start the real vLLM engine on the CPU: a tiny Llama with random weights, no
hub, no tokenizer (FACTS.md says what each choice rests on).

Tests compare tokens across engine restarts, so the weights must be the same in every engine:
`write_tiny_llama` writes seeded random weights to a safetensors file, loaded for real. vLLM's
own `load_format="dummy"` is deterministic too (a fixed seed, whatever LLM(seed=...) says), but
it fills every weight with U(-1e-3, 1e-3): attention is then nearly uniform and tiny, and the
greedy tokens barely depend on the KV cache, so a corrupted cache would go unnoticed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from statekv.stats import CacheStatistics

# One engine's KV cache on the CPU backend, in GiB; vLLM's default (4 GiB) is far more than a
# 2-core test machine needs, and the blocks are allocated up front.
_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# The CPU attention backend takes block sizes that are multiples of 32 and head_dim 64
# (16 fails); two KV heads under four query heads keep GQA in the picture.
TINY_LLAMA: dict[str, int] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
# Weights are N(0, (WEIGHT_GAIN / sqrt(fan_in))^2): attention scores of std about
# WEIGHT_GAIN**2, far from uniform, so the greedy tokens depend on the whole prompt's KV
# (tests/vllm/test_engine_baseline.py checks they do).  transformers' std 0.02 is near uniform.
WEIGHT_GAIN = 2.0


def write_tiny_llama(directory: Path, *, weights_seed: int = 0) -> Path:
    """A model directory vLLM loads without a hub: config.json plus model.safetensors with
    weights drawn from `weights_seed`, the same bytes on every call with that seed."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        **TINY_LLAMA,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    )
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(weights_seed)
    save_file(_llama_weights(generator), str(directory / "model.safetensors"))
    return directory


def _llama_weights(generator: Any) -> dict[str, Any]:
    import torch

    c = TINY_LLAMA
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim, inter, vocab = c["head_dim"], c["intermediate_size"], c["vocab_size"]

    def normal(*shape: int, fan_in: int) -> Any:
        return torch.randn(*shape, generator=generator) * (WEIGHT_GAIN / fan_in**0.5)

    weights: dict[str, Any] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(vocab, hidden, fan_in=hidden),
    }
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden, fan_in=hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden, fan_in=hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden, fan_in=hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim, fan_in=hidden),
            p + "mlp.gate_proj.weight": normal(inter, hidden, fan_in=hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden, fan_in=hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter, fan_in=inter),
        }
    return {name: tensor.contiguous() for name, tensor in weights.items()}


def kv_transfer_config(
    module_path: str,
    class_name: str,
    extra_config: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The `kv_transfer_config` argument of `vllm.LLM` for a connector loaded by module path
    (the same JSON `vllm serve --kv-transfer-config` takes)."""
    return {
        "kv_connector": class_name,
        "kv_connector_module_path": module_path,
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra_config or {}),
        **fields,
    }


def make_llm(
    model_dir: Path,
    *,
    in_process: bool = True,
    kv_transfer: Mapping[str, Any] | None = None,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    **llm_kwargs: Any,
) -> Any:
    """A `vllm.LLM` on the CPU backend.

    in_process: the scheduler and the worker live in this process (EngineCore in-process, the
    `uni` executor), so a test can reach both connectors' objects; otherwise vLLM's default
    layout, an EngineCore process of its own (the worker runs inside it under `uni`).
    """
    _prepare_environment(in_process=in_process)
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "seed": seed,
        "enable_prefix_caching": enable_prefix_caching,
        # RequestOutput.num_cached_tokens is counted only with stats on (LLM turns them off).
        "disable_log_stats": False,
    }
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    if kv_transfer is not None:
        kwargs["kv_transfer_config"] = dict(kv_transfer)
    kwargs |= llm_kwargs
    return LLM(**kwargs)


def _prepare_environment(*, in_process: bool) -> None:
    os.environ.update(_ENVIRONMENT)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    # An in-process engine freezes vLLM's environment reads once it is up (enable_envs_cache):
    # the next engine in this process must read the variables afresh.
    import vllm.envs

    vllm.envs.disable_envs_cache()
    # Spawned engine processes import the connector by module path: they need this checkout.
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)


@dataclass(frozen=True)
class Generation:
    """One `generate` call, per prompt in order."""

    token_ids: list[list[int]]
    # Prompt tokens the engine did not compute: its own prefix cache plus the connector's.
    num_cached_tokens: list[int]
    # What the connector's request_finished returned as kv_transfer_params.
    kv_transfer_params: list[dict[str, Any] | None]


def generate(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 4,
    kv_transfer_params: Mapping[str, Any] | None = None,
    cache_salt: str | None = None,
) -> Generation:
    """Greedy tokens for each prompt of token ids, with what the engine says it reused."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra_args = None
    if kv_transfer_params is not None:
        # The LLM path of the OpenAI server's `kv_transfer_params` body field.
        extra_args = {"kv_transfer_params": dict(kv_transfer_params)}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        detokenize=False,
        ignore_eos=True,
        extra_args=extra_args,
    )
    inputs = []
    for ids in prompts:
        prompt = TokensPrompt(prompt_token_ids=list(ids))
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        inputs.append(prompt)
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return Generation(
        token_ids=[list(cast(Sequence[int], o.outputs[0].token_ids)) for o in outputs],
        num_cached_tokens=[int(o.num_cached_tokens or 0) for o in outputs],
        kv_transfer_params=[o.kv_transfer_params for o in outputs],
    )


def statekv_statistics(llm: Any) -> CacheStatistics:
    """The statekv connector's scheduler-side statistics of an in-process engine."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    side = connector.scheduler_side
    assert side is not None
    result: CacheStatistics = side.statistics()
    return result


def shutdown(llm: Any) -> None:
    """Stops the engine (its EngineCore process, in multiprocess mode) and frees what an
    in-process engine holds, so that the next `make_llm` in this process starts clean."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def running_llm(model_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """`make_llm` for a `with` block, shut down on the way out."""
    llm = make_llm(model_dir, **kwargs)
    try:
        yield llm
    finally:
        shutdown(llm)


def prompt_ids(length: int, *, seed: int = 0) -> list[int]:
    """A reproducible prompt of `length` token ids from the tiny vocabulary."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, TINY_LLAMA["vocab_size"]) for _ in range(length)]


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """Records a probe wrote, one JSON object a line (any process may have appended)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
