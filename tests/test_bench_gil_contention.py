"""bench.gil_contention on this machine's CPU, small: every (interval, burst) cell is printed
against the pass alone, and bad flags are one line."""

from __future__ import annotations

import re
import threading
import time

import pytest

from bench.gil_contention import main, python_bursts
from tests.cli_helpers import refused_line


def test_every_cell_is_printed_against_the_pass_alone(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["--device", "cpu", "--model-layers", "1", "--decodes", "2",
                 "--context", "20", "--repeat", "3", "--bursts-us", "0,30",
                 "--switch-interval-ms", "5,1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"the eager pass makes \d+ top-level torch calls", out)
    rows = [line for line in out.splitlines() if line.startswith("eager ")]
    assert len(rows) == 4
    for interval in ("5", "1"):
        alone = next(r for r in rows if f"switch {interval} ms, alone" in r)
        beside = next(r for r in rows if f"switch {interval} ms, beside 30 us" in r)
        t_alone = float(re.findall(r"(\d+\.\d+) ms", alone)[-1])
        t_beside, ratio = (float(v) for v in re.findall(r"(\d+\.\d+)", beside.split("bursts")[1]))
        assert t_alone > 0
        # Printed rounded, the ratio computed before rounding.
        assert ratio == pytest.approx(t_beside / t_alone, rel=0.05, abs=0.01)


def test_the_bursting_thread_stops_with_its_block() -> None:
    before = threading.active_count()
    with python_bursts(20e-6):
        assert threading.active_count() == before + 1
        time.sleep(0.01)
    assert threading.active_count() == before
    with python_bursts(0.0):  # no thread for the pass alone
        assert threading.active_count() == before


@pytest.mark.parametrize("argv, says", [
    (["--bursts-us", "20,50"], "--bursts-us: must include 0"),
    (["--bursts-us", "0,x"], "--bursts-us: must be a number, got 'x'"),
    (["--bursts-us", "0,,1"], "--bursts-us: must be comma-separated numbers"),
    (["--bursts-us", "0,-1"], "--bursts-us: must be a finite number >= 0, got '-1'"),
    (["--switch-interval-ms", "0"], "--switch-interval-ms: must be a finite number > 0"),
    (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs: CUDA graphs need a CUDA device"),
])
def test_bad_flags_are_one_line(argv: list[str], says: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert says in refused_line(main, argv, capsys)
