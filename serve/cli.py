"""The ``statekv`` command.

    statekv demo [options]              the multi-round chat demo, disk tier on a temp dir
    statekv serve [options]             the OpenAI-compatible server, metrics at /metrics
    statekv trace view TRACE [-o F]     one self-contained HTML timeline of a recorded trace
    statekv trace summary TRACE         counts by transition, longest parks, slowest transfers
    statekv trace perfetto TRACE [-o F] the trace in Chrome trace-event format (Perfetto)
    statekv --version

Command-line flags are read here, once, into configuration records; so are, for `statekv
serve`, the STATEKV_* environment variables and the --config file (serve/settings.py, handed
the environment from here: flag > environment > file > default).  Nothing deeper reads the
command line or the environment.  A user's mistake (a bad flag value, a typed error from the
layers below, a path that cannot be written) is answered with one line on stderr and exit
status 2, never a traceback; Ctrl-C ends with status 130.  statekv's own bugs
(``InvariantViolation``) keep their traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

from statekv.errors import InvariantViolation, StateKVError, UsageError

from .settings import Origin, SettingError, resolve
from .shutdown import Terminated

if TYPE_CHECKING:
    from rich.progress import Progress

    from .server import ServerOptions

EXIT_USAGE: Final = 2
"""A user's mistake (argparse's own status for bad flags)."""
EXIT_INTERRUPTED: Final = 130
"""Ended by Ctrl-C (128 + SIGINT, the shell's convention)."""
EXIT_TERMINATED: Final = 143
EXIT_BROKEN_PIPE: Final = 141
"""The reader of our output went away (128 + SIGPIPE, what a shell reports)."""
"""Ended by SIGTERM (128 + SIGTERM), after a graceful shutdown."""

# Budgets of the demo and the server in tokens: the block counts they default to follow
# --block-size (40 GPU blocks of 16 tokens are 214 blocks of 3).
GPU_TOKENS: Final = 640
HOST_TOKENS: Final = 128
RESERVED_HOST_TOKENS: Final = 128
DISK_TOKENS: Final = 65536
DEVICES: Final = "auto, cpu, cuda or cuda:N"
SIZE_UNITS: Final = "B, KiB, MiB, GiB, TiB, or decimal KB, MB, GB, TB"
SERVER_MODULES: Final = frozenset({
    "fastapi", "starlette", "pydantic", "pydantic_core", "anyio", "uvicorn", "h11", "click",
    "prometheus_client"})
"""What `statekv serve` imports from its extra (and what those import at once): one of them
missing means the `serve` extra is not installed, which the user fixes with pip."""
SERVE_EXTRA: Final = "pip install 'statekv[serve]'"


FIELD_SETTINGS: Final[dict[str, str]] = {
    "block_size": "block_size", "disk_dir": "disk_dir", "device": "device",
    "num_layers": "layers", "seed": "seed", "ttl_seconds": "ttl", "remote_url": "remote_url",
    "remote_namespace": "remote_namespace", "remote_secret": "remote_secret_file",
    "remote_password": "remote_password_file", "remote_tls_ca_file": "remote_tls_ca_file",
}
"""Configuration fields the settings set: a typed error naming one is reported with the flag
(or variable, or config key) the user set it with.  The pools' fields (`gpu`,
`gpu_blocks`...) name their pool's --POOL-size or --POOL-blocks."""


class UserMistake(Exception):
    """Raised by a subcommand for a mistake the user can fix: reported as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line: `prog: error: message (see prog --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------- flag value types


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value

    # serve/settings.py reads a config file's key as a TOML integer by this name.
    parse.__name__ = "integer"
    return parse


def _number(low: float, *, strict: bool, high: float | None = None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        too_low = value <= low if strict else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            bounds = f"{'>' if strict else '>='} {low:g}" + (
                "" if high is None else f" and <= {high:g}")
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text!r}")
        return value

    parse.__name__ = "number"  # a TOML integer or float (serve/settings.py)
    return parse


def _size(text: str) -> int:
    """A size in bytes with its unit (`8GiB`, `512MB`, `1.5TiB`): a bare number is refused,
    as it could as well be taken for blocks (the --*-blocks flags count those)."""
    from io_actors.config import size_in_bytes
    from statekv.errors import ConfigError

    hint = f"give a number and a unit: {SIZE_UNITS}; e.g. 8GiB"
    try:
        float(text)
    except ValueError:
        pass
    else:
        raise argparse.ArgumentTypeError(f"{text!r} has no unit ({hint}); a count of blocks "
                                         "goes to the --*-blocks flags")
    try:
        return size_in_bytes("size", text, hint=hint)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _directory(text: str) -> Path:
    """A directory to create files in: it may not exist yet, but must not be a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{str(parent)!r} is not a directory")
            break
    return path


def _output_file(text: str) -> Path:
    """A file to write: its directory must exist."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} does not exist")
    return path


def _model_name(text: str) -> str:
    """The name clients must send as `model`: an empty or padded one could never be matched
    by what a client types, and a control character would break the /metrics label."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name the model, got {text!r}")
    if text != text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError("must be printable, without leading or trailing "
                                         f"spaces, got {text!r}")
    return text


def _device(text: str) -> str:
    """StateKVConfig.device's names (whether this machine has it is checked at open)."""
    from io_actors.config import check_device_name
    from statekv.errors import ConfigError

    try:
        check_device_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


POOLS: Final = ("gpu", "host", "reserved_host", "disk")
"""The cache's pools: each sized by --POOL-blocks or --POOL-size (one of the two)."""


def _origin(args: argparse.Namespace) -> Origin:
    """Where each setting came from (serve: the flag, a variable or the config file)."""
    origin = getattr(args, "origin", None)
    return origin if isinstance(origin, Origin) else Origin()


def _pool_name(args: argparse.Namespace, pool: str) -> str:
    """The flag, variable or config key the user sized `pool` with (the blocks flag when
    neither was given: its default applied)."""
    dest = f"{pool}_size" if getattr(args, f"{pool}_size", None) is not None else f"{pool}_blocks"
    return _origin(args).name(dest)


def _pool_blocks(args: argparse.Namespace, tokens: dict[str, int]) -> dict[str, int]:
    """Every pool in blocks: --POOL-blocks as given, --POOL-size in whole blocks of this
    model's KV (rounding down), else `tokens[pool]` worth of blocks of --block-size."""
    block_size: int = args.block_size
    blocks: dict[str, int] = {}
    block_bytes: int | None = None
    for pool in POOLS:
        counted: int | None = getattr(args, f"{pool}_blocks")
        size: int | None = getattr(args, f"{pool}_size", None)
        if counted is not None and size is not None:  # serve/settings.py checked serve's
            flag = "--" + pool.replace("_", "-")
            raise UserMistake(f"{flag}-size and {flag}-blocks both size one pool: give one "
                              "of them")
        if size is None:
            blocks[pool] = -(-tokens[pool] // block_size) if counted is None else counted
            continue
        if block_bytes is None:
            block_bytes = kv_block_bytes(args.model, args.layers, block_size)
        blocks[pool] = size // block_bytes
        if blocks[pool] == 0 and (size > 0 or pool == "gpu"):
            # Rounding down to nothing is no pool: a mistake, not "disabled" (0B is that).
            raise UserMistake(f"{_argument(_pool_name(args, pool))}{_bytes(size)} holds no "
                              f"block: one block of {block_size} tokens of {args.model} "
                              f"is {_bytes(block_bytes)}")
    return blocks


def kv_block_bytes(model: str, layers: int | None, block_size: int) -> int:
    """Bytes of KV in one block of this model's cache: layers x 2 (K and V) x kv heads x
    head_dim x block_size x the dtype's size, as the server's pools are laid out."""
    from ._models import config

    return config.preset(model, num_layers=layers).kv_layout().block_bytes(block_size)


def _bytes(count: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.4g}{unit}"
    return f"{count}B"


def _argument(name: str) -> str:
    """A setting's name as an error starts with it: `argument --flag: `, or the variable or
    the config file's key as they are."""
    return f"argument {name}: " if name.startswith("--") else f"{name}: "


# ---------------------------------------------------------------------- the parser


LOG_LEVELS: Final = ("critical", "error", "warning", "info", "debug")
LIBRARY_LOGGERS: Final = ("statekv", "io_actors", "models", "serve", "statekv_models",
                          "statekv_serve")
"""The loggers of this package's code, under the names of a source tree and of an install
(`serve/` is `statekv_serve` installed); uvicorn's take the same level from run_server."""


def _add_log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", default=default, choices=LOG_LEVELS,
                   help=f"what statekv's own loggers (and the server's) print (default: "
                        f"{default})")


def configure_logging(level: str) -> None:
    """The one logging setup, at the entry point (library code never configures logging):
    records on stderr with their time, level and logger, statekv's at `level`."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())


def _add_cache_flags(p: argparse.ArgumentParser, *, gpu_tokens: int, host_tokens: int,
                     reserved_tokens: int, disk_tokens: int) -> None:
    """Model, device and cache budgets, shared by demo and serve."""
    p.add_argument("--model", default="tiny",
                   help="model shape: tiny, 1b-class, 8b-class or 70b-class (default: tiny)")
    p.add_argument("--layers", type=_int_at_least(1, 4096), default=None,
                   help="decoder layers (default: the model shape's own)")
    p.add_argument("--device", type=_device, default="auto",
                   help=f"{DEVICES}; auto picks CUDA when present (default: auto)")
    p.add_argument("--block-size", type=_int_at_least(1, 4096), default=16,
                   help="tokens per KV block (default: 16); the block counts below default "
                        "to the same number of tokens whatever the block size")
    p.add_argument("--gpu-blocks", type=_int_at_least(1), default=None,
                   help=f"GPU pool in blocks (default: {gpu_tokens} tokens' worth, "
                        f"{gpu_tokens // 16} blocks of 16)")
    p.add_argument("--host-blocks", type=_int_at_least(0), default=None,
                   help=f"pinned host pool in blocks (default: {host_tokens} tokens' worth, "
                        f"{host_tokens // 16} blocks of 16)")
    p.add_argument("--reserved-host-blocks", type=_int_at_least(0), default=None,
                   help="extra host pages for spills whose victims drain (default: "
                        f"{reserved_tokens} tokens' worth, {reserved_tokens // 16} blocks of "
                        "16)")
    p.add_argument("--disk-blocks", type=_int_at_least(0), default=None,
                   help=f"disk slots in blocks, 0 disables the disk tier (default: "
                        f"{disk_tokens} tokens' worth, {disk_tokens // 16} blocks of 16)")
    for pool, what in (("gpu", "GPU pool"), ("host", "pinned host pool"),
                       ("reserved-host", "reserved host pages"), ("disk", "disk tier")):
        p.add_argument(f"--{pool}-size", type=_size, default=None, metavar="SIZE",
                       help=f"the {what} in bytes with a unit ({SIZE_UNITS}), rounded "
                            f"down to whole blocks of the model's KV; instead of "
                            f"--{pool}-blocks (default: none, --{pool}-blocks applies)")
    p.add_argument("--disk-dir", type=_directory, default=None,
                   help="directory for slot files, created if missing (default: a temporary "
                        "directory, removed at the end)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="statekv", description="A correctness-first tiered KV cache "
                     "(GPU, pinned host, local disk) for LLM serving loops.")
    parser.add_argument("--version", action="version", version=f"statekv {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="run the multi-round chat demo with the disk tier on a temp dir",
        description="Multi-round chat on a small random-weight model, with budgets that force "
        "the disk tier; then the same workload on an unlimited GPU pool (identical tokens "
        "expected) and without reuse.")
    _add_cache_flags(demo, gpu_tokens=GPU_TOKENS, host_tokens=HOST_TOKENS,
                     reserved_tokens=RESERVED_HOST_TOKENS, disk_tokens=DISK_TOKENS)
    _add_log_level(demo, "warning")
    demo.add_argument("--users", type=_int_at_least(1), default=8,
                      help="chat users (default: 8)")
    demo.add_argument("--rounds", type=_int_at_least(1), default=4,
                      help="rounds per user (default: 4)")
    demo.add_argument("--system-tokens", type=_int_at_least(0), default=96,
                      help="tokens of the system prompt every user shares (default: 96)")
    demo.add_argument("--question-tokens", type=_int_at_least(1), default=24,
                      help="tokens of each new question (default: 24)")
    demo.add_argument("--answer-tokens", type=_int_at_least(1), default=16,
                      help="tokens generated per answer (default: 16)")
    demo.add_argument("--arrival-rate", type=_number(0, strict=True), default=40.0,
                      help="rounds arriving per second (default: 40)")
    demo.add_argument("--ttl", type=_number(0, strict=False), default=600.0,
                      help="retention TTL in seconds of the retained users (default: 600)")
    demo.add_argument("--retained-fraction", type=_number(0, strict=False, high=1),
                      default=0.5, help="fraction of users asking for the TTL (default: 0.5)")
    demo.add_argument("--seed", type=_int_at_least(0, 2**64 - 1), default=0,
                      help="seed of the workload and the weights (default: 0)")
    demo.add_argument("--trace", type=_output_file, default=None,
                      help="record every transition of the main run to this JSON Lines file "
                           "(default: no trace)")
    demo.add_argument("--no-identity", action="store_true",
                      help="skip the two comparison runs (default: run them)")
    demo.set_defaults(handler=_demo)

    serve = sub.add_parser(
        "serve", help="serve OpenAI-compatible completions and chat completions over HTTP",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models) over the continuous-batching loop, with Prometheus metrics at "
        "/metrics.  The model has random weights and a byte-level tokenizer.  It needs the "
        f"server's dependencies: {SERVE_EXTRA}.  Every flag is also an environment variable "
        "(--max-model-len: STATEKV_MAX_MODEL_LEN) and a key of the --config file "
        "(max_model_len); a flag beats the environment, which beats the file.")
    _add_cache_flags(serve, gpu_tokens=4 * GPU_TOKENS, host_tokens=4 * HOST_TOKENS,
                     reserved_tokens=RESERVED_HOST_TOKENS, disk_tokens=DISK_TOKENS)
    serve.add_argument("--config", type=Path, default=None, metavar="FILE",
                       help="a TOML file of settings, keys named as the long flags "
                            "(max_model_len = 4096); flags and STATEKV_* variables override "
                            "it (default: $STATEKV_CONFIG, else none)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_int_at_least(0, 65535), default=8000,
                       help="port to listen on, 0 for any free one (default: 8000)")
    serve.add_argument("--served-model-name", type=_model_name, default="statekv-tiny",
                       help="the model name clients send and see (default: statekv-tiny)")
    serve.add_argument("--max-model-len", type=_int_at_least(2), default=2048,
                       help="context length: prompt plus generated tokens (default: 2048, "
                            "and at most what the GPU pool holds)")
    serve.add_argument("--max-running", type=_int_at_least(1), default=64,
                       help="requests batched at once (default: 64)")
    serve.add_argument("--seed", type=_int_at_least(0, 2**64 - 1), default=0,
                       help="seed of the weights (default: 0)")
    serve.add_argument("--remote-url", default=None,
                       help="a Redis Cluster shared by every replica (specs/remote_tier.md): "
                            "redis://host:port[,redis://host:port...] (default: none)")
    serve.add_argument("--remote-namespace", default="statekv",
                       help="prefix of this deployment's keys in the cluster (default: "
                            "statekv)")
    serve.add_argument("--remote-secret-file", type=Path, default=None,
                       help="a file of 16-64 secret bytes, the same on every replica: every "
                            "shared value is signed with it (required with --remote-url; or "
                            "the environment variable STATEKV_REMOTE_SECRET, in hex; "
                            "default: none)")
    serve.add_argument("--remote-password-file", type=Path, default=None,
                       help="a file holding the cluster's AUTH password (or the environment "
                            "variable STATEKV_REMOTE_PASSWORD; default: none)")
    serve.add_argument("--remote-tls-ca-file", type=Path, default=None,
                       help="CA certificates for a rediss:// cluster (default: the system's)")
    serve.add_argument("--publish-on", choices=("release", "eviction"), default="release",
                       help="when content is offered to the shared tier: as soon as its "
                            "request is released, so another replica is served what this one "
                            "has just answered, or only when its GPU copy is evicted "
                            "(default: release)")
    serve.add_argument("--retention-write-through", choices=("on", "off"), default="on",
                       help="write what a request with kv_cache_ttl_seconds keeps to disk at "
                            "its release, so a crash after the write loses none of it; off: "
                            "on eviction, or at a clean stop (default: on)")
    _add_log_level(serve, "info")
    serve.set_defaults(handler=_serve)

    trace = sub.add_parser("trace", help="view or summarize a recorded state trace",
                           description="Look at a trace recorded by `statekv demo --trace` "
                           "or TraceRecorder.save_jsonl.")
    tsub = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    view = tsub.add_parser("view", help="write one self-contained HTML timeline")
    view.add_argument("trace", type=Path, help="a .jsonl trace (TraceRecorder.save_jsonl)")
    view.add_argument("-o", "--output", type=_output_file, default=None,
                      help="the HTML file to write (default: TRACE with .html)")
    view.add_argument("--title", default=None,
                      help="the page's title (default: 'statekv trace: ' and the file name)")
    summary = tsub.add_parser("summary", help="print counts, longest parks, slowest transfers")
    summary.add_argument("trace", type=Path, help="a .jsonl trace")
    summary.add_argument("--top", type=_int_at_least(1), default=10,
                         help="rows per table (default: 10)")
    perfetto = tsub.add_parser("perfetto", help="write Chrome trace-event JSON (Perfetto)")
    perfetto.add_argument("trace", type=Path, help="a .jsonl trace")
    perfetto.add_argument("-o", "--output", type=_output_file, default=None,
                          help="the JSON file to write (default: TRACE with .perfetto.json)")
    trace.set_defaults(handler=_trace)
    return parser


def _version() -> str:
    try:
        return metadata.version("statekv")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# ---------------------------------------------------------------------- subcommands


def _check_device(device: str) -> None:
    from io_actors.embed import check_device_present
    from statekv.errors import ConfigError

    try:
        check_device_present(device)
    except ConfigError as exc:
        raise UserMistake(f"argument --device: {exc.message}") from None


def _check_model(name: str) -> None:
    from ._models import config

    if name not in config.PRESETS:
        raise UserMistake(f"argument --model: unknown model shape {name!r} "
                          f"(known: {', '.join(config.PRESETS)})")


@contextmanager
def progress_bars() -> Iterator[Callable[[str, int], Callable[[int, int], None]] | None]:
    """Progress bars on stderr through rich, or None when stderr is not a terminal (a log
    gets no carriage-return updates)."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    except ModuleNotFoundError:
        # rich comes with the `serve` extra; the demo needs no bars to do its work, so
        # without it the command runs as it does into a log.
        yield None
        return

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    bars: Progress
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                  console=console) as bars:

        def bar(label: str, total: int) -> Callable[[int, int], None]:
            task = bars.add_task(label, total=total)

            def update(done: int, _total: int) -> None:
                bars.update(task, completed=done)

            return update

        yield bar


def _demo(args: argparse.Namespace) -> int:
    _check_device(args.device)
    _check_model(args.model)
    from ._models import chat_run, demo

    blocks = _pool_blocks(args, {"gpu": GPU_TOKENS, "host": HOST_TOKENS,
                                 "reserved_host": RESERVED_HOST_TOKENS, "disk": DISK_TOKENS})
    budgets = chat_run.Budgets(
        block_size=args.block_size, gpu_blocks=blocks["gpu"], host_blocks=blocks["host"],
        reserved_host_blocks=blocks["reserved_host"], disk_blocks=blocks["disk"],
    )
    options = demo.DemoOptions(
        model=args.model, layers=args.layers, device=args.device, users=args.users,
        rounds=args.rounds, system_tokens=args.system_tokens,
        question_tokens=args.question_tokens, answer_tokens=args.answer_tokens,
        arrival_rate=args.arrival_rate, ttl=args.ttl, retained_fraction=args.retained_fraction,
        budgets=budgets, disk_dir=args.disk_dir, seed=args.seed, trace=args.trace,
        identity=not args.no_identity,
    )
    try:
        with progress_bars() as bars:
            return demo.run(options, progress=bars)
    except UsageError as exc:
        if exc.field == "prompt":  # the serving loop: a request larger than the GPU pool
            raise UserMistake(f"{_argument(_pool_name(args, 'gpu'))}{budgets.gpu_blocks} "
                              f"blocks of {budgets.block_size} tokens are too few: {exc}"
                              ) from None
        raise


def _read_secret_file(path: Path, name: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserMistake(f"{_argument(name)}cannot read {path}: {exc.strerror or exc}"
                          ) from None


def _remote_secret(args: argparse.Namespace) -> bytes | None:
    """The shared tier's secret: the file's bytes (a trailing newline dropped), else the
    hex string of STATEKV_REMOTE_SECRET (serve/settings.py read it).  Never printed."""
    if args.remote_secret_file is not None:
        name = _origin(args).name("remote_secret_file")
        return _read_secret_file(args.remote_secret_file, name).rstrip(b"\n")
    secret: bytes | None = args.remote_secret
    return secret


def _remote_password(args: argparse.Namespace) -> str | None:
    if args.remote_password_file is not None:
        name = _origin(args).name("remote_password_file")
        raw = _read_secret_file(args.remote_password_file, name)
        try:
            return raw.decode().rstrip("\n")
        except UnicodeDecodeError:
            raise UserMistake(f"{_argument(name)}the password must be UTF-8 text") from None
    password: str | None = args.remote_password
    return password


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server import run_server
    except ModuleNotFoundError as exc:
        # The library installs without the server's dependencies: say which extra brings
        # them rather than show the import's traceback.  Any other missing module is not
        # the extra's, and keeps its traceback.
        missing = (exc.name or "").partition(".")[0]
        if missing not in SERVER_MODULES:
            raise
        raise UserMistake(f"the server needs {missing}, which is not installed: "
                          f"{SERVE_EXTRA}") from None
    _check_device(args.device)
    _check_model(args.model)

    options = server_options(args)
    listener = _listen(args)
    host, port = listener.getsockname()[:2]

    def announce() -> None:
        print(f"statekv serve: {args.served_model_name} ({args.model}) on http://{host}:{port}"
              f"/v1, metrics at /metrics; {_pools(options)}; Ctrl-C stops", flush=True)

    with listener:
        run_server(options, listener, log_level=args.log_level, on_ready=announce)
    return 0


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The server's options record from the settings, every check of the command made (the
    server's dependencies imported already)."""
    from .server import ServerOptions

    blocks = _pool_blocks(args, {"gpu": 4 * GPU_TOKENS, "host": 4 * HOST_TOKENS,
                                 "reserved_host": RESERVED_HOST_TOKENS, "disk": DISK_TOKENS})
    capacity = blocks["gpu"] * args.block_size
    if capacity < args.max_model_len:
        # The serving loop keeps a running request's every token on the GPU: a prompt of
        # --max-model-len tokens could never run, and would be refused only once sent.
        gpu = _pool_name(args, "gpu")
        max_len = _origin(args).name("max_model_len")
        size = "" if args.gpu_size is None else f"{_bytes(args.gpu_size)} is "
        raise UserMistake(f"{_argument(gpu)}{size}{blocks['gpu']} blocks of {args.block_size} "
                          f"tokens, which hold {capacity} tokens, fewer than {max_len} "
                          f"{args.max_model_len}: raise {gpu} or lower {max_len}")
    return ServerOptions(
        model=args.model, layers=args.layers, device=args.device, seed=args.seed,
        block_size=args.block_size, gpu_blocks=blocks["gpu"], host_blocks=blocks["host"],
        reserved_host_blocks=blocks["reserved_host"], disk_blocks=blocks["disk"],
        disk_dir=args.disk_dir, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, max_running=args.max_running,
        remote_url=args.remote_url, remote_namespace=args.remote_namespace,
        remote_secret=_remote_secret(args), remote_password=_remote_password(args),
        remote_tls_ca_file=args.remote_tls_ca_file, publish_on=args.publish_on,
        retention_write_through=args.retention_write_through == "on",
    )


def _pools(options: ServerOptions) -> str:
    return (f"GPU {options.gpu_blocks} blocks, host {options.host_blocks}+"
            f"{options.reserved_host_blocks}, disk {options.disk_blocks} blocks of "
            f"{options.block_size} tokens")


def _listen(args: argparse.Namespace) -> socket.socket:
    try:
        listener = socket.create_server((args.host, args.port))
    except OSError as exc:
        # An address that does not resolve or is not this machine's is the host's fault; a
        # port in use or reserved is the port's.
        # (create_server re-raises a resolver error as a plain OSError: its EAI_* numbers
        # are negative.)
        host_fault = isinstance(exc, socket.gaierror) or exc.errno in (
            errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or (exc.errno or 0) < 0
        flag = "--host" if host_fault else "--port"
        raise UserMistake(f"argument {flag}: cannot listen on {args.host}:{args.port}: "
                          f"{exc.strerror or exc}") from None
    return listener


def _trace(args: argparse.Namespace) -> int:
    from io_actors.tracing.recorder import load_trace, write_chrome_trace
    from io_actors.tracing.tools import summarize, write_html

    trace = load_trace(args.trace)
    try:
        if args.trace_command == "view":
            out = write_html(trace, args.output or args.trace.with_suffix(".html"),
                             title=args.title or f"statekv trace: {args.trace.name}")
            print(f"wrote {out} ({len(trace.records)} records); open it in a browser")
        elif args.trace_command == "summary":
            summarize(trace, top=args.top)
        else:
            out = write_chrome_trace(
                trace, args.output or args.trace.with_suffix(".perfetto.json"))
            print(f"wrote {out}; open it at https://ui.perfetto.dev or chrome://tracing")
    except BrokenPipeError:
        raise  # the reader of stdout went away: main() ends quietly
    except OSError as exc:
        raise UserMistake(f"cannot write {exc.filename}: {exc.strerror or exc}") from None
    return 0


# ---------------------------------------------------------------------- the entry point


def _field_name(args: argparse.Namespace, field: str) -> str | None:
    """The flag, variable or config key the user set a configuration `field` with."""
    pool = field.removesuffix("_blocks")
    if pool in POOLS:
        return _pool_name(args, pool)
    dest = FIELD_SETTINGS.get(field)
    if dest is None:
        return None
    secret = dest.removesuffix("_file")
    if dest != secret and getattr(args, dest, None) is None and getattr(args, secret, None):
        return _origin(args).name(secret)  # the secret came from its variable
    return _origin(args).name(dest)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand of `parser` (build_parser's)."""
    action = _subparsers(parser)
    if action is None:
        raise LookupError(f"no subcommand {name!r}")
    found: argparse.ArgumentParser = action.choices[name]
    return found


def _chosen_parser(parser: argparse.ArgumentParser,
                   args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand `args` chose: `statekv trace view`'s for
    ``statekv trace view ...``."""
    while (action := _subparsers(parser)) is not None \
            and (name := getattr(args, action.dest, None)) is not None:
        parser = subcommand(parser, name)
    return parser


def _resolve_serve(parser: argparse.ArgumentParser, argv: Sequence[str],
                   args: argparse.Namespace) -> argparse.Namespace:
    """serve's settings completed from the environment and the config file (read here, the
    one place that reads the environment)."""
    resolved, origin, warnings = resolve(parser, subcommand(parser, "serve"), argv, args,
                                         os.environ)
    for warning in warnings:
        print(f"statekv serve: warning: {warning}", file=sys.stderr)
    resolved.origin = origin
    return resolved



def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args, unknown = parser.parse_known_args(argv_list)
        if unknown:
            # argparse would report them as the top-level command's; they were given to
            # the subcommand, whose --help lists what it takes.
            _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, --version, or a bad flag (already reported)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    prog = f"statekv {args.command}"
    if args.command == "serve":
        try:
            args = _resolve_serve(parser, argv_list, args)
        except SettingError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    configure_logging(getattr(args, "log_level", "warning"))
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader went away (`statekv trace summary F | head`): stop quietly, as a
        # process that SIGPIPE ends does, and keep Python from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except InvariantViolation:
        raise  # statekv's own bug: the traceback is the report
    except (UserMistake, StateKVError) as exc:
        name = _field_name(args, getattr(exc, "field", ""))
        where = _argument(name) if name is not None else ""
        print(f"{prog}: error: {where}{exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
