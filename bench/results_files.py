"""Where a benchmark writes its results file (BENCH_FORMAT.md): bench/results/, one file a
run, named by bench, machine and day; a later run of the same day gets -2, -3... (an earlier
run is history too: it is kept, never overwritten)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def write_new_results(
    bench: str, machine: str, day: dt.date, result: dict[str, Any], *, tag: str | None = None,
) -> Path:
    """Write `result` to a file no earlier run of the day (with the same `tag`) has; returns
    its path.  Two runs of one call once wrote the same name, and the second replaced the
    first's figures."""
    RESULTS.mkdir(exist_ok=True)
    out = unused_path(RESULTS, f"{bench}-{machine}-{day:%Y%m%d}" + (f"-{tag}" if tag else ""))
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def unused_path(directory: Path, stem: str) -> Path:
    """``<stem>.json`` in `directory`, or the first of ``<stem>-2.json``, ``-3``... that no
    earlier run wrote."""
    out = directory / f"{stem}.json"
    run = 2
    while out.exists():
        out = directory / f"{stem}-{run}.json"
        run += 1
    return out


def source_commit() -> str:
    """The commit of the code a run measured, for its results file: ``STATEKV_COMMIT`` where
    the tree was copied without its git metadata (bench/on_gpu.sh sets it from the COMMIT file
    the caller sent with the tree: the device's copy has no .git of its own, and a git found
    above it names some other tree), else ``git rev-parse HEAD``."""
    named = os.environ.get("STATEKV_COMMIT", "").strip()
    if named:
        return named
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=False, cwd=RESULTS.parent.parent).stdout.strip()


def machine_name(device: Any = None) -> str:
    """The machine a results file names when its bench was not told (``--machine``): ``h100``
    or ``h200`` from the CUDA device the run uses, else ``cpu``.  A fixed default once
    labelled runs of another machine."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for known in ("H100", "H200"):
        if known in name:
            return known.lower()
    return "".join(c for c in name.lower() if c.isalnum())[:32] or "gpu"
