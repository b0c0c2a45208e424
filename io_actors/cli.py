"""The `statekv` command.

    statekv demo [options]            the serving-loop demo (see `statekv demo --help`)
    statekv trace view TRACE [-o F]   one self-contained HTML timeline of a recorded trace
    statekv trace summary TRACE       counts by transition, longest parks, slowest transfers
    statekv trace perfetto TRACE      the trace in Chrome trace-event format (Perfetto)

Command-line flags are read here, once, into configuration records; nothing deeper reads the
command line or the environment.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import cast


def _delegate(module: str, function: str = "main") -> Callable[[list[str]], int]:
    """A subcommand implemented elsewhere, imported only when it runs (the demo pulls in the
    model; the trace tools do not need torch)."""

    def run(argv: list[str]) -> int:
        target = getattr(importlib.import_module(module), function)
        return cast(int, target(argv))

    return run


COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "demo": ("run the multi-round chat demo with the disk tier on a temp dir",
             _delegate("statekv_models.demo")),
    "trace": ("view or summarize a recorded state trace", _delegate("io_actors.trace_tools")),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        width = max(len(name) for name in COMMANDS)
        print("usage: statekv COMMAND [options]\n\ncommands:")
        for name, (help_text, _run) in COMMANDS.items():
            print(f"  {name:<{width}}  {help_text}")
        if args and args[0] not in ("-h", "--help"):
            print(f"\nunknown command {args[0]!r}", file=sys.stderr)
            return 2
        return 0
    _help, run = COMMANDS[args[0]]
    return run(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
