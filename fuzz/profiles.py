"""The fuzz profiles: how much of each machine a run does.

* ``ci``: what ``make test`` runs (through tests/test_fuzz_machines.py): a few thousand
  steps of each machine and two short real-thread rounds, about a minute on the 2-core CPU
  machine, so that CI has time for everything else.
* ``soak``: ``make fuzz``: rounds of every machine, each with a new seed, until the time
  budget runs out (hours); prints steps/s and examples as it goes.  Each round also kills
  a serving child process with SIGKILL 200 times and checks the disk tier it leaves
  (fuzz.crash; ``make test`` runs a few kills and every crash point of a scripted workload).
* ``mutation``: what mutmut runs for each mutant (derandomized, no shrinking).
* ``gpu``: ``make fuzz-gpu`` on the GPU machine: the system machine and the thread soak with
  the KV pools in CUDA memory (real CUDA copies and streams) over the kvikio store when kvikio
  is installed (POSIX otherwise), plus the core machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Final

import attrs
from hypothesis import HealthCheck, Phase, settings

from fuzz.system_machine import SystemMachine

FAILURE_DIR: Final = Path(".hypothesis") / "fuzz-failures"
"""Where failure reports and traces go (ignored by git, next to Hypothesis' database)."""


def machine_settings(
    examples: int, steps: int, *, shrink: bool = True, derandomize: bool = False
) -> settings:
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    # A derandomized run replays fixed examples: a database would only add saved ones.
    extra: dict[str, Any] = {"database": None} if derandomize else {}
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        **extra,
        # The machines are slow by Hypothesis' standards (real threads, real files) and
        # draw few choices per step; none of these checks says anything about them.
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=True,
        phases=phases,
    )


class GpuSystemMachine(SystemMachine):
    """The system machine with its pools in CUDA memory, over kvikio where installed."""

    device = "cuda"
    backend = "kvikio" if importlib.util.find_spec("kvikio") is not None else "posix"


@attrs.frozen(kw_only=True)
class Profile:
    name: str
    core: settings
    system: settings
    system_machine: type[SystemMachine]
    thread_rounds: int
    """Real-thread rounds per repetition (each its own seed and cache shape)."""
    thread_seconds: float
    """Seconds of serving per real-thread round."""
    device: str
    backend: str
    repeat: bool
    """Whether the run repeats, with new seeds, until its time budget is spent."""
    kill9: int = 0
    """Kills of a serving child process per repetition (fuzz.crash.kill_loop)."""


PROFILES: Final[dict[str, Profile]] = {
    "ci": Profile(
        name="ci",
        core=machine_settings(200, 50),
        system=machine_settings(80, 40),
        system_machine=SystemMachine,
        thread_rounds=2,
        thread_seconds=10.0,
        device="cpu",
        backend="posix",
        repeat=False,
    ),
    "soak": Profile(
        name="soak",
        core=machine_settings(2000, 100),
        system=machine_settings(300, 60),
        system_machine=SystemMachine,
        thread_rounds=1,
        thread_seconds=60.0,
        device="cpu",
        backend="posix",
        repeat=True,
        kill9=200,
    ),
    # Mutation testing (fuzz/README.md): the same examples every run, so that a mutant is
    # killed or not whatever the run; no shrinking, since one failure kills a mutant.
    "mutation": Profile(
        name="mutation",
        core=machine_settings(60, 40, shrink=False, derandomize=True),
        system=machine_settings(15, 25, shrink=False, derandomize=True),
        system_machine=SystemMachine,
        thread_rounds=0,
        thread_seconds=0.0,
        device="cpu",
        backend="posix",
        repeat=False,
    ),
    "gpu": Profile(
        name="gpu",
        core=machine_settings(500, 100),
        system=machine_settings(300, 60),
        system_machine=GpuSystemMachine,
        thread_rounds=3,
        thread_seconds=60.0,
        device="cuda",
        backend=GpuSystemMachine.backend,
        repeat=False,
    ),
}
