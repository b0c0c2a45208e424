"""bench.e2e refuses decode graphs where they cannot run: one line naming the flag, before
any model is built."""

from __future__ import annotations

import sys

import pytest

from bench import e2e


def test_cuda_graphs_without_cuda_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.e2e", "--device", "cpu", "--cuda-graphs"])
    with pytest.raises(SystemExit) as exit_:
        e2e.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1 and "--cuda-graphs" in err[0], err
