"""Tensor-parallel ranks that agree: one cache per rank, decisions identical on every rank.

Under tensor parallelism every rank runs the same forward pass over its share of the heads,
so every rank must schedule exactly the same batch at every step, or the model's all-reduce
mismatches (a hang or a crash).  Each rank holds its own KV shard -- its own pools, its own
slot directory ``<disk_dir>/<namespace>/rank_<global rank>``, one process per rank -- and
the caches must take identical decisions.  Three things could make them diverge, and each is
agreed through ``torch.distributed``:

* **The clock.**  Retention deadlines are stamped and checked against a clock; ranks' wall
  clocks differ.  Rank 0's time is carried by the one collective of each step, and every
  rank's cache uses that agreed time (never running backwards) for every decision.
* **Completions.**  A disk read or write lands at a different moment on each rank.  Applying
  it when it lands would let a request be ready on one rank and parked on another, and --
  subtler -- would let the next request match a block that is on GPU on one rank and still
  onboarding on another (a different prefix hit, a different batch).  So every completion
  is held at the cache's completion gate until it has landed on *every* rank, and the
  agreed ones are applied at the same point of the step on every rank, in transfer order
  (which is the same on every rank: transfer ids come from identical decisions).  A transfer
  that failed on any rank is applied as failed on all of them (the others' bytes are never
  published; the request recomputes everywhere).  A request is therefore admitted only when
  its blocks landed on every rank, and the prefix trees never diverge.
* **The exchange is cheap.**  Each step runs one all-reduce of three numbers: rank 0's time
  and the count of transfers in flight (which every rank must report equally, or the ranks
  already diverged: an error on all of them, never a hang).  Only when some transfer is in
  flight does a second all-reduce exchange, per transfer, "landed here?" and "failed here?".
  Without a disk tier there is no transfer, no gate and no collective per step at all; with
  one rank, nothing is exchanged either.

The agreement messages are CPU metadata: they go over a gloo group of their own, whatever
the model's backend (NCCL on GPUs), so they never wait behind GPU work, and gloo's timeouts
raise in the caller.  A rank that died or hangs turns into :class:`RankGroupFailed` on the
others (at once when its sockets close, after ``timeout_s`` when it hangs), after which the
group refuses further collectives and the cache closes without waiting on the dead rank.

Configurations the design cannot keep in lockstep are refused at start, on every rank,
with a ConfigError naming the field: pipeline parallelism (stages see different batches),
attention data parallelism (ranks schedule different requests), data-parallel replicas in
one group, a tensor-parallel size other than the world size, or caches whose configuration
differs across ranks.  Each rank validates locally, then all ranks exchange the outcome
before going further, so one rank's refusal is every rank's refusal -- nobody is left
waiting in a collective.

Use with the serving loop::

    dist.init_process_group("nccl")                       # or gloo on CPUs
    with RankGroup(ParallelLayout(tensor_parallel=dist.get_world_size())) as group, \\
         TensorParallelCache(config, group) as tp:
        model = PagedDecoder(mc, tp_rank=group.rank, tp_size=group.world_size,
                             all_reduce=group.model_all_reduce, device=...)
        loop = ServingLoop(model, tp.cache, clock=tp.clock,
                           ready_everywhere=tp.ready_everywhere)

A speculative-decoding draft model's cache is a second TensorParallelCache on the same
group with another namespace (:func:`draft_config`): the two never share slot files.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
import trio

from io_actors.actors.scheduler import CloseReport, WallClock
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.storage.interfaces import SlotStore
from statekv.config import KVLayout
from statekv.errors import ConfigError, InvariantViolation, StateKVError, UsageError
from statekv.ids import TransferId
from statekv.messages import (
    BatchFinished,
    Completion,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
    outcomes,
)
from statekv.trace import TraceSink

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 120.0
"""How long a collective may wait for the other ranks before the group is declared failed.
Generous: a step can legitimately wait on a slow rank's forward pass."""

_FAILED_ELSEWHERE: Final = (
    "the transfer failed on another tensor-parallel rank; every rank treats it as failed"
)


class RankGroupFailed(StateKVError):
    """A collective failed: a rank died, hung past the timeout, or left.  The group refuses
    every later collective; close the caches (they do not wait on the other ranks)."""


# ---------------------------------------------------------------------------- the layout


def _int_at_least_one(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(attribute.name, f"must be an integer >= 1, got {value!r}")


def _bool(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be True or False, got {value!r}")


@attrs.frozen(kw_only=True)
class ParallelLayout:
    """How the serving engine splits the model across the processes of torch.distributed."""

    tensor_parallel: int = attrs.field(validator=_int_at_least_one)
    pipeline_parallel: int = attrs.field(default=1, validator=_int_at_least_one)
    data_parallel: int = attrs.field(default=1, validator=_int_at_least_one)
    """Independent replicas sharing one torch.distributed world."""
    attention_dp: bool = attrs.field(default=False, validator=_bool)
    """Attention data parallelism: each rank runs attention for requests of its own."""

    def check(self, world_size: int) -> None:
        """Raise ConfigError naming the field unless the cache's agreement supports this."""
        if self.pipeline_parallel != 1:
            raise ConfigError(
                "pipeline_parallel",
                f"is {self.pipeline_parallel}; only 1 is supported: pipeline stages run "
                "different batches at a time, so a per-step agreement across them would wait "
                "forever",
            )
        if self.attention_dp:
            raise ConfigError(
                "attention_dp",
                "is not supported: with attention data parallelism each rank schedules its own "
                "requests, so ranks have no common batch to agree on",
            )
        if self.data_parallel != 1:
            raise ConfigError(
                "data_parallel",
                f"is {self.data_parallel}; only 1 is supported: run one torch.distributed "
                "world (one RankGroup) per replica",
            )
        if self.tensor_parallel != world_size:
            raise ConfigError(
                "tensor_parallel",
                f"is {self.tensor_parallel} but torch.distributed has {world_size} ranks: "
                "the tensor-parallel group must be the whole world",
            )


# ---------------------------------------------------------------------------- the group


@attrs.frozen(kw_only=True)
class GroupStatistics:
    """Counters of one RankGroup."""

    collectives: int
    """Agreement collectives run (startup exchanges included; model all-reduces are not)."""
    failure: str | None
    """Why the group failed, or None while it works."""


def _refusal(exc: BaseException) -> tuple[str, str]:
    """(field, message) of an error, to send to the other ranks."""
    if isinstance(exc, ConfigError | UsageError):
        return exc.field, str(exc).removeprefix(f"{exc.field}: ")
    return type(exc).__name__, str(exc)


class RankGroup:
    """This process's view of the tensor-parallel group: rank, agreed clock, collectives.

    torch.distributed must be initialized (any backend).  Construction is collective: every
    rank creates its RankGroup at the same point, the layout is checked on every rank and a
    refusal anywhere raises ConfigError everywhere.  `time_source` is the clock rank 0
    broadcasts (the other ranks' are never read); by default the wall clock.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        time_source: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(layout, ParallelLayout):
            raise ConfigError("layout", f"must be a ParallelLayout, got {layout!r}")
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float)
                or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise ConfigError("timeout_s", f"must be a finite number of seconds > 0, got "
                                           f"{timeout_s!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "torch.distributed", "must be initialized (init_process_group) on every rank "
                "before a RankGroup is made",
            )
        self.layout = layout
        self.timeout_s = float(timeout_s)
        self.rank: Final = dist.get_rank()
        self.world_size: Final = dist.get_world_size()
        self._time_source = time_source or WallClock()
        self._lock = threading.Lock()
        self._collectives = 0
        self._failure: str | None = None
        self._closed = False
        # The agreement's own gloo group: CPU metadata never waits behind GPU collectives,
        # and a gloo timeout raises here instead of aborting the process.
        self._control: Any = None
        try:
            self._control = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
            )
        except (RuntimeError, ValueError) as exc:
            raise RankGroupFailed(
                f"rank {self.rank} could not create the agreement group: {exc}"
            ) from exc
        local: BaseException | None = None
        try:
            layout.check(self.world_size)
        except ConfigError as exc:
            local = exc
        self._time = -math.inf
        self._local = -math.inf
        first = self._read_time() if self.rank == 0 else -math.inf
        try:
            hellos = self.all_gather_object(
                (None if local is None else _refusal(local), attrs.astuple(layout), first)
            )
        except RankGroupFailed:
            self.close()
            raise
        failed = [(r, h[0]) for r, h in enumerate(hellos) if h[0] is not None]
        if local is not None or failed:
            self.close()
            if local is not None:
                raise local
            rank, (field, message) = failed[0]
            raise ConfigError(field, f"refused on rank {rank}: {message}")
        if any(h[1] != hellos[0][1] for h in hellos):
            self.close()
            raise ConfigError(
                "layout", f"differs across ranks: {[h[1] for h in hellos]} (tensor_parallel, "
                "pipeline_parallel, data_parallel, attention_dp)",
            )
        self._time = float(hellos[0][2])

    # ------------------------------------------------------------------ the agreed clock

    def _read_time(self) -> float:
        """Rank 0's clock reading to broadcast; -inf (no news) when it is not a number."""
        value = self._time_source()
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value
        ):
            log.warning("time_source returned %r; the agreed clock keeps its last value", value)
            return -math.inf
        return float(value)

    def now(self) -> float:
        """The agreed time: rank 0's clock as of the last step exchange.  Never decreases."""
        return self._time

    def local_clock(self) -> float:
        """This rank's own time_source, made monotonic: for caches that need no agreement
        (no disk tier, or a single rank)."""
        with self._lock:
            value = self._time_source()
            if isinstance(value, int | float) and math.isfinite(value):
                self._local = max(self._local, float(value))
            return self._local

    # ------------------------------------------------------------------ collectives

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def statistics(self) -> GroupStatistics:
        return GroupStatistics(collectives=self._collectives, failure=self._failure)

    def _run(self, what: str, op: Callable[[], None], *, agreement: bool = True) -> None:
        """Run one collective; any failure poisons the group (RankGroupFailed from now on)."""
        with self._lock:
            if self._failure is not None:
                raise RankGroupFailed(f"the rank group already failed: {self._failure}")
            if self._closed:
                raise UsageError("group", "the rank group is closed")
            if agreement:
                self._collectives += 1
        started = time.monotonic()
        try:
            op()
        except (RuntimeError, ValueError) as exc:
            elapsed = time.monotonic() - started
            reason = (
                f"{what} on rank {self.rank} failed after {elapsed:.1f} s (timeout "
                f"{self.timeout_s:.0f} s): another rank died, hung or left: {exc}"
            )
            with self._lock:
                self._failure = reason
            log.error("%s", reason)
            # Tearing the group down closes its sockets: ranks still waiting on this one
            # learn of the failure at once instead of after their own timeout.
            self._destroy_control()
            raise RankGroupFailed(reason) from exc

    def step_max(self, values: Sequence[float]) -> list[float]:
        """One all-reduce (MAX) of `values` that also carries rank 0's time: after it, now()
        is rank 0's reading (if later than the agreed time so far)."""
        stamp = self._read_time() if self.rank == 0 else -math.inf
        vec = torch.tensor([stamp, *values], dtype=torch.float64)
        self._run("step exchange", lambda: dist.all_reduce(
            vec, op=dist.ReduceOp.MAX, group=self._control))
        out = vec.tolist()
        if math.isfinite(out[0]):
            self._time = max(self._time, out[0])
        return out[1:]

    def max_int64(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise MAX of an int64 CPU vector over every rank (in place, returned)."""
        if values.dtype != torch.int64 or values.device.type != "cpu" or values.ndim != 1:
            raise UsageError("values", "must be a 1-D int64 CPU tensor")
        self._run("transfer exchange", lambda: dist.all_reduce(
            values, op=dist.ReduceOp.MAX, group=self._control))
        return values

    def all_gather_object(self, obj: object) -> list[Any]:
        """Every rank's `obj` (pickled): for the startup exchanges only, never per step."""
        out: list[Any] = [None] * self.world_size
        self._run("startup exchange", lambda: dist.all_gather_object(
            out, obj, group=self._control))
        return out

    def check_identical(self, what: str, digest: bytes) -> None:
        """Raise InvariantViolation on every rank unless every rank passed the same digest."""
        words = [int.from_bytes(digest[i:i + 7], "little") for i in range(0, 21, 7)]
        vec = torch.tensor(words + [-w for w in words], dtype=torch.int64)
        self.max_int64(vec)
        n = len(words)
        if vec[:n].tolist() != (-vec[n:]).tolist():
            raise InvariantViolation(f"{what} differs across tensor-parallel ranks")

    def model_all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the default group (the model's backend): the
        ``all_reduce`` for PagedDecoder, failing as RankGroupFailed like the agreement."""
        self._run("model all-reduce", lambda: dist.all_reduce(tensor), agreement=False)

    # ------------------------------------------------------------------ life

    def _destroy_control(self) -> None:
        control, self._control = self._control, None
        if control is not None:
            try:
                dist.destroy_process_group(control)
            except (RuntimeError, ValueError) as exc:
                log.debug("destroying the agreement group: %s", exc)

    def close(self) -> None:
        """Release the agreement group (local: no collective).  The default process group
        belongs to the caller.  Idempotent."""
        with self._lock:
            self._closed = True
        self._destroy_control()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ---------------------------------------------------------------------------- the gate


class _LockstepGate:
    """Holds every completion until the ranks agree that it landed on all of them.

    hold() runs on the trio thread (the pools' CompletionGate seam); landed(), release() and
    open() on the serving loop's thread.  release() applies completions one at a time, in the
    given order, and returns once each is applied: the order of application decides sequence
    numbers, free lists and eviction order, so it must be the same on every rank.
    """

    def __init__(self, timeout_s: float) -> None:
        self._lock = threading.Lock()
        # Keyed by the completion's name (a batch's: its first transfer); ranks agree per
        # block transfer, and a batch lands as a unit, so its blocks are agreed together.
        self._held: dict[TransferId, tuple[Completion, trio.Event]] = {}
        self._held_as: dict[TransferId, TransferId] = {}
        """Each held block transfer -> the name its completion is held under."""
        self._fail: set[TransferId] = set()
        self._open = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._timeout_s = timeout_s

    async def hold(self, completion: Completion) -> None:
        with self._lock:
            if self._open:
                return
            self._token = trio.lowlevel.current_trio_token()
            event = trio.Event()
            self._held[completion.transfer] = (completion, event)
            for outcome in outcomes(completion):
                self._held_as[outcome.transfer] = completion.transfer
        await event.wait()

    def landed(self) -> dict[TransferId, bool]:
        """Transfers whose completion waits here, each with whether it failed on this rank."""
        with self._lock:
            return {
                outcome.transfer: isinstance(outcome, SlotReadFailed | SlotWriteFailed)
                for c, _event in self._held.values()
                for outcome in outcomes(c)
            }

    def completion_filter(self, completion: Completion) -> Completion:
        """Scheduler.completion_filter: a transfer failed on another rank fails here too."""
        if isinstance(completion, BatchFinished):
            return BatchFinished(
                outcomes=tuple(self._filter_one(o) for o in completion.outcomes)
            )
        return self._filter_one(completion)

    def _filter_one(self, completion: TransferOutcome) -> TransferOutcome:
        with self._lock:
            if completion.transfer not in self._fail:
                return completion
            self._fail.discard(completion.transfer)
        if isinstance(completion, SlotRead):
            return SlotReadFailed(transfer=completion.transfer, cause=_FAILED_ELSEWHERE)
        if isinstance(completion, SlotWritten):
            return SlotWriteFailed(transfer=completion.transfer, cause=_FAILED_ELSEWHERE)
        return completion

    def release(
        self,
        agreed: Sequence[tuple[TransferId, bool]],
        in_flight: Callable[[], tuple[TransferId, ...]],
    ) -> None:
        """Apply the agreed completions, in order; (transfer, failed on some rank) pairs."""
        names: list[TransferId] = []
        with self._lock:
            token = self._token
            for tid, failed in agreed:
                name = self._held_as.get(tid)
                if name is None:
                    raise InvariantViolation(f"transfer {tid} was agreed but is not held here")
                if failed:
                    self._fail.add(tid)
                if name not in names:
                    names.append(name)
        if token is None or not agreed:
            return
        try:
            trio.from_thread.run(
                self._release_in_order, names, in_flight, trio_token=token,
            )
        except trio.TooSlowError:
            raise InvariantViolation(
                f"agreed completions were not applied within {self._timeout_s:.0f} s"
            ) from None

    async def _release_in_order(
        self, tids: list[TransferId], in_flight: Callable[[], tuple[TransferId, ...]]
    ) -> None:
        with trio.fail_after(self._timeout_s):
            for tid in tids:
                with self._lock:
                    completion, event = self._held.pop(tid)
                    for outcome in outcomes(completion):
                        del self._held_as[outcome.transfer]
                event.set()
                # The pool's task reports it, the scheduler's task applies it: wait for that
                # before releasing the next one, so that they are applied in this order.
                while tid in in_flight():
                    await trio.sleep(0)

    def open(self) -> None:
        """Let everything through from now on (closing: no more decisions to agree on)."""
        with self._lock:
            self._open = True
            events = [event for _completion, event in self._held.values()]
            self._held.clear()
            self._held_as.clear()
            self._fail.clear()
            token = self._token
        if events and token is not None:

            def wake() -> None:
                for event in events:
                    event.set()

            # A finished run: the cache's loop is gone, and its held tasks with it.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(wake)


# ---------------------------------------------------------------------------- the cache


@attrs.frozen(kw_only=True)
class AgreementStatistics:
    """What the agreement of one TensorParallelCache did."""

    steps: int
    """Step exchanges (sync calls that ran a collective)."""
    quiet_steps: int
    """Steps at which no transfer was in flight on any rank: one all-reduce, nothing else."""
    exchange_steps: int
    """Steps that exchanged per-transfer landing (some transfer was in flight)."""
    released: int
    """Completions applied after every rank had landed them."""
    held_over: int
    """Times a completion had landed here but not yet on every rank at a step (it waited)."""
    failed_everywhere: int
    """Transfers that failed on at least one rank, applied as failed on every rank."""
    failed_elsewhere: int
    """Of those, transfers that succeeded here (their bytes were not published)."""
    collectives: int
    """The group's agreement collectives so far (all caches of the group)."""


# Slot directories opened by caches of this process: a second cache on one of them (a draft
# model's cache left in the target's namespace) is refused by name, before the slot store's
# directory lock would refuse it with a less telling error.
_open_directories: set[Path] = set()
_open_directories_lock = threading.Lock()


def draft_config(
    target: StateKVConfig, *, layout: KVLayout, namespace: str = "draft", **changes: Any
) -> StateKVConfig:
    """The config of a speculative-decoding draft model's cache next to `target`'s.

    Same disk directory and rank, its own `layout`, and a namespace of its own: its slot
    files live under ``<disk_dir>/<namespace>/rank_<rank>``, never among the target's.
    """
    if namespace == target.namespace:
        raise ConfigError(
            "namespace", f"the draft cache needs a namespace other than the target's "
            f"({target.namespace!r}), or the two would share slot files",
        )
    return attrs.evolve(target, layout=layout, namespace=namespace, **changes)


class TensorParallelCache:
    """One rank's cache of a tensor-parallel group, kept in lockstep with the others.

    ``cache`` is the rank's BlockingCache (its own pools and slot directory); hand it to
    the serving loop with ``clock=self.clock`` and ``ready_everywhere=self.ready_everywhere``,
    or, driving the cache directly, call :meth:`sync` once per step on every rank.
    Construction is collective (every rank opens its cache, then all compare outcomes and
    configurations); `store` replaces the configured slot store (tests wrap it).

    The config's `rank` must be 0 (the default: it becomes the global rank) or the global
    rank.  A rank's disk directory is ``<disk_dir>/<namespace>/rank_<global rank>``.
    """

    def __init__(
        self,
        config: StateKVConfig,
        group: RankGroup,
        *,
        store: SlotStore | None = None,
        trace: TraceSink | None = None,
    ) -> None:
        if not isinstance(group, RankGroup):
            raise ConfigError("group", f"must be a RankGroup, got {group!r}")
        self.group = group
        self.lockstep = False
        """Whether completions wait for every rank (a disk tier and more than one rank)."""
        self._gate: _LockstepGate | None = None
        self._directory: Path | None = None
        self._closed = False
        self._steps = self._quiet = self._exchanges = 0
        self._released = self._held_over = self._failed_all = self._failed_elsewhere = 0
        local: BaseException | None = None
        cache: BlockingCache | None = None
        summary: tuple[object, ...] = ()
        try:
            config = self._rank_config(config, group)
            if config.remote_url is not None and group.world_size > 1:
                # Each rank would look its own shard's keys up and fetch on its own: the
                # ranks would match different prefixes.  Until lookups and fetch outcomes
                # are agreed across ranks, the shared tier is single-rank only.
                raise ConfigError(
                    "remote_url", f"the shared tier is not supported with {group.world_size} "
                    "tensor-parallel ranks yet"
                )
            core = config.core_config()
            summary = (
                config.namespace,
                tuple((k, repr(v)) for k, v in sorted(attrs.asdict(core).items())),
            )
            self.lockstep = core.disk_blocks > 0 and group.world_size > 1
            if self.lockstep:
                self._gate = _LockstepGate(group.timeout_s)
                if config.persist:
                    # Each rank would rebuild its index from its own directory, and a crash
                    # can leave one rank with a write another lacks: their caches would then
                    # decide differently.  Until restored content is agreed across ranks,
                    # several ranks start with empty disk tiers.
                    log.warning(
                        "rank %d: persist=True is not supported with %d tensor-parallel ranks "
                        "yet; the disk tier starts empty (persist=False)", group.rank,
                        group.world_size,
                    )
                    config = attrs.evolve(config, persist=False)
                if config.cost_aware_onboarding:
                    # Each rank measures its own disk: estimates differ, and a cut made on
                    # one rank only would give the ranks different prefixes.
                    config = attrs.evolve(config, cost_aware_onboarding=False)
            self._claim_directory(config)
            cache = BlockingCache(
                config, store=store, gate=self._gate, clock=self.clock, trace=trace
            )
            if self._gate is not None:
                cache.filter_completions(self._gate.completion_filter)
        except Exception as exc:
            local = exc
        try:
            outcomes = group.all_gather_object(
                (None if local is None else _refusal(local), summary)
            )
        except RankGroupFailed:
            self._abandon(cache)
            raise
        failed = [(r, o[0]) for r, o in enumerate(outcomes) if o[0] is not None]
        if local is not None or failed:
            self._abandon(cache)
            if local is not None:
                raise local
            rank, (field, message) = failed[0]
            raise ConfigError(field, f"refused on rank {rank}: {message}")
        if any(o[1] != outcomes[0][1] for o in outcomes):
            self._abandon(cache)
            raise ConfigError(_first_difference(outcomes[0][1], next(
                o[1] for o in outcomes if o[1] != outcomes[0][1])),
                "differs across ranks: every rank's cache must take the same decisions, so "
                "all ranks need the same configuration (rank and disk_dir aside)")
        assert cache is not None
        self.cache: Final = cache

    @staticmethod
    def _rank_config(config: StateKVConfig, group: RankGroup) -> StateKVConfig:
        if not isinstance(config, StateKVConfig):
            raise ConfigError("config", f"must be a StateKVConfig, got {config!r}")
        if config.rank not in (0, group.rank):
            raise ConfigError(
                "rank", f"is {config.rank} but this process is global rank {group.rank} "
                "(leave it 0: the tensor-parallel cache sets it)",
            )
        return attrs.evolve(config, rank=group.rank)

    def _claim_directory(self, config: StateKVConfig) -> None:
        """Refuse a second cache of this process on the same slot directory (a draft model's
        cache must take its own namespace), before the store's lock would."""
        directory = config.rank_directory()
        if directory is None or config.core_config().disk_blocks == 0:
            return
        directory = directory.absolute()
        with _open_directories_lock:
            if directory in _open_directories:
                raise ConfigError(
                    "namespace", f"{directory} is used by another cache of this process: give "
                    "each cache (a draft model's, the target's) its own namespace",
                )
            _open_directories.add(directory)
        self._directory = directory

    def _release_directory(self) -> None:
        if self._directory is not None:
            with _open_directories_lock:
                _open_directories.discard(self._directory)
            self._directory = None

    def _abandon(self, cache: BlockingCache | None) -> None:
        """Undo a construction that another rank (or this one) refused."""
        if self._gate is not None:
            self._gate.open()
        if cache is not None:
            cache.close(drain=False)
        self._release_directory()

    # ------------------------------------------------------------------ per step

    def clock(self) -> float:
        """The time every cache call uses: the agreed time when in lockstep, else this
        rank's own (without a disk tier no cache decision depends on the time).

        Also the serving loop's clock: in lockstep its arrival times are then judged alike
        on every rank.  Without a disk tier there is no per-step exchange to carry a time,
        so a loop whose requests arrive at staggered times must receive them from rank 0
        (as serving engines do), not read them off each rank's clock."""
        return self.group.now() if self.lockstep else self.group.local_clock()

    def sync(self) -> int:
        """The step's agreement; returns how many transfers were in flight on every rank.

        Every rank must call it at the same point of its step (the serving loop's
        ready_everywhere does).  Raises RankGroupFailed when a rank is gone, and
        InvariantViolation on every rank if the ranks' caches were found to differ.
        """
        if not self.lockstep:
            return 0
        if self._closed:
            raise UsageError("cache", "the tensor-parallel cache is closed")
        gate = self._gate
        assert gate is not None
        in_flight = self.cache.transfers_in_flight()
        n = len(in_flight)
        count, negated = self.group.step_max([float(n), float(-n)])
        self._steps += 1
        if count != -negated:
            raise InvariantViolation(
                f"ranks have between {-negated:.0f} and {count:.0f} transfers in flight: their "
                "caches diverged"
            )
        if n == 0:
            self._quiet += 1
            return 0
        self._exchanges += 1
        landed = gate.landed()
        ids = torch.tensor(in_flight, dtype=torch.int64)
        missing = torch.tensor([tid not in landed for tid in in_flight], dtype=torch.int64)
        failed = torch.tensor([landed.get(tid, False) for tid in in_flight], dtype=torch.int64)
        vec = self.group.max_int64(torch.cat([missing, failed, ids, -ids]))
        missing, failed, top, bottom = vec[:n], vec[n:2 * n], vec[2 * n:3 * n], vec[3 * n:]
        if not torch.equal(top, -bottom):
            raise InvariantViolation("ranks have different transfers in flight: their caches "
                                     "diverged")
        agreed = [
            (tid, bool(f))
            for tid, m, f in zip(in_flight, missing.tolist(), failed.tolist(), strict=True)
            if not m
        ]
        self._held_over += sum(1 for tid in landed if tid not in dict(agreed))
        self._released += len(agreed)
        self._failed_all += sum(1 for _tid, f in agreed if f)
        self._failed_elsewhere += sum(1 for tid, f in agreed if f and not landed[tid])
        gate.release(agreed, self.cache.transfers_in_flight)
        return n

    def ready_everywhere(self, request_ids: list[str]) -> set[str]:
        """The serving loop's hook: of these parked requests, those whose blocks landed on
        every rank.  Runs the step's agreement (see sync): afterwards each rank's cache has
        applied exactly the completions every rank has, so its own is_ready is every rank's."""
        self.sync()
        is_ready = self.cache.is_ready
        return {rid for rid in request_ids if is_ready(rid)}

    def quiesce(self, timeout_s: float = 30.0) -> None:
        """Step the agreement until no transfer is in flight on any rank (collective).

        The deadline is on the agreed clock, so every rank gives up at the same step.
        """
        if not self.lockstep:
            return
        deadline = self.group.now() + timeout_s
        while self.sync():
            if self.group.now() > deadline:
                raise TimeoutError(f"transfers still in flight after {timeout_s} s")
            time.sleep(0.001)

    def digest(self) -> bytes:
        """A hash of everything that must be identical on every rank: the prefix index
        (keys, tiers, retention, reuse counts) and the core's counters."""
        blocks = sorted(
            (b.key.hex(), b.state.name, b.ref_count, b.reuse_count, b.expiry, b.depth,
             b.priority)
            for b in self.cache.cached_blocks()
        )
        stats = self.cache.statistics().cache
        text = repr((blocks, sorted(attrs.asdict(stats).items())))
        return hashlib.blake2b(text.encode(), digest_size=21).digest()

    def check_agreement(self) -> None:
        """Collective: InvariantViolation on every rank unless all ranks' digests match."""
        self.group.check_identical("the cache (prefix index or counters)", self.digest())

    def statistics(self) -> AgreementStatistics:
        return AgreementStatistics(
            steps=self._steps, quiet_steps=self._quiet, exchange_steps=self._exchanges,
            released=self._released, held_over=self._held_over,
            failed_everywhere=self._failed_all, failed_elsewhere=self._failed_elsewhere,
            collectives=self.group.statistics().collectives,
        )

    # ------------------------------------------------------------------ life

    def close(self, *, drain: bool = True) -> CloseReport | None:
        """Close this rank's cache; no collective (safe after a rank failed).  Idempotent.

        Completions still held are let through first: closing decides nothing more.
        """
        if self._closed:
            return self.cache.close_report
        self._closed = True
        if self._gate is not None:
            self._gate.open()
        try:
            return self.cache.close(drain=drain and not self.group.failed)
        finally:
            self._release_directory()

    def __enter__(self) -> TensorParallelCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(drain=exc is None)


def _first_difference(a: object, b: object) -> str:
    """The config field two ranks' summaries (namespace, ((field, value repr), ...)) disagree
    on, to name it in the error."""
    assert isinstance(a, tuple) and isinstance(b, tuple)
    if a[0] != b[0]:
        return "namespace"
    right = dict(b[1])
    for key, value in a[1]:
        if right.get(key) != value:
            return str(key)
    return "config"
