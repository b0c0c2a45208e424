"""bench.pyspy_summary on a hand-written raw profile: per-thread counts, the lock figure,
and one line for a file that is not a profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pyspy_summary import main, read_stacks, summarize, waits_for_lock

FORWARD = "PagedDecoder.forward (models/model.py:387)"
PROFILE = "\n".join([
    # The serving thread inside the forward pass: retaking the lock after a torch call...
    f"thread (1): MainThread;step (bench/io.py:1);{FORWARD};_layer (models/model.py:476);"
    "torch::autograd::THPVariable_add;pybind11::gil_scoped_release::~gil_scoped_release;"
    "pthread_cond_timedwait;0x7f00 5",
    # ... dropping a tensor's reference ...
    f"thread (1): MainThread;{FORWARD};THPVariable_dealloc;THPVariable_clear;"
    "pthread_cond_timedwait;0x7f00 2",
    # ... running (not waiting) ...
    f"thread (1): MainThread;{FORWARD};_prepare (models/model.py:620);"
    "at::native::repeat_interleave_cpu 3",
    # ... and outside the function asked about.
    "thread (1): MainThread;ServingLoop.step (models/serving_loop.py:400);"
    "pybind11::gil_scoped_acquire::gil_scoped_acquire;pthread_cond_timedwait 4",
    # A worker waiting for a job on a Python lock: a condition wait, not a lock retake.
    "thread (2): statekv-writer-0;WorkerThreads._thread_main (io_actors/actors/worker_threads"
    ".py:200);PyThread_acquire_lock_timed;pthread_cond_timedwait 7",
]) + "\n"


def test_the_lock_figure_counts_retakes_inside_the_function_only() -> None:
    summary = summarize(read_stacks(PROFILE.splitlines()), within="PagedDecoder.forward",
                        top=2)
    assert summary.threads == {"thread (2): statekv-writer-0": 7, "thread (1): MainThread": 14}
    assert summary.within == 10
    assert summary.within_waiting == 7
    assert summary.top["thread (1): MainThread"][0] == ("_layer", 5)
    assert not waits_for_lock(("WorkerThreads._thread_main (x.py:1)",
                               "PyThread_acquire_lock_timed", "pthread_cond_timedwait"))


def test_the_command_prints_the_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    path = tmp_path / "profile.txt"
    path.write_text(PROFILE)
    assert main([str(path), "--within", "PagedDecoder.forward"]) == 0
    out = capsys.readouterr().out
    assert "PagedDecoder.forward: 10 samples, 7 (70%) waiting" in out


@pytest.mark.parametrize("content", ["not a profile at all\n", "MainThread 3\n"])
def test_a_file_that_is_not_a_raw_profile_is_one_line(
        content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.txt"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main([str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument profile" in err


def test_a_missing_file_and_a_bad_top_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([str(tmp_path / "missing.txt")],
                 [str(tmp_path / "missing.txt"), "--top", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_thread_sampled_without_frames_counts_as_native_only() -> None:
    # py-spy writes a thread caught outside any frame (without --native) as its thread
    # frame alone; such a line is part of the profile, not a malformed one.
    stacks = list(read_stacks(["thread (7): MainThread 187\n",
                               "thread (7): MainThread;f (x.py:1) 3\n"]))
    assert [(s.thread, s.frames, s.count) for s in stacks] == [
        ("thread (7): MainThread", (), 187), ("thread (7): MainThread", ("f (x.py:1)",), 3)]
    summary = summarize(stacks, within=None, top=4)
    assert summary.threads == {"thread (7): MainThread": 190}
    assert summary.top["thread (7): MainThread"][0] == ("(native only)", 187)
