"""Rule decorator that counts steps and examples, for the steps/s the runners report."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from hypothesis import event
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import rule
from hypothesis.strategies import SearchStrategy

F = TypeVar("F", bound=Callable[..., None])


class Counts:
    """Rule steps and state-machine examples run in this process (all machines)."""

    steps = 0
    examples = 0
    operations = 0
    """Calls on the core (API calls and completions) checked against the model."""


def fuzz_rule(**strategies: SearchStrategy[Any]) -> Callable[[F], F]:
    """``hypothesis.stateful.rule`` that also counts each step it runs."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> None:
            Counts.steps += 1
            fn(*args, **kwargs)

        # `rule` is overloaded on its bundle arguments, which these rules never use.
        make_rule = cast(Callable[..., Callable[[Callable[..., None]], Any]], rule)
        return cast(F, make_rule(**strategies)(counted))

    return decorate


def note(text: str) -> None:
    """``hypothesis.event`` inside a test; nothing when a rule runs outside one (a
    regression test calling rules directly, or a reproduction script)."""
    if currently_in_test_context():
        event(text)
