"""A benchmark's results file never replaces an earlier run's (BENCH_FORMAT.md: old files are
the performance history).  Two runs of one device call once wrote the same name, and the
second's figures replaced the first's."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import torch

from bench import results_files


@pytest.mark.parametrize("tag", [None, "lat-eager"])
def test_a_second_run_of_the_day_gets_a_file_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tag: str | None,
) -> None:
    monkeypatch.setattr(results_files, "RESULTS", tmp_path / "results")
    day = dt.date(2026, 12, 5)
    first = results_files.write_new_results("io", "h100", day, {"run": 1}, tag=tag)
    second = results_files.write_new_results("io", "h100", day, {"run": 2}, tag=tag)
    assert first != second
    assert json.loads(first.read_text()) == {"run": 1}
    assert json.loads(second.read_text()) == {"run": 2}
    stem = "io-h100-20261205" + (f"-{tag}" if tag else "")
    assert first.name == f"{stem}.json"
    assert second.name == f"{stem}-2.json"


def test_a_run_on_the_cpu_is_named_cpu_whatever_gpu_the_machine_has() -> None:
    from bench.results_files import machine_name

    assert machine_name("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert machine_name() == "cpu"
