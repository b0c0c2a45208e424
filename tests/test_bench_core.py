"""bench.core on this machine, small: every phase is printed against the 2 us target, the
disk tier's phases included, each timed over blocks it really moved."""

from __future__ import annotations

import re

import pytest

from bench.core import _disk_phases, main

PHASES = ("miss+allocate", "commit", "release", "match", "evict", "offload", "spill",
          "spill landed", "onboard", "read landed")


def test_every_phase_is_printed_against_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--blocks-per-request", "8", "--requests", "6", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for phase in PHASES:
        assert re.search(rf"^{re.escape(phase)} +\d+\.\d{{3}} +\d+\.\d\dx$", out, re.M), phase


def test_the_disk_phases_time_blocks_that_went_to_disk_and_back() -> None:
    moved = _disk_phases(8, 6)
    # Most full blocks of the first prompts reach disk (their GPU and host copies are
    # displaced) and come back as reads when those prompts return; what comes back was
    # written first, and each phase is timed over the blocks it moved.
    assert moved["spill"][1] == moved["spill landed"][1]
    assert moved["onboard"][1] == moved["read landed"][1]
    assert 8 * 6 // 2 < moved["onboard"][1] <= min(8 * 6, moved["spill"][1])
    assert all(seconds > 0 for seconds, _blocks in moved.values())
