"""bench.io end to end on this machine's CPU, small: every phase runs and reports a rate
against its limit (the figures themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.io import main
from tests.cli_helpers import refused_line


def _small(tmp_path: Path, *flags: str) -> list[str]:
    """bench.io's flags for a run small enough for this machine's CPU, plus `flags`."""
    return ["--block-mib", "0.0625", "--blocks", "32", "--threads", "2", "--batch-blocks", "4",
            "--dir", str(tmp_path), "--device", "cpu", *flags]


def _small_latency(tmp_path: Path, *flags: str) -> list[str]:
    """The step-latency phase alone, small, with `flags`."""
    return _small(tmp_path, "--latency-only", *flags, "--decoders", "2", "--decode-steps", "8",
                  "--loop-gpu-blocks", "64", "--tenant-blocks", "2", "--tenant-in-flight", "2")


def _one_line_usage_error(argv: list[str], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of a refused command line (exit status 2, nothing left behind)."""
    line = refused_line(main, argv, capsys)
    assert list(tmp_path.iterdir()) == []
    return line


def test_every_transfer_phase_reports_a_rate_against_its_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_small(tmp_path, "--skip-latency")) == 0
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
    busy = next(x for x in out.splitlines() if x.startswith("writer threads busy"))
    fresh, written = (float(v) for v in re.findall(r"slots (\d+\.\d+)", busy))
    # A fraction of the threads' time over the spill's span (timed a little wider).
    assert 0 < fresh <= 1.05 and 0 < written <= 1.05
    assert list(tmp_path.iterdir()) == []   # the scratch directory went with the run


def test_the_step_latency_phase_alone_times_the_parts_of_a_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_small_latency(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "spill host->disk" not in out    # no transfer phase ran
    step = next(x for x in out.splitlines() if x.startswith("step p50 idle"))
    idle_p50, busy_p50 = (float(v) for v in re.findall(r"(\d+\.\d+) ms", step)[:2])
    parts = [x for x in out.splitlines() if x.startswith("  of which")]
    assert len(parts) == 3
    # The three parts add up to the step (each is a p50 of its own, so within rounding of
    # the median of sums only where the steps are alike: bounded, not equal).
    part_idle = [float(re.findall(r"p50 idle +(\d+\.\d+) ms", x)[0]) for x in parts]
    assert all(p >= 0 for p in part_idle)
    assert 0 < sum(part_idle) <= 2 * idle_p50 + 0.05
    assert busy_p50 > 0
    assert list(tmp_path.iterdir()) == []


def test_cuda_graphs_without_a_cuda_device_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_usage_error(
        ["--device", "cpu", "--latency-only", "--cuda-graphs", "--dir", str(tmp_path)],
        tmp_path, capsys)
    assert "--cuda-graphs" in line and "CUDA device" in line


def test_the_timed_lock_reports_waits_and_holds_per_phase(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_small_latency(tmp_path, "--time-lock")) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "scheduler lock" in x]
    assert [x.split(",")[1].split(":")[0].strip() for x in lines] == ["idle", "saturated"]
    for line in lines:
        wait50, wait99, hold50, hold99, hold_max = (
            float(v) for v in re.findall(r"(\d+\.\d+) ", line)[:5])
        share = float(re.findall(r"(\d+\.\d)%", line)[0])
        assert 0 <= wait50 <= wait99
        assert 0 <= hold50 <= hold99 <= hold_max
        assert 0 <= share <= 100
    # The tenant keeps the cache's thread busy: it took the lock in the busy phase.
    assert float(re.findall(r"max (\d+\.\d+) ms", lines[1])[0]) > 0


def test_gc_freeze_without_a_latency_phase_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_usage_error(
        ["--device", "cpu", "--skip-latency", "--gc-freeze", "--dir", str(tmp_path)],
        tmp_path, capsys)
    assert "--gc-freeze" in line and "--skip-latency" in line


def test_the_latency_phases_count_the_collectors_pauses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    assert main(_small_latency(tmp_path, "--gc-freeze")) == 0
    assert gc.get_freeze_count() == 0  # each phase gave its frozen objects back
    lines = [x for x in capsys.readouterr().out.splitlines() if "garbage collector" in x]
    assert [x.split(",")[1].split(":")[0].strip() for x in lines] == ["idle", "saturated"]
    assert all("(generations frozen after set-up)" in x for x in lines)
