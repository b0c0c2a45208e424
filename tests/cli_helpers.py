"""What the benchmarks' command-line tests share: a refused command line is one line."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def refused_line(main: Callable[[list[str]], object], argv: list[str],
                 capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `main(argv)` printed when it refused its command line (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]
