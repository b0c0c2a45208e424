"""The connector in vLLM's engine-core process: the core, and vLLM's scheduler calls on it.

It owns :class:`statekv.engine_tiers.EngineTiers` and translates vLLM's calls into the
core's (README, "Using statekv under vLLM"):

* ``matched`` (``get_num_new_matched_tokens``): what the tiers supply past the tokens vLLM
  has computed; changes nothing.  Every load is asynchronous: the request waits in vLLM
  until the worker reports its blocks landed (host hits included: they are copied in the
  next step, before vLLM schedules the request).
* ``allocated`` (``update_state_after_alloc``): the engine's pages for those blocks; the
  core issues the copies and reads into them.
* ``plan`` (``build_connector_meta``): the core's commands for the step, in order, and the
  loads and saves started since the last step.
* ``finished`` (``request_finished``): saves the full blocks the tiers do not hold, stamps
  the request's TTL (``kv_transfer_params["kv_cache_ttl_seconds"]``); the engine keeps the
  request's pages until the worker reports the copies ran (an asynchronous save).  A
  request given up while its reads are in flight saves nothing: vLLM itself keeps its pages
  until its load reports (``finished_recving``).
* ``reported`` (``update_connector_output``): the workers' outcomes of disk writes and
  reads, applied to the core once every rank has reported a transfer (a read that failed
  on any rank fails: the block is never served again).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import attrs

from io_actors.config import StateKVConfig
from io_actors.vllm.plans import RequestLoad, StepPlan, TransferReport, WorkerReport
from io_actors.vllm.worker_side import MANIFEST
from statekv.disk_tier import RestoredBlock
from statekv.engine_tiers import EngineTiers
from statekv.errors import ConfigError, StateKVError
from statekv.hashing import DIGEST_SIZE
from statekv.ids import BlockHash, SlotId, TransferId
from statekv.messages import (
    LoadSlots,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    WriteSlots,
)
from statekv.stats import CacheStatistics

log = logging.getLogger(__name__)

TTL_PARAM: Final = "kv_cache_ttl_seconds"
"""The key of a request's ``kv_transfer_params`` that carries its retention TTL."""
REPORTED_COUNTERS: Final = (
    "hit_blocks_host", "hit_blocks_disk", "hit_blocks_disk_retained", "host_offloads",
    "offloads_skipped", "host_drops", "spills", "spills_completed", "spill_failures",
    "spills_saved_by_disk_copy", "bytes_written", "onboards_completed", "onboard_failures",
    "bytes_read", "displacements", "expirations", "restored_blocks", "admission_refusals",
    "onboards_skipped_as_too_slow",
)
"""The core's counters vLLM's connector statistics carry (logs and Prometheus), as the
increase since the last report."""
ERROR_PARAM: Final = "statekv_error"
"""The key of the ``kv_transfer_params`` returned with a request whose parameters statekv
refused (the request itself ran, without what was refused)."""


class SchedulerSide:
    """The core beneath vLLM's prefix cache, driven by vLLM's scheduler calls."""

    def __init__(self, config: StateKVConfig, *, world_size: int, instance: str,
                 clock: Callable[[], float] = time.time, write_through: str = "all") -> None:
        self.config = config
        self.core_config = core = config.core_config()
        self.block_size = core.block_size
        self.world_size = world_size
        self.clock = clock
        self.core = EngineTiers(core, write_through=write_through)
        self._loads: list[RequestLoad] = []
        self._saves: list[str] = []
        self._kinds: dict[TransferId, bool] = {}
        """Each transfer in flight: True for a read (load), False for a write (spill)."""
        self._reports: dict[TransferId, TransferReport] = {}
        self._last_step: tuple[float, int, int] | None = None
        self._reported_counters = dict.fromkeys(REPORTED_COUNTERS, 0)
        self._awaiting: set[str] = set()
        """Requests whose load vLLM has not seen finished (``finished_recving``) yet."""
        if core.disk_blocks:
            self._restore(instance)

    # ------------------------------------------------------------------ restore

    def _restore(self, instance: str) -> None:
        """Adopt what every rank's open found on disk: a block is restored only when every
        rank holds it in the same slot (each rank stores its shard of the block)."""
        common: dict[tuple[SlotId, BlockHash], RestoredBlock] | None = None
        for rank in range(self.world_size):
            config = _with_rank(self.config, rank)
            directory = config.rank_directory()
            assert directory is not None
            path = directory / MANIFEST
            try:
                body = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError("disk_dir", f"rank {rank}'s worker left no readable "
                                  f"restore manifest at {path}: {exc}") from None
            if body.get("instance") != instance:
                raise ConfigError("disk_dir", f"{path} was written by another engine "
                                  "(two engines on one directory?)")
            found = {}
            for entry in body.get("blocks", []):
                block = _restored(entry)
                found[(block.slot, block.key)] = block
            common = found if common is None else {
                k: v for k, v in common.items() if k in found}
        blocks = sorted((common or {}).values(), key=lambda b: b.slot)
        if blocks:
            self.core.restore(blocks, now=self.clock())
            log.info("statekv: %d blocks restored on %d rank(s)", len(blocks), self.world_size)

    # ------------------------------------------------------------------ vLLM's calls

    def matched(self, token_ids: Sequence[int], num_computed_tokens: int, *,
                cache_salt: str | None, lora_id: int | None) -> int:
        """Tokens past `num_computed_tokens` the tiers can load (a multiple of the block
        size; 0 when none, or when vLLM's computed tokens are not block aligned)."""
        if num_computed_tokens % self.block_size or len(token_ids) < 2:
            return 0
        match = self.core.lookup(token_ids, start_block=num_computed_tokens // self.block_size,
                                 cache_salt=cache_salt, lora_id=lora_id)
        return match.num_blocks * self.block_size

    def allocated(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int],
                  num_external_tokens: int, num_computed_tokens: int, *,
                  cache_salt: str | None, lora_id: int | None) -> None:
        """vLLM allocated the request's pages: start loading its external tokens into them."""
        if num_external_tokens <= 0:
            return  # the second call of an asynchronous load, or nothing to load
        start = num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        pages = list(block_ids[start:start + count])
        plan = self.core.start_load(request_id, token_ids, start_block=start,
                                    engine_pages=pages, now=self.clock(),
                                    cache_salt=cache_salt, lora_id=lora_id)
        self._loads.append(RequestLoad(request_id=request_id, transfers=plan.transfers,
                                       unavailable_pages=plan.unavailable_pages))
        self._awaiting.add(request_id)

    def plan(self, *, num_new_tokens: int, longest_context: int) -> StepPlan:
        """The step's plan for the workers.  Also measures the previous step: its time per
        new token is the prefill estimate the cost gate weighs against disk reads."""
        now = time.monotonic()
        last = self._last_step
        if last is not None and last[1] > 0 and now > last[0]:
            self.core.report_prefill(last[1], now - last[0], context_tokens=max(1, last[2]))
        self._last_step = (now, num_new_tokens, longest_context)
        commands = tuple(self.core.take_commands())
        for cmd in commands:
            if isinstance(cmd, WriteSlots):
                self._kinds.update((w.transfer, False) for w in cmd.writes)
            elif isinstance(cmd, LoadSlots):
                self._kinds.update((r.transfer, True) for r in cmd.reads)
        plan = StepPlan(commands=commands, loads=tuple(self._loads), saves=tuple(self._saves))
        self._loads, self._saves = [], []
        return plan

    def finished(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int],
                 params: object, *, cache_salt: str | None, lora_id: int | None,
                 ) -> tuple[bool, dict[str, object] | None]:
        """A request finished: save its full computed blocks and stamp its TTL.  Returns
        (the engine must keep its pages until the save reports, params for the output)."""
        if request_id in self._awaiting:
            # Given up while loading (its reads in flight, or its copies not yet run or
            # reported): vLLM holds its pages until the workers report the load, and frees
            # them then -- a save would report the same pages a second time.
            return False, None
        ttl, error = self._ttl(params)
        full = len(token_ids) // self.block_size
        if full == 0:
            return False, _error_params(error)
        try:
            out = self.core.save(token_ids[: full * self.block_size],
                                 engine_pages=block_ids[:full], now=self.clock(),
                                 ttl_seconds=ttl, cache_salt=cache_salt, lora_id=lora_id)
        except StateKVError as exc:  # a request the core refuses is one it does not save
            log.error("statekv: request %s not saved: %s", request_id, exc)
            return False, _error_params(str(exc))
        if out.saved_blocks:
            self._saves.append(request_id)
        return out.saved_blocks > 0, _error_params(error)

    def reported(self, report: WorkerReport | None,
                 finished_recving: Iterable[str] = ()) -> None:
        """The workers' outcomes: applied once every rank reported a transfer; and the
        requests whose loads vLLM now knows finished (on every rank)."""
        self._awaiting.difference_update(finished_recving)
        if report is None:
            return
        for nbytes, seconds in report.disk_reads:
            if nbytes > 0 and seconds > 0:
                self.core.report_disk_read(nbytes, seconds)
        now = self.clock()
        for tid, this in report.outcomes.items():
            seen = self._reports.get(tid)
            got = this if seen is None else TransferReport(
                ranks=seen.ranks + this.ranks, failure=seen.failure or this.failure)
            if got.ranks < self.world_size:
                self._reports[tid] = got
                continue
            self._reports.pop(tid, None)
            is_read = self._kinds.pop(tid)
            if is_read:
                event: SlotRead | SlotReadFailed | SlotWritten | SlotWriteFailed = (
                    SlotRead(transfer=tid) if got.failure is None
                    else SlotReadFailed(transfer=tid, cause=got.failure))
            else:
                event = (SlotWritten(transfer=tid) if got.failure is None
                         else SlotWriteFailed(transfer=tid, cause=got.failure))
            self.core.handle(event, now=now)

    def statistics(self) -> CacheStatistics:
        return self.core.statistics()

    def counter_increases(self) -> dict[str, int]:
        """How much each of REPORTED_COUNTERS grew since the last call (the ones that did)."""
        now = self.core.statistics()
        out: dict[str, int] = {}
        for name, before in self._reported_counters.items():
            value = int(getattr(now, name))
            if value != before:
                out[name] = value - before
                self._reported_counters[name] = value
        return out

    # ------------------------------------------------------------------ helpers

    def _ttl(self, params: object) -> tuple[float | None, str | None]:
        """The request's TTL from its kv_transfer_params, or (None, why it was refused)."""
        if not isinstance(params, dict) or TTL_PARAM not in params:
            return None, None
        value = params[TTL_PARAM]
        limit = self.core_config.max_ttl_seconds
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not 0 <= value <= limit):
            why = (f"kv_transfer_params.{TTL_PARAM}: must be a number of seconds in "
                   f"[0, {limit}], got {value!r}; the request's blocks were kept best-effort")
            log.error("statekv: %s", why)
            return None, why
        return float(value), None


def _error_params(error: str | None) -> dict[str, object] | None:
    return None if error is None else {ERROR_PARAM: error}


def _with_rank(config: StateKVConfig, rank: int) -> StateKVConfig:
    return attrs.evolve(config, rank=rank)


def _restored(entry: object) -> RestoredBlock:
    if not isinstance(entry, list) or len(entry) != 8:
        raise ConfigError("disk_dir", f"a restore manifest entry is malformed: {entry!r:.80}")
    slot, key, parent, depth, reuse, expiry, written_at, sequence = entry
    key_b, parent_b = bytes.fromhex(key), bytes.fromhex(parent)
    if len(key_b) != DIGEST_SIZE or len(parent_b) != DIGEST_SIZE:
        raise ConfigError("disk_dir", f"a restore manifest entry is malformed: {entry!r:.80}")
    return RestoredBlock(key=BlockHash(key_b), parent_key=BlockHash(parent_b),
                         slot=SlotId(slot), depth=depth, reuse_count=reuse, expiry=expiry,
                         written_at=written_at, sequence=sequence)
