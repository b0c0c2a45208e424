"""Watching the real core inside the running system, and making the model follow it.

The scheduler owns its :class:`~statekv.KVCacheManager` and calls it under its lock, from the
serving loop's thread (API calls) and from the trio thread (completions).  :class:`CoreSpy`
wraps those methods on the one manager instance, so that every call -- its arguments, its
time, its result or the error it raised, and the commands the scheduler then took -- is
logged in exactly the order the core executed it.  Nothing else changes: the wrapped call is
the real call.

:class:`ModelFollower` replays that log into the reference model (``specs/``) and checks,
call by call, that the model succeeds or fails alike, matches the same prefixes, and emits
the same commands; it feeds the commands and completions to the command contract
(:mod:`fuzz.contract`).  Afterwards every counter of ``statistics()`` and every cached block
can be compared, because both sides have seen the same calls in the same order.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs

from fuzz.contract import CommandContract
from fuzz.steps import Counts
from specs.reference_model import CommandKind, ReferenceCache, in_batches
from statekv.errors import OutOfBlocks, UsageError
from statekv.manager import KVCacheManager, PrefetchStarted, PrefixMatch
from statekv.messages import (
    Command,
    Completion,
    FetchBlocks,
    PrefetchSlots,
    ReadSlots,
    SlotRead,
    SlotWriteFailed,
    SlotWritten,
    WriteSlots,
    outcomes,
)

SPIED = ("add_request", "append_tokens", "allocate_nowait", "commit", "release", "handle",
         "take_commands", "prefetch", "report_disk_read", "report_prefill",
         "stop_write_through_retries")
"""The manager methods whose calls change its state or report what it asked for."""


@attrs.frozen
class Call:
    """One call the scheduler made on the core."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any
    error: BaseException | None


class CoreSpy:
    """Logs every state-changing call on `core`, in execution order.

    `on_commands` sees each batch of commands as the scheduler takes it, before any of them
    is executed (the harness assigns faults to transfers there); `notify` is called after
    each completion is applied.
    """

    def __init__(
        self,
        core: KVCacheManager,
        *,
        on_commands: Callable[[list[Command]], None] = lambda _cmds: None,
        notify: Callable[[], None] = lambda: None,
    ) -> None:
        self.core = core
        self.log: collections.deque[Call] = collections.deque()
        self.applied = 0
        """Completions the core has applied."""
        self._on_commands = on_commands
        self._notify = notify
        for name in SPIED:
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        original: Callable[..., Any] = getattr(self.core, name)
        log = self.log

        def spied(*args: Any, **kwargs: Any) -> Any:
            # Token lists are copied: the caller may reuse its list after the call.
            logged = tuple(list(a) if isinstance(a, list) else a for a in args)
            try:
                result = original(*args, **kwargs)
            except (OutOfBlocks, UsageError) as exc:
                log.append(Call(name, logged, kwargs, None, exc))
                raise
            log.append(Call(name, logged, kwargs, result, None))
            if name == "take_commands" and result:
                self._on_commands(result)
            elif name == "handle":
                self.applied += 1
                self._notify()
            return result

        # An instance attribute shadows the method for this one manager only.
        setattr(self.core, name, spied)


def command_kinds(commands: list[Command]) -> list[CommandKind]:
    """What the model's commands can be compared on (reference_model.in_batches): kinds, and
    the keys of each disk batch."""
    kinds: list[CommandKind] = []
    for c in commands:
        if isinstance(c, WriteSlots):
            kinds.append(("WriteSlots", tuple(w.key for w in c.writes)))
        elif isinstance(c, ReadSlots):
            kinds.append(("ReadSlots", tuple(r.key for r in c.reads)))
        elif isinstance(c, PrefetchSlots):
            kinds.append(("PrefetchSlots", tuple(r.key for r in c.reads)))
        elif isinstance(c, FetchBlocks):
            kinds.append(("FetchBlocks", tuple(r.key for r in c.reads)))
        else:
            kinds.append((type(c).__name__, None))
    return kinds


class ModelFollower:
    """Replays a :class:`CoreSpy` log into the reference model, checking as it goes."""

    def __init__(self, model: ReferenceCache, contract: CommandContract) -> None:
        self.model = model
        self.contract = contract
        self.completions: list[Completion] = []
        """Every completion applied, in order."""

    def follow(self, log: collections.deque[Call]) -> None:
        """Apply and check every call logged so far."""
        while log:
            self.apply(log.popleft())

    def apply(self, call: Call) -> None:
        model = self.model
        if call.name != "take_commands":
            Counts.operations += 1
        if call.name == "take_commands":
            real = command_kinds(call.result)
            expected = in_batches(model.commands, model.cfg.max_batch_blocks)
            model.commands = []
            assert real == expected, f"commands differ: real {real}, model {expected}"
            self.contract.commands(call.result)
            return
        if call.name == "handle":
            completion: Completion = call.args[0]
            self._run(call, lambda: self._complete(completion, call.kwargs["now"]))
            if call.error is None:
                self.contract.completion(completion)
                self.completions.append(completion)
            return
        method: Callable[..., Any] = getattr(model, call.name)
        result = self._run(call, lambda: method(*call.args, **call.kwargs))
        if call.name == "add_request" and call.error is None:
            got: PrefixMatch = call.result
            assert (got.matched_tokens, got.gpu_tokens, got.host_tokens, got.disk_tokens,
                    got.ready, got.skipped_disk_tokens) == (
                result.matched_tokens, result.gpu_tokens, result.host_tokens,
                result.disk_tokens, result.ready, result.skipped_disk_tokens), (
                f"{call.args[0]}: real matched {got}, the model {result}"
            )
        if call.name == "prefetch" and call.error is None:
            started: PrefetchStarted = call.result
            assert (started.started_tokens, started.shared_tokens, started.cached_tokens,
                    started.unfetched_tokens) == result, (
                f"{call.args[0]}: real prefetch {started}, the model {result}"
            )

    def _complete(self, completion: Completion, now: float) -> None:
        """A batch is its outcomes, applied in order at one time."""
        for outcome in outcomes(completion):
            tid = outcome.transfer
            if isinstance(outcome, SlotWritten | SlotWriteFailed):
                self.model.write_done(tid, isinstance(outcome, SlotWritten), now)
            else:
                self.model.read_done(tid, isinstance(outcome, SlotRead), now)

    @staticmethod
    def _run(call: Call, op: Callable[[], Any]) -> Any:
        """Run the model's side of `call`: it must fail exactly when the real call failed."""
        if call.error is None:
            return op()
        try:
            op()
        except type(call.error):
            return None
        raise AssertionError(f"real {call.name}{call.args} raised {call.error!r}, "
                             "the model did not")
