"""bench.io end to end on this machine's CPU, small: every phase runs and reports a rate
against its limit (the figures themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.io import main


def test_every_transfer_phase_reports_a_rate_against_its_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--block-mib", "0.0625", "--blocks", "32", "--threads", "2",
                 "--batch-blocks", "4", "--dir", str(tmp_path), "--device", "cpu",
                 "--skip-latency"]) == 0
    out = capsys.readouterr().out
    for phase in ("spill host->disk", "write-through", "store alone, consec.",
                  "store alone, scatt.", "spill, fresh slots", "store alone, fresh",
                  "spill, written slots", "onboard disk->GPU", "recall host->GPU"):
        line = next((x for x in out.splitlines() if x.startswith(phase)), None)
        assert line is not None, f"no {phase!r} line in:\n{out}"
        value, limit, ratio = (float(v) for v in re.findall(r"(\d+\.\d+)", line))
        # Printed rounded to 2 decimals, the ratio computed before rounding.
        assert value > 0 and limit > 0
        assert ratio == pytest.approx(value / limit, rel=0.05, abs=0.02)
    assert list(tmp_path.iterdir()) == []   # the scratch directory went with the run
