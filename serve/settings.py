"""`statekv serve`'s settings from four places: command-line flag > environment > config file
> default.

Every setting is a long flag of ``statekv serve``; its config-file key is the flag's name with
underscores (``--max-model-len`` -> ``max_model_len``) and its environment variable that key
in capitals after ``STATEKV_`` (``STATEKV_MAX_MODEL_LEN``).  Values from the file and the
environment go through the flag's own parser, so each is checked exactly as on the command
line, and a mistake names where the value came from (the file and the key, or the variable).
Everything is read and checked before the command starts anything.

The environment is handed in by the entry point (serve/cli.py), which reads it once; nothing
here or below reads it on its own.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

ENV_PREFIX: Final = "STATEKV_"
CONFIG_VARIABLE: Final = "STATEKV_CONFIG"
"""The config file when --config is not given."""
SECRET_VARIABLES: Final[dict[str, str]] = {
    "STATEKV_REMOTE_SECRET": "remote_secret",
    "STATEKV_REMOTE_PASSWORD": "remote_password",
}
"""Secrets given as values rather than files (the hex secret, the cluster's password): only
the environment carries them, never a flag (visible in `ps`) or the config file (often
readable by more people than the secret should be).  Their values never appear in a
message."""
OTHER_VARIABLES: Final = frozenset({"STATEKV_FUZZ_PROFILE", "STATEKV_TEST_DEVICE"})
"""STATEKV_ variables of the project's test and fuzz tooling: not settings, not mistakes."""
ALTERNATIVES: Final[dict[tuple[str, ...], str]] = {
    ("gpu_size", "gpu_blocks"): "the GPU pool", ("host_size", "host_blocks"): "the host pool",
    ("reserved_host_size", "reserved_host_blocks"): "the reserved host pages",
    ("disk_size", "disk_blocks"): "the disk tier",
    ("remote_secret_file", "remote_secret"): "the shared tier's secret",
    ("remote_password_file", "remote_password"): "the cluster's password",
}
"""Pairs of settings that say one thing two ways (a pool in bytes or in blocks, a secret in
a file or in a variable): one place giving both is a mistake; a place of higher precedence
giving either replaces what a lower one gave with either."""
NOT_SETTINGS: Final = frozenset({"help", "config"})
"""Flags of `statekv serve` that are no setting (--config names the file itself)."""


class SettingError(Exception):
    """A setting the user got wrong: the message names where it came from."""


class Origin(dict[str, str]):
    """Where each setting's value came from, by dest: `--gpu-size`, `STATEKV_GPU_SIZE`,
    `FILE: gpu_size`, or (for a default) the flag."""

    def name(self, dest: str) -> str:
        return self.get(dest, flag_of(dest))


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def variable_of(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def settings_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's settings by dest (long flags only: each has one)."""
    return {action.dest: action for action in parser._actions
            if action.option_strings and action.dest not in NOT_SETTINGS}


def _given(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser,
           argv: Sequence[str]) -> set[str]:
    """The dests of `sub` that `argv` sets on the command line (a value equal to the default
    included), found by parsing again with no defaults.  `argv` parsed once already."""
    saved = [(action, action.default) for action in sub._actions]
    try:
        for action, _default in saved:
            action.default = argparse.SUPPRESS
        given = vars(parser.parse_args(list(argv)))
    finally:
        for action, default in saved:
            action.default = default
    return set(given) & set(settings_of(sub))


def _check(action: argparse.Action, text: str) -> object:
    """`text` through the flag's own parser and choices (ValueError with its message)."""
    value: object = text
    if action.type is not None:
        try:
            value = action.type(text)  # type: ignore[operator]
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        except (TypeError, ValueError):
            raise ValueError(f"invalid value {text!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}, got "
                         f"{text!r}")
    return value


def _kind(action: argparse.Action) -> tuple[type, ...]:
    """The TOML types a key takes: the flag's parser says (cli.py names its number parsers
    `integer` and `number`); everything else is text."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return (bool,)
    name = getattr(action.type, "__name__", "")
    if name == "integer":
        return (int,)
    if name == "number":
        return (int, float)
    return (str,)


_KIND_NAMES: Final = {(bool,): "true or false", (int,): "an integer",
                      (int, float): "a number", (str,): "a string"}


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def read_file(path: Path, actions: Mapping[str, argparse.Action]) -> dict[str, object]:
    """The settings of a TOML file, each checked by its flag's parser."""
    try:
        with path.open("rb") as file:
            table = tomllib.load(file)
    except OSError as exc:
        raise SettingError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SettingError(f"{path}: not a TOML file (it is not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingError(f"{path}: not valid TOML: {exc}") from None
    values: dict[str, object] = {}
    for key, raw in table.items():
        where = f"{path}: {key}"
        action = actions.get(key)
        if action is None:
            if key in SECRET_VARIABLES.values():
                raise SettingError(f"{where}: a secret is not a setting of the file: name a "
                                   f"file holding it ({key}_file), or set "
                                   f"{variable_of(key)}")
            raise SettingError(f"{where}: unknown setting{_suggest(key, actions)}")
        kind = _kind(action)
        # bool is an int to Python, never to a TOML reader's eyes.
        if not isinstance(raw, kind) or (isinstance(raw, bool) and bool not in kind):
            got = "a table" if isinstance(raw, dict) else f"{raw!r}"
            raise SettingError(f"{where}: must be {_KIND_NAMES[kind]}, got {got}")
        if isinstance(raw, bool):
            values[key] = raw
            continue
        try:
            values[key] = _check(action, raw if isinstance(raw, str) else str(raw))
        except ValueError as exc:
            raise SettingError(f"{where}: {exc}") from None
    return values


def read_environment(variables: Mapping[str, str], actions: Mapping[str, argparse.Action]
                     ) -> tuple[dict[str, object], list[str]]:
    """The settings of the STATEKV_ variables, each checked by its flag's parser; and the
    warnings to print, one line each, for STATEKV_ variables that are no setting."""
    values: dict[str, object] = {}
    warnings: list[str] = []
    known = {variable_of(dest) for dest in actions} | set(SECRET_VARIABLES) | {CONFIG_VARIABLE}
    for name in sorted(variables):
        if not name.startswith(ENV_PREFIX) or name in OTHER_VARIABLES or name == CONFIG_VARIABLE:
            continue
        text = variables[name]
        if name in SECRET_VARIABLES:
            values[SECRET_VARIABLES[name]] = _secret(name, text)
            continue
        dest = name.removeprefix(ENV_PREFIX).lower()
        action = actions.get(dest)
        if action is None or name != variable_of(dest):
            # Compared without the prefix, which every name shares (STATEKV_gpu_size is a
            # typo too).
            hint = _suggest(name.upper().removeprefix(ENV_PREFIX),
                            [k.removeprefix(ENV_PREFIX) for k in known])
            hint = hint.replace("mean ", f"mean {ENV_PREFIX}")
            if hint:
                # A misspelt setting would be a setting silently not applied: refused.
                raise SettingError(f"{name} is not a setting of statekv serve{hint}")
            warnings.append(f"{name} is not a setting of statekv serve; ignored")
            continue
        if not action.option_strings or _kind(action) == (bool,):
            raise SettingError(f"{name}: not a setting of the environment")
        try:
            values[dest] = _check(action, text)
        except ValueError as exc:
            raise SettingError(f"{name}: {exc}") from None
    return values, warnings


def _secret(name: str, text: str) -> bytes | str:
    """A secret variable's value, checked without ever repeating it."""
    if name == "STATEKV_REMOTE_SECRET":
        try:
            return bytes.fromhex(text.strip())
        except ValueError:
            raise SettingError(f"{name} must be hex (e.g. `openssl rand -hex 32`)") from None
    if not text:
        raise SettingError(f"{name} is empty: unset it, or give the password")
    return text


def resolve(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser,
            argv: Sequence[str], args: argparse.Namespace, variables: Mapping[str, str]
            ) -> tuple[argparse.Namespace, Origin, list[str]]:
    """`args` (argv parsed by `parser`, whose subcommand `sub` it ran) with every setting
    that argv does not give taken from the environment, else the config file, else left at
    its default.  Returns the settings, where each came from, and warnings to print."""
    actions = settings_of(sub)
    given = _given(parser, sub, argv)
    env, warnings = read_environment(variables, actions)
    config: Path | None = args.config
    config_origin = "--config"
    if config is None and CONFIG_VARIABLE in variables:
        config = Path(variables[CONFIG_VARIABLE])
        config_origin = CONFIG_VARIABLE
        if not variables[CONFIG_VARIABLE]:
            raise SettingError(f"{CONFIG_VARIABLE} is empty: unset it, or name a file")
    try:
        from_file = read_file(config, actions) if config is not None else {}
    except SettingError as exc:
        message = str(exc)
        if config_origin != "--config":
            message = message.replace("--config ", f"{CONFIG_VARIABLE}=", 1)
        raise SettingError(message) from None

    cli = {dest: getattr(args, dest) for dest in given}
    sources: list[tuple[dict[str, object], Origin]] = [
        (cli, Origin({dest: flag_of(dest) for dest in cli})),
        (env, Origin({dest: variable_of(dest) if dest not in SECRET_VARIABLES.values()
                      else _secret_variable(dest) for dest in env})),
        (from_file, Origin({dest: f"{config}: {dest}" for dest in from_file})),
    ]
    chosen: dict[str, object] = {}
    origin = Origin()
    pairs: dict[str, tuple[str, ...]] = {dest: pair for pair in ALTERNATIVES for dest in pair}
    done: set[str] = set()
    for dest in [*actions, *SECRET_VARIABLES.values()]:
        if dest in done:
            continue
        group = pairs.get(dest, (dest,))
        done.update(group)
        for values, names in sources:
            present = [d for d in group if d in values]
            if len(present) > 1:
                first, second = (names.name(d) for d in present)
                raise SettingError(f"{first} and {second} both give "
                                   f"{ALTERNATIVES[group]}: give one of them")
            if present:
                chosen[present[0]] = values[present[0]]
                origin[present[0]] = names.name(present[0])
                for other in group:
                    if other != present[0]:
                        chosen[other] = None
                break
    resolved = argparse.Namespace(**vars(args))
    for dest in SECRET_VARIABLES.values():
        setattr(resolved, dest, None)
    for dest, value in chosen.items():
        setattr(resolved, dest, value)
    return resolved, origin, warnings


def _secret_variable(dest: str) -> str:
    return next(name for name, d in SECRET_VARIABLES.items() if d == dest)
