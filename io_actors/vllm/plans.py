"""What one engine step carries between the two halves of the connector: plain data.

vLLM pickles the scheduler side's metadata to every worker with the step, and each worker's
report back to the scheduler (aggregated across tensor-parallel ranks).  Nothing here holds
an object of either side: ids, keys and the core's commands (statekv.messages), so that a
worker executes exactly what the core decided, in the core's order.
"""

from __future__ import annotations

import attrs

from statekv.ids import TransferId
from statekv.messages import Command


@attrs.frozen(kw_only=True)
class RequestLoad:
    """One request's load, started this step: the worker reports the request done loading
    (``finished_recving``) once every one of its disk reads has reported on this rank."""

    request_id: str
    transfers: tuple[TransferId, ...]
    """Its disk reads (LoadSlot transfers, each naming its engine page); its host copies are
    among the step's commands."""
    unavailable_pages: tuple[int, ...] = ()
    """Engine pages the core could not fill after all: reported failed at once."""


@attrs.frozen(kw_only=True)
class StepPlan:
    """The scheduler side's decisions for one step, in the core's command order."""

    commands: tuple[Command, ...] = ()
    loads: tuple[RequestLoad, ...] = ()
    saves: tuple[str, ...] = ()
    """Requests whose save copies are among ``commands``: reported ``finished_sending`` once
    the copies ran (the engine keeps their pages until then)."""


@attrs.frozen(kw_only=True)
class TransferReport:
    """How many ranks reported one transfer, and the first failure among them."""

    ranks: int
    failure: str | None = None


@attrs.frozen(kw_only=True)
class WorkerReport:
    """What the workers report back after a step (merged across ranks by ``merged``)."""

    outcomes: dict[TransferId, TransferReport] = attrs.field(factory=dict)
    disk_reads: tuple[tuple[int, float], ...] = ()
    """(bytes, seconds) of each read batch that landed: the disk read-rate estimate."""

    def merged(self, other: WorkerReport) -> WorkerReport:
        outcomes = dict(self.outcomes)
        for tid, theirs in other.outcomes.items():
            mine = outcomes.get(tid)
            outcomes[tid] = theirs if mine is None else TransferReport(
                ranks=mine.ranks + theirs.ranks, failure=mine.failure or theirs.failure)
        return WorkerReport(outcomes=outcomes, disk_reads=self.disk_reads + other.disk_reads)
