"""README's "Using statekv under vLLM" Python example, run as written on the tiny test model.

Only what a CPU test machine needs is added to the example's `LLM(...)` call (no tokenizer,
the CPU backend's block size, a small pool, one process); the connector configuration, the
TTL and the call sequence are the README's own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.vllm import engine

ROOT = Path(__file__).resolve().parents[2]


def readme_vllm_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using statekv under vLLM", 1)[1].split("\n## ", 1)[0]
    blocks: list[str] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "README's vLLM section should hold one Python example"
    return blocks[0]


def test_the_readme_vllm_example_runs_as_written(tmp_path: Path) -> None:
    model = engine.write_tiny_llama(tmp_path / "model")
    harness = textwrap.dedent(f"""
        import vllm

        _LLM = vllm.LLM

        def LLM(**kwargs):
            # What this CPU machine needs, and nothing the example says differently.
            kwargs.update(skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                          block_size={engine.BLOCK_SIZE}, max_model_len={engine.MAX_MODEL_LEN},
                          distributed_executor_backend="uni")
            return _LLM(**kwargs)

        vllm.LLM = LLM
    """)
    env = dict(os.environ, MODEL=str(model), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = tmp_path / "example.py"
    script.write_text(harness + readme_vllm_example())
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\[(\d+, ){15}\d+\]", last), last   # 16 generated token ids
