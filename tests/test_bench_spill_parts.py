"""bench.spill_parts: the spill's span taken apart, on the CPU machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.spill_parts import main
from io_actors.actors.writer_pool import SlotWriter
from io_actors.storage.posix import PosixSlotStore


def test_each_run_splits_the_spill_and_leaves_nothing_wrapped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    execute, write_many = SlotWriter.execute, PosixSlotStore.write_many
    assert main(["--device", "cpu", "--block-mib", "0.0625", "--blocks", "32",
                 "--threads", "2", "--batch-blocks", "4", "--runs", "2",
                 "--dir", str(tmp_path)]) == 0
    assert (SlotWriter.execute, PosixSlotStore.write_many) == (execute, write_many)
    out = capsys.readouterr().out.splitlines()
    runs = [x for x in out if x.startswith("spill ")]
    assert len(runs) == 2 and len([x for x in out if "store alone" in x]) == 2
    for line in runs:
        call, first, written = (float(v) for v in re.findall(
            r"call (\d+\.\d+) ms; first write at (\d+\.\d+) ms; the writes' span "
            r"(\d+\.\d+) ms", line)[0])
        assert call > 0 and first > 0 and written > 0
        assert "a batch of 8" in line  # 32 blocks in batches of 4
    assert list(tmp_path.iterdir()) == []
