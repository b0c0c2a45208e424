"""The CI profile of the fuzz suite (fuzz/README.md): each machine against the spec.

A failure prints the shrunk steps and writes them, with the state trace of the failing run,
to .hypothesis/fuzz-failures/.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

from fuzz.core_machine import CoreVsSpec
from fuzz.profiles import FAILURE_DIR, PROFILES
from fuzz.runner import run_machine
from fuzz.thread_soak import soak_round

# The profile is the CI one unless the environment names another: mutation testing runs
# these tests with STATEKV_FUZZ_PROFILE=mutation (fuzz/README.md).
CI = PROFILES[os.environ.get("STATEKV_FUZZ_PROFILE", "ci")]


@pytest.fixture(autouse=True)
def _quiet_injected_faults() -> None:
    # Every injected fault makes an actor log a warning: expected here, and noisy.
    logging.getLogger("io_actors").setLevel(logging.ERROR)


def test_core_agrees_with_the_reference_model_step_by_step() -> None:
    result = run_machine(CoreVsSpec, CI.core, failure_dir=FAILURE_DIR)
    assert result.steps > 0


def test_system_with_chosen_completion_order_and_faults_agrees_with_the_spec() -> None:
    result = run_machine(CI.system_machine, CI.system, failure_dir=FAILURE_DIR)
    assert result.steps > 0


@pytest.mark.parametrize("round_", range(CI.thread_rounds))
def test_real_threads_serve_identical_bytes_and_leak_nothing(round_: int) -> None:
    seed = random.randrange(1 << 30)
    result = soak_round(seed, CI.thread_seconds, failure_dir=FAILURE_DIR,
                        device=CI.device, backend=CI.backend)
    assert result.operations > 0 and result.checks > 1, result
