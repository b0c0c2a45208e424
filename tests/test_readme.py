"""The README's embedding example runs as written, and leaves nothing behind."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_example_runs_and_cleans_up(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    # Its temporary directory goes under tmp_path, which must be empty again afterwards
    # (the example once left a 72 MiB slot file behind).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert isinstance(namespace["disk_dir"], str)
    assert namespace["disk_dir"].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
