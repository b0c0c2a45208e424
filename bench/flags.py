"""The benchmarks' command-line flag types: a bad value is one line naming the flag."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

from models.config import PRESETS

T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line: `prog: error: message (see prog --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def shape_preset(text: str) -> str:
    """A layer shape of models/config.py's presets."""
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown shape {text!r} (known: {sorted(PRESETS)})")
    return text


def device_name(text: str) -> str:
    """A device the cache can run on, present on this machine: "auto", "cpu", "cuda" or
    "cuda:N" (StateKVConfig.device's names).  No CUDA context is made here: a parent
    process that only starts replicas never holds one."""
    import torch

    from io_actors.config import check_device_name
    from io_actors.embed import check_device_present
    from statekv.errors import ConfigError

    try:
        check_device_name(text)
        check_device_present(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if text.startswith("cuda:") and int(text[len("cuda:"):]) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"no GPU {text}: torch sees {torch.cuda.device_count()}")
    return text


def results_tag(text: str) -> str:
    """A tag that is safe inside a results file's name."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise argparse.ArgumentTypeError(
            f"must be 1 to 64 letters, digits, '.', '_' or '-', got {text!r}")
    return text


def comma_list(item: Callable[[str], T], *, what: str = "a comma-separated list",
               distinct: bool = True) -> Callable[[str], list[T]]:
    """A flag type: comma-separated values, each parsed by `item`, in the order given;
    empty parts are refused ("must be `what`"), and with `distinct` a value given twice."""

    def parse(text: str) -> list[T]:
        parts = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in parts):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        values = [item(t) for t in parts]
        if distinct and len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"a value is given twice in {text!r}")
        return values

    return parse


def _finite_number(text: str, *, zero: bool) -> float:
    """A finite number > 0, or >= 0 with `zero`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(
            f"must be a finite number {'>=' if zero else '>'} 0, got {text!r}")
    return value


def positive_number(text: str) -> float:
    return _finite_number(text, zero=False)


def non_negative_number(text: str) -> float:
    return _finite_number(text, zero=True)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def existing_directory(text: str) -> Path:
    """A directory that exists already (a benchmark makes its own scratch space inside)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory" if path.exists() else f"{text!r} does not exist")
    return path
