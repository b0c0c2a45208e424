"""The benchmarks' command lines: a bad flag is one line naming it, before anything is
measured or written (the scratch directory a benchmark makes inside --dir included), and a
benchmark removes only what it made."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import (
    blockpool,
    checksum,
    core,
    disk_limits,
    rebuild,
    remote,
    trace_cost,
    worker_cpu,
)
from bench.io import main


@pytest.mark.parametrize(("argv", "flag"), [
    (["--block-mib", "0"], "--block-mib"),
    (["--block-mib", "nan"], "--block-mib"),
    (["--block-size", "0"], "--block-size"),
    (["--threads", "0"], "--threads"),
    (["--threads", "four"], "--threads"),
    (["--blocks", "-3"], "--blocks"),
    (["--model", "huge"], "--model"),
    (["--model-layers", "-1"], "--model-layers"),
    (["--decoders", "0"], "--decoders"),
    (["--decode-steps", "0"], "--decode-steps"),
    (["--loop-gpu-blocks", "0"], "--loop-gpu-blocks"),
    (["--batch-blocks", "0"], "--batch-blocks"),
    (["--tenant-blocks", "0"], "--tenant-blocks"),
    (["--tenant-in-flight", "x"], "--tenant-in-flight"),
    (["--backend", "nfs"], "--backend"),
    (["--tag", "a/b"], "--tag"),
    (["--latency-only", "--skip-latency"], "--latency-only"),
])
def test_bad_flags_get_one_line_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and "Traceback" not in err


def test_a_dir_that_does_not_exist_is_one_line_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for path, says in ((missing, "does not exist"), (a_file, "is not a directory")):
        with pytest.raises(SystemExit) as exit_:
            main(["--dir", str(path)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--dir" in err and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize(("bench", "argv", "flag"), [
    (blockpool.main, ["--users", "0"], "--users"),
    (blockpool.main, ["--pool-fraction", "1.5"], "--pool-fraction"),
    (blockpool.main, ["--seed", "-1"], "--seed"),
    (checksum.main, ["--sizes-kib", "256", "0"], "--sizes-kib"),
    (checksum.main, ["--seconds", "inf"], "--seconds"),
    (checksum.main, ["--dir", "/nonexistent/statekv"], "--dir"),
    (core.main, ["--requests", "0"], "--requests"),
    (disk_limits.main, ["--threads", "1", "x"], "--threads"),
    (disk_limits.main, ["--dir", "/nonexistent/statekv"], "--dir"),
    (rebuild.main, ["--slots", "0"], "--slots"),
    (rebuild.main, ["--dir", "/nonexistent/statekv"], "--dir"),
    (remote.main, ["--block-kib", "0"], "--block-kib"),
    (remote.main, ["--seconds", "-1"], "--seconds"),
    (worker_cpu.main, ["--block-kib", "100"], "--block-kib must be a multiple of 64"),
    (worker_cpu.main, ["--block-kib", "32"], "--block-kib"),
    (worker_cpu.main, ["--blocks", "0"], "--blocks"),
    (worker_cpu.main, ["--dir", "/nonexistent/statekv"], "--dir"),
    (worker_cpu.main, ["--tag", "a/b"], "--tag"),
    (trace_cost.main, ["--users", "0"], "--users"),
    (trace_cost.main, ["--rounds", "x"], "--rounds"),
    (trace_cost.main, ["--repeat", "-1"], "--repeat"),
])
def test_every_benchmark_names_a_bad_flag_in_one_line(
    bench: Callable[[list[str]], object], argv: list[str], flag: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and "Traceback" not in err


def test_the_rebuild_benchmark_leaves_what_was_in_its_dir(tmp_path: Path) -> None:
    """Its --dir is a place to work in, not one to empty: it once removed the directory
    it was given, with whatever the user kept there."""
    kept = tmp_path / "kept.txt"
    kept.write_text("the user's")
    assert rebuild.main(["--slots", "64", "--repeat", "1", "--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]
    assert kept.read_text() == "the user's"


_DEVICE_BENCHES = ["copy_calls", "gil_contention", "io", "replicas", "spill_parts", "sweep"]


@pytest.mark.parametrize("name", _DEVICE_BENCHES)
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0"]
                         + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
def test_a_device_the_benchmark_cannot_use_is_one_line_naming_the_flag(
    name: str, device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # StateKVConfig.device's names, and a GPU this machine lacks: refused at the command
    # line, not as a traceback from the first cache the run opens.
    bench = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", device])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--device" in err and "Traceback" not in err


def test_the_e2e_benchmark_refuses_a_device_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import e2e

    monkeypatch.setattr(sys, "argv", ["bench.e2e", "--device", "tpu"])
    with pytest.raises(SystemExit) as exit_:
        e2e.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device" in err, err
