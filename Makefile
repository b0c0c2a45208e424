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
CROSSHAIR_TIMEOUT ?= 4

.PHONY: test demo lint typecheck spec crosshair pytest bench-core clean fuzz fuzz-ci fuzz-gpu

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: lint typecheck spec pytest crosshair

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

spec: $(STAMP)
	$(BIN)/python -m specs.lifecycle_doc --check

pytest: $(STAMP)
	$(BIN)/python -m pytest

crosshair: $(STAMP)
	$(BIN)/crosshair check --per_condition_timeout $(CROSSHAIR_TIMEOUT) $(CROSSHAIR_TARGETS)

demo: $(STAMP)
	$(BIN)/statekv demo

bench-core: $(STAMP)
	$(BIN)/python -m bench.core

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
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
