"""tests/vllm/ drive the real vLLM engine and run in .venv-vllm (`make pytest-vllm`); the main
venv has no vLLM, so its run does not collect them."""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
