"""The `statekv` command: every user mistake gets one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from serve.cli import EXIT_INTERRUPTED, EXIT_USAGE, build_parser, main

REPO = Path(__file__).resolve().parents[1]
STATEKV = [sys.executable, "-c", "import sys; from serve.cli import main; sys.exit(main())"]
SMALL_DEMO = ["demo", "--users", "2", "--rounds", "2", "--system-tokens", "16",
              "--question-tokens", "8", "--answer-tokens", "4"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter, its output not a terminal."""
    return subprocess.run([*STATEKV, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, check=False)


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------- the parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_subparsers(sub))
    return found


def test_every_flag_has_help_text_that_states_its_default() -> None:
    for parser in _subparsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction
                          | argparse._SubParsersAction) or not action.option_strings:
                continue
            assert action.help, f"{parser.prog} {action.option_strings} has no help"
            if not isinstance(action, argparse._StoreTrueAction) and action.choices is None:
                assert "default" in action.help, (parser.prog, action.option_strings)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "statekv 0.1.0"


@pytest.mark.parametrize(("argv", "flag"), [
    (["demo", "--users", "0"], "--users"),
    (["demo", "--gpu-blocks", "-1"], "--gpu-blocks"),
    (["demo", "--ttl", "-5"], "--ttl"),
    (["demo", "--ttl", "nan"], "--ttl"),
    (["demo", "--ttl", "soon"], "--ttl"),
    (["demo", "--arrival-rate", "0"], "--arrival-rate"),
    (["demo", "--block-size", "0"], "--block-size"),
    (["demo", "--block-size", "4097"], "--block-size"),
    (["demo", "--retained-fraction", "1.5"], "--retained-fraction"),
    (["demo", "--device", "tpu"], "--device"),
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--model", "huge"], "--model"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-model-len", "1"], "--max-model-len"),
    (["serve", "--served-model-name", ""], "--served-model-name"),
    (["serve", "--served-model-name", " statekv"], "--served-model-name"),
    (["serve", "--served-model-name", "tab\there"], "--served-model-name"),
    (["trace", "summary", "t.jsonl", "--top", "0"], "--top"),
    (["frobnicate"], "COMMAND"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert flag in line and "error" in line
    assert captured.out == ""


@pytest.mark.parametrize(("argv", "prog", "unknown"), [
    (["serve", "--max-ttl", "5"], "statekv serve", "--max-ttl 5"),
    (["demo", "--bogus"], "statekv demo", "--bogus"),
    (["trace", "view", "t.jsonl", "--bogus"], "statekv trace view", "--bogus"),
    (["serve", "--port", "8001", "extra"], "statekv serve", "extra"),
])
def test_an_unknown_flag_is_named_by_the_subcommand_given_it(
    argv: list[str], prog: str, unknown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag was given to the subcommand, so the error and the help it points to are
    the subcommand's, not the top-level command's."""
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith(f"{prog}: error: unrecognized arguments: {unknown} "), line
    assert line.endswith(f"(see {prog} --help)"), line
    assert captured.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--device", "cuda"]) == EXIT_USAGE
    assert "--device" in one_line_error(capsys.readouterr().err)


def test_disk_dir_naming_a_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    for where in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        assert main(["demo", "--disk-dir", str(where)]) == EXIT_USAGE
        assert "--disk-dir" in one_line_error(capsys.readouterr().err)


def test_output_into_a_missing_directory_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing" / "x.json"
    for argv in (["trace", "perfetto", "t.jsonl", "-o", str(missing)],
                 ["trace", "view", "t.jsonl", "-o", str(missing)],
                 ["demo", "--trace", str(missing)]):
        assert main(argv) == EXIT_USAGE
        assert "does not exist" in one_line_error(capsys.readouterr().err)
    assert not missing.parent.exists()


def test_a_typed_error_from_below_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The cache's own ConfigError (a disk tier with no host tier to spill from)."""
    argv = [*SMALL_DEMO, "--host-blocks", "0", "--reserved-host-blocks", "0", "--no-identity"]
    assert main(argv) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("statekv demo: error: argument --disk-blocks: disk:")


def test_serve_reports_an_impossible_budget_before_it_listens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["serve", "--port", "0", "--host-blocks", "0", "--reserved-host-blocks", "0"]
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "argument --disk-blocks" in one_line_error(captured.err)
    assert captured.out == ""


@pytest.mark.parametrize(("flag", "value"), [
    ("--remote-url", "http://10.0.0.5:7000"),
    ("--remote-url", "redis://127.0.0.1:1"),  # nothing listens there
    ("--remote-namespace", "a b"),
])
def test_serve_reports_a_bad_shared_tier_naming_its_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, tmp_path: Path,
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123\n")
    argv = ["serve", "--port", "0", "--disk-blocks", "0", "--reserved-host-blocks", "0", flag,
            value, "--remote-secret-file", str(secret)]
    if flag == "--remote-namespace":
        argv += ["--remote-url", "redis://127.0.0.1:1"]
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert f"argument {flag}" in one_line_error(captured.err)
    assert captured.out == ""


@pytest.mark.parametrize(("extra", "flag"), [
    ([], "--remote-secret-file"),  # a shared tier must be authenticated
    (["--remote-secret-file", "/nonexistent/secret"], "--remote-secret-file"),
    (["--remote-url", "redis://user:pw@127.0.0.1:1"], "--remote-url"),  # no password in URLs
])
def test_serve_refuses_an_unauthenticated_shared_tier_naming_the_flag(
    capsys: pytest.CaptureFixture[str], extra: list[str], flag: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STATEKV_REMOTE_SECRET", raising=False)
    argv = ["serve", "--port", "0", "--disk-blocks", "0", "--reserved-host-blocks", "0"]
    if "--remote-url" not in extra:
        argv += ["--remote-url", "redis://127.0.0.1:1"]
    assert main([*argv, *extra]) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert f"argument {flag}" in line or flag in line, line
    assert "pw" not in line  # a password is never repeated


def test_a_gpu_pool_too_small_for_one_request_names_gpu_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SMALL_DEMO, "--gpu-blocks", "1", "--no-identity"]) == EXIT_USAGE
    assert "argument --gpu-blocks: 1 blocks" in one_line_error(capsys.readouterr().err)


def test_a_busy_port_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == EXIT_USAGE
    assert f"--port: cannot listen on 127.0.0.1:{port}" in one_line_error(
        capsys.readouterr().err)


# ---------------------------------------------------------------------- runs


def test_block_counts_follow_the_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    """--block-size 3 alone used to start and then fail: the other budgets are in tokens."""
    assert main([*SMALL_DEMO, "--block-size", "3"]) == 0
    out = capsys.readouterr().out
    # 640 GPU tokens, 128 host (+128 reserved), 65536 disk tokens, in blocks of 3.
    assert "GPU 214 blocks, host 43+43, disk 21846 blocks of 3 tokens" in out
    assert re.search(r"identity vs unlimited GPU +PASS: 4/4", out)


def test_demo_marks_the_figures_that_depend_on_timing_and_stays_quiet_in_a_log() -> None:
    done = run_cli(*SMALL_DEMO)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\r" not in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("  ")]
    timed = {line.split(" ~ ")[0].strip() for line in rows if " ~ " in line}
    assert {"served from disk", "TTFT p50 / p99", "wall time", "spills (host -> disk)"} <= timed
    assert {"prompt tokens", "identity vs unlimited GPU"}.isdisjoint(timed)
    assert any(line.strip().startswith("prompt tokens") for line in rows)
    assert "~ depends on timing" in done.stdout


def popen_with_ctrl_c(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """Start a child that takes SIGINT as a terminal's foreground process does.  A test run
    started in the background of a non-interactive shell (`.ci/run &`) ignores SIGINT, and a
    Python child inherits an ignored SIGINT and never sees a KeyboardInterrupt; a handled one
    is reset to the default at exec, so handle it here while the child starts."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, text=True, **kwargs)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_ends_with_status_130_and_no_traceback() -> None:
    # faulthandler: a demo that outlives its Ctrl-C is made to dump every thread's stack
    # (SIGABRT), so the failure says where the interrupt went.
    process = popen_with_ctrl_c(
        [*STATEKV, "demo", "--users", "64", "--rounds", "64", "--arrival-rate", "1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert process.stdout is not None
    first = process.stdout.readline()  # the demo has started serving
    assert first.startswith("model tiny")
    os.kill(process.pid, signal.SIGINT)
    try:
        _out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _out, err = process.communicate(timeout=30)
        pytest.fail(f"the demo went on for 120 s after Ctrl-C; its threads:\n{err}")
    assert process.returncode == EXIT_INTERRUPTED, err
    assert err.strip() == "statekv demo: interrupted"


def test_the_console_script_is_the_command() -> None:
    script = Path(sys.executable).parent / "statekv"
    done = subprocess.run([str(script), "demo", "--users", "0"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == EXIT_USAGE
    assert "--users" in one_line_error(done.stderr)


def test_sigterm_ends_serve_with_status_143_and_removes_its_temporary_directory(
    tmp_path: Path,
) -> None:
    """Without --disk-dir the server keeps its slots in a temporary directory: SIGTERM (a
    container stop, systemd) must remove it, as a clean exit does."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    process = subprocess.Popen(
        [*STATEKV, "serve", "--port", "0", "--host", "127.0.0.1"], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONFAULTHANDLER": "1"},
    )
    assert process.stdout is not None
    try:
        first = process.stdout.readline()
        assert first.startswith("statekv serve:"), first
        assert [p.name for p in tmp.iterdir() if p.name.startswith("statekv-serve-")]
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1] == "statekv serve: terminated", err
    assert "Traceback" not in err
    assert [p.name for p in tmp.iterdir()] == []


def test_trace_summary_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`statekv trace summary F | head`: the reader leaves early; no error, no traceback."""
    trace = tmp_path / "t.jsonl"
    done = subprocess.run([*STATEKV, "demo", "--users", "2", "--rounds", "2", "--trace",
                           str(trace), "--no-identity"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL)
    summary = subprocess.run([*STATEKV, "trace", "summary", str(trace), "--top", "100000"],
                             cwd=REPO, stdout=reader.stdin, stderr=subprocess.PIPE,
                             text=True, timeout=120, check=False)
    assert reader.stdin is not None
    reader.stdin.close()
    reader.wait(30)
    assert summary.returncode in (0, 141), summary.stderr
    assert summary.stderr == "", summary.stderr


def test_a_host_that_is_not_this_machines_is_blamed_on_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--host", "999.1.1.1", "--port", "0"]) == EXIT_USAGE
    assert "argument --host" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_log_level_reaches_statekvs_own_loggers(command: str) -> None:
    import logging

    from serve.cli import LIBRARY_LOGGERS, configure_logging

    args = build_parser().parse_args([command, "--log-level", "debug"])
    assert args.log_level == "debug"
    configure_logging(args.log_level)
    for name in LIBRARY_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() == logging.DEBUG
    assert logging.getLogger("io_actors.storage.posix").isEnabledFor(logging.DEBUG)


def test_a_library_warning_is_printed_with_its_level_and_logger() -> None:
    """After the entry point's setup a library record is a formatted line on stderr (time,
    level, logger), not the bare message Python prints for an unconfigured logger."""
    code = ("import logging; from serve.cli import configure_logging; "
            "configure_logging('info'); "
            "logging.getLogger('io_actors.storage.posix').warning('a warning of the store'); "
            "logging.getLogger('io_actors.embed').debug('not shown at info')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.endswith(" WARNING io_actors.storage.posix: a warning of the store"), line


def test_a_gpu_pool_smaller_than_the_longest_request_is_refused_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One 16-token block cannot hold a 2,048-token request: refused before listening, not
    # silently cut to 16 tokens of context.
    assert main(["serve", "--port", "0", "--gpu-blocks", "1"]) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert "argument --gpu-blocks: 1 blocks of 16 tokens, which hold 16 tokens" in line, line
    assert "--max-model-len 2048" in line, line
