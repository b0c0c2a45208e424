"""The test files `bench/on_gpu.sh tests` runs on the GPU machine collect without the redis
client: that machine gets its packages only as the wheels carried in `.whl/` (which
on_gpu.sh installs), and a fixture module importing redis at the top once failed the whole
step before any test ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def gpu_test_files() -> list[str]:
    script = (REPO / "bench" / "on_gpu.sh").read_text()
    step = script[script.index("    tests) "):]
    step = step[: step.index(";;")]
    return re.findall(r"tests/\w+\.py", step)


def test_the_gpu_test_files_collect_without_the_redis_client() -> None:
    files = gpu_test_files()
    assert "tests/test_model_paged_attention.py" in files and len(files) >= 10
    code = ("import sys; sys.modules['redis'] = None; import pytest; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
            "*sys.argv[1:]]))")
    done = subprocess.run([sys.executable, "-c", code, *files], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_gpu_script_parses() -> None:
    # A device call is minutes of a limited budget: a quoting slip must fail here, not there.
    done = subprocess.run(["bash", "-n", str(REPO / "bench" / "on_gpu.sh")], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
