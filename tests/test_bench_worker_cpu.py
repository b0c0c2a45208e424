"""bench.worker_cpu on this machine, small: each worker path is printed against its raw
pass, its figure is that path's own CPU over the raw pass's wall time, and the scratch store
is gone afterwards (its bad flags: tests/test_bench_flags.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.worker_cpu import Pass, figures, main


def test_each_worker_path_is_printed_against_its_raw_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--block-kib", "64", "--blocks", "40", "--batch", "16", "--repeat", "2",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("raw_write", "spill_writer", "raw_read", "prefetch_reader"):
        assert re.search(rf"^  {name} +wall +\d+\.\d+ us/block  cpu +\d+\.\d+ us/block$", out,
                         re.M), out
    for path in ("spill_writer", "prefetch_reader"):
        assert re.search(rf"^{path}: -?\d+(\.\d+)? us of its own CPU a block = -?\d\.\d+ of the",
                         out, re.M), out
    assert list(tmp_path.iterdir()) == []


def test_the_figure_is_own_cpu_over_the_raw_wall_time() -> None:
    best = {"raw_write": Pass(wall_us=100.0, cpu_us=10.0),
            "spill_writer": Pass(wall_us=120.0, cpu_us=30.0),
            "raw_read": Pass(wall_us=200.0, cpu_us=40.0),
            "prefetch_reader": Pass(wall_us=210.0, cpu_us=50.0)}
    out = figures(best, direct=True)
    assert out["spill_writer_own_cpu_us_per_block"]["value"] == 20.0
    assert out["spill_writer_own_cpu_us_per_block"]["ratio"] == 0.2
    assert out["prefetch_reader_own_cpu_us_per_block"]["ratio"] == 0.05
    assert "buffered" in str(figures(best, direct=False)[
        "prefetch_reader_own_cpu_us_per_block"]["limit_name"])
