"""`statekv serve`'s settings: flags, STATEKV_* variables and a TOML config file (in that order
of precedence, over the defaults), pools in bytes; every mistake one line naming where it was
made, with exit status 2 and nothing started or created."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from serve.cli import (
    EXIT_USAGE,
    LIBRARY_LOGGERS,
    _field_name,
    build_parser,
    configure_logging,
    kv_block_bytes,
    main,
    server_options,
    subcommand,
)
from serve.server import ServerOptions
from serve.settings import Origin, read_environment, resolve, settings_of
from tests.test_cli import REPO, STATEKV, one_line_error, popen_with_ctrl_c

TINY_BLOCK = 8192
"""Bytes of KV in one 16-token block of the tiny model: 2 layers x K and V x 2 kv heads x 32
x 16 tokens x 4 bytes (float32)."""


def settle(argv: list[str], environ: Mapping[str, str] | None = None
           ) -> tuple[argparse.Namespace, Origin, list[str]]:
    """argv's settings as `statekv serve` resolves them, with this environment."""
    parser = build_parser()
    args = parser.parse_args(argv)
    resolved, origin, warnings = resolve(parser, subcommand(parser, "serve"), argv, args,
                                         environ or {})
    resolved.origin = origin
    return resolved, origin, warnings


def options(argv: list[str], environ: Mapping[str, str] | None = None) -> ServerOptions:
    args, _origin, warnings = settle(["serve", *argv], environ)
    assert warnings == []
    return server_options(args)


def test_the_tiny_models_block_is_what_the_server_allocates() -> None:
    from serve._models import config

    layout = config.preset("tiny").kv_layout()
    assert kv_block_bytes("tiny", None, 16) == TINY_BLOCK == layout.block_bytes(16)
    assert kv_block_bytes("tiny", 4, 32) == 4 * TINY_BLOCK


# ---------------------------------------------------------------------- precedence


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(
    tmp_path: Path,
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('max_model_len = 1024\nserved_model_name = "from-file"\n'
                      'max_running = 3\nlog_level = "error"\n')
    env = {"STATEKV_MAX_MODEL_LEN": "512", "STATEKV_SERVED_MODEL_NAME": "from-env",
           "STATEKV_LOG_LEVEL": "debug"}
    assert options([]).max_model_len == 2048  # the default
    assert options(["--config", str(config)]).max_model_len == 1024
    both = options(["--config", str(config)], env)
    assert (both.max_model_len, both.served_model_name, both.max_running) == (
        512, "from-env", 3)
    flagged, origin, _ = settle(["serve", "--config", str(config), "--max-model-len", "256",
                                 "--log-level", "warning"], env)
    assert (flagged.max_model_len, flagged.served_model_name, flagged.max_running,
            flagged.log_level) == (256, "from-env", 3, "warning")
    assert origin.name("max_model_len") == "--max-model-len"
    assert origin.name("served_model_name") == "STATEKV_SERVED_MODEL_NAME"
    assert origin.name("max_running") == f"{config}: max_running"
    # A flag given with the default's value still beats the others.
    assert options(["--config", str(config), "--max-model-len", "2048"], env).max_model_len \
        == 2048


def test_statekv_config_names_the_file_when_the_flag_does_not(tmp_path: Path) -> None:
    env_file, flag_file = tmp_path / "env.toml", tmp_path / "flag.toml"
    env_file.write_text("max_running = 5\n")
    flag_file.write_text("max_running = 7\n")
    env = {"STATEKV_CONFIG": str(env_file)}
    assert options([], env).max_running == 5
    assert options(["--config", str(flag_file)], env).max_running == 7


def test_a_pool_in_bytes_and_in_blocks_are_one_setting_across_places(tmp_path: Path) -> None:
    """The file sizes the GPU pool in bytes, the environment in blocks: the environment wins
    and the file's size is not applied too."""
    config = tmp_path / "serve.toml"
    config.write_text('gpu_size = "64MiB"\nhost_blocks = 7\n')
    opts = options(["--config", str(config)], {"STATEKV_GPU_BLOCKS": "300"})
    assert (opts.gpu_blocks, opts.host_blocks) == (300, 7)
    opts = options(["--config", str(config), "--host-size", "1MiB"],
                   {"STATEKV_GPU_BLOCKS": "300"})
    assert (opts.gpu_blocks, opts.host_blocks) == (300, 128)
    assert options(["--config", str(config)]).gpu_blocks == 64 * 2**20 // TINY_BLOCK


def test_log_level_from_the_environment_reaches_every_logger() -> None:
    args, _origin, _ = settle(["serve"], {"STATEKV_LOG_LEVEL": "debug"})
    assert args.log_level == "debug"
    configure_logging(args.log_level)
    try:
        for name in (*LIBRARY_LOGGERS, "io_actors.storage.posix", "statekv_serve.server"):
            assert logging.getLogger(name).isEnabledFor(logging.DEBUG), name
    finally:
        configure_logging("warning")


# ---------------------------------------------------------------------- byte sizes


@pytest.mark.parametrize(("argv", "expected"), [
    (["--gpu-size", "8MiB", "--host-size", "1MiB", "--reserved-host-size", "256KiB",
      "--disk-size", "100MiB"], (1024, 128, 32, 12800)),
    # Decimal units, fractions and spaces; rounded down to whole blocks.
    (["--gpu-size", "40MB", "--host-size", "1.5 MiB", "--reserved-host-size", "8191KiB",
      "--disk-size", "0.001GB"], (40 * 10**6 // 8192, 192, 1023, 122)),
    # 0 bytes is no pool, as 0 blocks is.
    (["--gpu-size", "1GiB", "--host-size", "0B", "--reserved-host-size", "0KiB",
      "--disk-size", "0GiB"], (2**30 // 8192, 0, 0, 0)),
    # A block of 32 tokens of a 4-layer tiny model is 4 x 8 KiB.
    (["--layers", "4", "--block-size", "32", "--gpu-size", "16MiB", "--disk-size", "1TB"],
     (16 * 2**20 // (4 * 8192), 4 * 128 // 32, -(-128 // 32), 10**12 // (4 * 8192))),
])
def test_sizes_in_bytes_become_whole_blocks_of_the_models_kv(
    argv: list[str], expected: tuple[int, int, int, int],
) -> None:
    opts = options(argv)
    assert (opts.gpu_blocks, opts.host_blocks, opts.reserved_host_blocks,
            opts.disk_blocks) == expected


# ---------------------------------------------------------------------- mistakes


@pytest.fixture
def nothing_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A disk_dir that must not appear, and no temporary directory made meanwhile."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for name in list(os.environ):
        if name.startswith("STATEKV_"):
            monkeypatch.delenv(name)
    disk_dir = tmp_path / "slots"
    yield disk_dir
    assert not disk_dir.exists()
    assert list(scratch.iterdir()) == []


FILE_MISTAKES = [
    ('gpu_sizes = "1GiB"', "gpu_sizes: unknown setting (did you mean gpu_size?)"),
    ('max_model_len = "4096"', "max_model_len: must be an integer, got '4096'"),
    ("max_model_len = 1", "max_model_len: must be an integer >= 2, got 1"),
    ("port = 8000.5", "port: must be an integer"),
    ("gpu_blocks = true", "gpu_blocks: must be an integer, got True"),
    ("gpu_size = 8589934592", "gpu_size: must be a string, got 8589934592"),
    ('gpu_size = "8 parsecs"', "gpu_size: cannot read size '8 parsecs'"),
    ('gpu_size = "8"', "gpu_size: '8' has no unit"),
    ('log_level = "loud"', "log_level: must be one of critical, error, warning, info, debug"),
    ('device = "tpu"', "device: unknown device 'tpu'"),
    ("[serve]\nport = 1", "serve: unknown setting"),
    ('gpu_size = "1GiB"\ngpu_blocks = 4', "gpu_size and "),
    ('config = "other.toml"', "config: unknown setting"),
    ('gpu_size = "1KiB"', "gpu_size: 1KiB holds no block: one block of 16 tokens of tiny "
     "is 8KiB"),
    ('disk_size = "4KiB"', "disk_size: 4KiB holds no block"),
    ('gpu_size = "64KiB"', "gpu_size: 64KiB is 8 blocks of 16 tokens, which hold 128 tokens, "
     "fewer than --max-model-len 2048: raise "),
    ("max_model_len = = 3", "not valid TOML"),
]


@pytest.mark.parametrize(("content", "expected"), FILE_MISTAKES)
def test_a_config_file_mistake_is_one_line_naming_the_file_and_the_key(
    content: str, expected: str, nothing_created: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(f'disk_dir = "{nothing_created}"\nport = 0\n{content}\n'
                      if "port" not in content else f"{content}\n")
    assert main(["serve", "--config", str(config)]) == EXIT_USAGE
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith(f"statekv serve: error: {config}"), line
    assert expected in line, line
    assert captured.out == ""


ENV_MISTAKES = [
    ({"STATEKV_GPU_SIZE": "8"}, "STATEKV_GPU_SIZE: '8' has no unit"),
    ({"STATEKV_MAX_MODEL_LEN": "long"}, "STATEKV_MAX_MODEL_LEN: must be an integer, got "
     "'long'"),
    ({"STATEKV_LOG_LEVEL": "loud"}, "STATEKV_LOG_LEVEL: must be one of"),
    ({"STATEKV_MAX_MODEL_LENGTH": "4096"}, "STATEKV_MAX_MODEL_LENGTH is not a setting of "
     "statekv serve (did you mean STATEKV_MAX_MODEL_LEN?)"),
    ({"STATEKV_GPU_BLOCK": "4"}, "did you mean STATEKV_GPU_BLOCKS?"),
    ({"statekv_gpu_size": "1GiB", "STATEKV_gpu_size": "1GiB"}, "STATEKV_gpu_size is not a "
     "setting"),
    ({"STATEKV_GPU_SIZE": "1GiB", "STATEKV_GPU_BLOCKS": "4"},
     "STATEKV_GPU_SIZE and STATEKV_GPU_BLOCKS both give the GPU pool: give one of them"),
    ({"STATEKV_GPU_SIZE": "64KiB"}, "STATEKV_GPU_SIZE: 64KiB is 8 blocks"),
    ({"STATEKV_CONFIG": "/nonexistent/serve.toml"}, "STATEKV_CONFIG=/nonexistent/serve.toml: "
     "cannot read it"),
    ({"STATEKV_CONFIG": ""}, "STATEKV_CONFIG is empty"),
    ({"STATEKV_DISK_DIR": "/dev/null"}, "STATEKV_DISK_DIR: '/dev/null' exists and is not a "
     "directory"),
]


@pytest.mark.parametrize(("environ", "expected"), ENV_MISTAKES)
def test_an_environment_mistake_is_one_line_naming_the_variable(
    environ: dict[str, str], expected: str, nothing_created: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--port", "0", "--disk-dir", str(nothing_created)]) == EXIT_USAGE
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith("statekv serve: error: "), line
    assert expected in line, line
    assert captured.out == ""


@pytest.mark.parametrize(("argv", "expected"), [
    (["--gpu-size", "1GiB", "--gpu-blocks", "4"],
     "--gpu-size and --gpu-blocks both give the GPU pool"),
    (["--gpu-size", "64"], "argument --gpu-size: '64' has no unit"),
    (["--disk-size=-1GiB"], "argument --disk-size: cannot read size '-1GiB'"),
    (["--gpu-size", "1KiB"], "argument --gpu-size: 1KiB holds no block"),
    (["--gpu-size", "0B"], "argument --gpu-size: 0B holds no block"),
    (["--gpu-size", "64KiB"], "argument --gpu-size: 64KiB is 8 blocks of 16 tokens, which "
     "hold 128 tokens, fewer than --max-model-len 2048: raise --gpu-size or lower "
     "--max-model-len"),
    # Too large to allocate here: the cache's own refusal, naming the flag the user set.
    (["--host-size", "64TiB"], "argument --host-size: host: "),
    (["--config", "/nonexistent/serve.toml"], "--config /nonexistent/serve.toml: cannot read"),
])
def test_a_size_flag_mistake_is_one_line_naming_the_flag(
    argv: list[str], expected: str, nothing_created: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--port", "0", "--disk-dir", str(nothing_created), *argv]
                ) == EXIT_USAGE
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert expected in line, line
    assert "Traceback" not in captured.err and captured.out == ""


def test_the_demo_takes_sizes_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--gpu-size", "1GiB", "--gpu-blocks", "4"]) == EXIT_USAGE
    assert "--gpu-size and --gpu-blocks both size one pool" in one_line_error(
        capsys.readouterr().err)


def test_a_cache_error_names_the_variable_that_set_the_value() -> None:
    args, _origin, _ = settle(["serve"], {"STATEKV_HOST_SIZE": "1GiB",
                                          "STATEKV_REMOTE_SECRET": "00" * 16})
    assert _field_name(args, "host") == "STATEKV_HOST_SIZE"
    assert _field_name(args, "disk") == "--disk-blocks"  # its default applied
    assert _field_name(args, "remote_secret") == "STATEKV_REMOTE_SECRET"
    assert _field_name(args, "remote_url") == "--remote-url"


# ---------------------------------------------------------------------- secrets


def test_secrets_in_the_environment_are_never_repeated(
    nothing_created: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    monkeypatch.setenv("STATEKV_REMOTE_SECRET", "not-hex-but-very-secret")
    assert main(["serve", "--port", "0", "--remote-url", "redis://127.0.0.1:1"]) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert "STATEKV_REMOTE_SECRET must be hex" in line and "very-secret" not in line
    # Too short for a secret: the cache refuses it, naming the variable and not the value.
    monkeypatch.setenv("STATEKV_REMOTE_SECRET", "abcdef0123")
    monkeypatch.setenv("STATEKV_REMOTE_PASSWORD", "hunter2-password")
    assert main(["serve", "--port", "0", "--remote-url", "redis://127.0.0.1:1",
                 "--disk-blocks", "0", "--reserved-host-blocks", "0"]) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("statekv serve: error: STATEKV_REMOTE_SECRET: remote_secret: "), line
    assert "abcdef0123" not in line and "hunter2" not in line
    # A file of the secret and the variable both: which one was meant is not guessed.
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123")
    monkeypatch.setenv("STATEKV_REMOTE_SECRET_FILE", str(secret))
    assert main(["serve", "--port", "0"]) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert "STATEKV_REMOTE_SECRET_FILE and STATEKV_REMOTE_SECRET both give" in line, line
    # But a flag beats the variable, as for every setting.
    args, origin, _ = settle(["serve", "--remote-secret-file", str(secret)],
                             {"STATEKV_REMOTE_SECRET": "00" * 16,
                              "STATEKV_REMOTE_PASSWORD": "hunter2-password"})
    assert (args.remote_secret_file, args.remote_secret) == (secret, None)
    opts = server_options(args)
    assert opts.remote_secret == b"0123456789abcdef0123"
    assert opts.remote_password == "hunter2-password"
    assert "hunter2" not in repr(opts) and "hunter2" not in repr(origin)


def test_a_secret_in_the_config_file_is_refused_pointing_at_its_file_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('remote_password = "hunter2-password"\n')
    assert main(["serve", "--config", str(config)]) == EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert f"{config}: remote_password: " in line and "remote_password_file" in line
    assert "hunter2" not in line


# ---------------------------------------------------------------------- other variables


def test_a_statekv_variable_far_from_any_setting_is_a_one_line_warning() -> None:
    actions = settings_of(subcommand(build_parser(), "serve"))
    values, warnings = read_environment({"STATEKV_FLAVOUR": "vanilla", "PATH": "/bin",
                                         "STATEKV_FUZZ_PROFILE": "ci"}, actions)
    assert values == {}
    assert warnings == ["STATEKV_FLAVOUR is not a setting of statekv serve; ignored"]


# ---------------------------------------------------------------------- every key


EVERY_KEY = {
    "model": '"tiny"', "layers": "2", "device": '"cpu"', "block_size": "16",
    "gpu_size": '"8MiB"', "host_size": '"1MiB"', "reserved_host_size": '"256KiB"',
    "disk_size": '"16MiB"', "disk_dir": None, "host": '"127.0.0.1"', "port": None,
    "served_model_name": '"every-key"', "max_model_len": "1024", "max_running": "8",
    "seed": "7", "remote_url": '"redis://127.0.0.1:1"', "remote_namespace": '"every"',
    "remote_secret_file": None, "remote_password_file": None, "remote_tls_ca_file": None,
    "log_level": '"warning"', "publish_on": '"eviction"', "retention_write_through": '"off"',
}
"""A value for every setting of `statekv serve` (None: filled in per test)."""
BLOCK_KEYS = {"gpu_blocks": "64", "host_blocks": "8", "reserved_host_blocks": "2",
              "disk_blocks": "32"}
"""The pools in blocks instead (a file cannot give both)."""


def _toml(values: Mapping[str, str | None], fill: Mapping[str, str]) -> str:
    return "".join(f"{key} = {fill.get(key, value)}\n" for key, value in values.items())


def test_every_setting_of_serve_has_a_key(tmp_path: Path) -> None:
    actions = settings_of(subcommand(build_parser(), "serve"))
    assert set(actions) == set(EVERY_KEY) | set(BLOCK_KEYS)
    secret, password = tmp_path / "secret", tmp_path / "password"
    secret.write_bytes(b"0123456789abcdef0123\n")
    password.write_text("hunter2-password\n")
    fill = {"disk_dir": f'"{tmp_path / "slots"}"', "port": "0",
            "remote_secret_file": f'"{secret}"', "remote_password_file": f'"{password}"',
            "remote_tls_ca_file": f'"{tmp_path / "ca.pem"}"'}
    config = tmp_path / "serve.toml"
    config.write_text(_toml(EVERY_KEY, fill))
    opts = options(["--config", str(config)])
    assert opts == ServerOptions(
        model="tiny", layers=2, device="cpu", seed=7, block_size=16, gpu_blocks=1024,
        host_blocks=128, reserved_host_blocks=32, disk_blocks=2048,
        disk_dir=tmp_path / "slots", served_model_name="every-key", max_model_len=1024,
        max_running=8, remote_url="redis://127.0.0.1:1", remote_namespace="every",
        remote_secret=b"0123456789abcdef0123", remote_password="hunter2-password",
        remote_tls_ca_file=tmp_path / "ca.pem", publish_on="eviction",
        retention_write_through=False)
    blocks = dict(EVERY_KEY, **BLOCK_KEYS)
    for key in ("gpu_size", "host_size", "reserved_host_size", "disk_size"):
        del blocks[key]
    config.write_text(_toml(blocks, fill))
    opts = options(["--config", str(config)])
    assert (opts.gpu_blocks, opts.host_blocks, opts.reserved_host_blocks,
            opts.disk_blocks) == (64, 8, 2, 32)


def test_a_server_started_from_a_config_file_reports_the_blocks_it_converted(
    tmp_path: Path,
) -> None:
    """Every key but the shared tier's (no cluster here), through the real command."""
    local = {key: value for key, value in EVERY_KEY.items() if not key.startswith("remote_")}
    config = tmp_path / "serve.toml"
    config.write_text(_toml(local, {"disk_dir": f'"{tmp_path / "slots"}"', "port": "0"}))
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("STATEKV_")}
    server = popen_with_ctrl_c([*STATEKV, "serve", "--config", str(config)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**env, "STATEKV_MAX_RUNNING": "4"})
    assert server.stdout is not None
    try:
        first = server.stdout.readline()
        assert first.startswith("statekv serve: every-key (tiny) on http://127.0.0.1:"), first
        assert "GPU 1024 blocks, host 128+32, disk 2048 blocks of 16 tokens" in first, first
        url = first.split(" on ")[1].split(",")[0]
        (model,) = httpx.get(f"{url}/models", timeout=30).json()["data"]
        assert model["max_model_len"] == 1024
        assert (tmp_path / "slots").is_dir()
    finally:
        server.send_signal(2)
        _out, err = server.communicate(timeout=60)
    assert server.returncode == 130, err
    assert "Traceback" not in err


# ---------------------------------------------------------------------- who reads it


def _reads_the_environment(source: str) -> list[int]:
    """Lines of `source` that name os.environ, os.getenv or os.putenv (any spelling that
    ends in those attributes or names)."""
    import ast

    names = {"environ", "getenv", "putenv", "environb", "getenvb"}
    return [node.lineno for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.Attribute) and node.attr in names)
            or (isinstance(node, ast.Name) and node.id in names)
            or (isinstance(node, ast.alias) and node.name in names)]


@pytest.mark.parametrize("package", ["statekv", "io_actors", "models", "serve"])
def test_only_the_entry_point_reads_the_environment(package: str) -> None:
    """The command reads it once (serve/cli.py) and hands it to serve/settings.py; below, a
    setting arrives as a field of a configuration record."""
    found = {str(path.relative_to(REPO)): lines
             for path in sorted((REPO / package).rglob("*.py"))
             if (lines := _reads_the_environment(path.read_text()))}
    if package == "serve":
        assert set(found) == {"serve/cli.py"}, found
    else:
        assert found == {}, found


def test_the_environment_check_catches_a_planted_read() -> None:
    assert _reads_the_environment("import os\nx = os.environ.get('A')\n") == [2]
    assert _reads_the_environment("from os import getenv\n") == [1]
    assert _reads_the_environment("import os\nx = os.path.join('a')\n") == []
