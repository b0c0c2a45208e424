"""Whether reading a run of disk blocks back (or fetching one from the shared tier) beats
recomputing its tokens.

A disk hit is worth reading only when the read finishes before a prefill of the same tokens
would: on a slow disk with a fast model (a small model, short contexts) recomputing wins, and
a disk tier must never make serving slower than no disk tier.  The manager weighs every
place the match could end (the starts of its runs of disk and remote blocks) with these
estimates and keeps the cheapest (``statekv.onboarding.Onboarding.cost_cut``).

The estimates are measurements reported from outside (sans-IO: the core reads no clock):

* the disk's read rate, in bytes per second, from completed reads -- the reader actor reports
  each batch's bytes and the seconds it took;
* the shared tier's fetch rate, in bytes per second, from completed fetches -- the remote
  fetcher actor reports each batch's verified bytes and the seconds it took (round trips
  included: it is the rate a request sees);
* the model's prefill time per token, by context length -- the serving loop reports each
  forward pass that prefilled: its tokens, the seconds it took and the longest context it
  ended at (a batch's time per token is what recomputing costs a busy server).  Attention
  makes a token cost more at a longer context, so the estimate is kept per power-of-two
  bucket of context length and looked up at the request's own length.

Each estimate is an exponentially weighted moving average (weight `SMOOTHING` for the newest
measurement): it follows a disk that slows down under load without jumping on one outlier.
Before any estimate exists the answer is "read" -- the behaviour of a cache that does not
weigh costs -- so a cache nobody reports to behaves exactly as before.
"""

from __future__ import annotations

from typing import Final

from statekv.config import is_finite_number
from statekv.errors import UsageError

SMOOTHING: Final = 0.25
"""Weight of the newest measurement in each moving average."""
PROBE_EVERY: Final = 16
"""A request whose disk or remote hits the gate would drop reads them anyway when this many
drops in a row came without a new measurement of that tier: the gate recomputes instead of
reading, so without a probe a disk (or cluster) that was slow once would never be measured,
nor used, again.  A probe costs at most one slow read per this many gated requests."""


def _bucket(context_tokens: int) -> int:
    """The power-of-two bucket of a context length (1 -> 0, 2..3 -> 1, 4..7 -> 2...)."""
    return max(context_tokens, 1).bit_length() - 1


def check_measurement(field: str, value: object, *, positive: bool) -> float:
    """A reported measurement as a float, or UsageError naming `field`."""
    if not is_finite_number(value):
        raise UsageError(field, f"must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise UsageError(field, f"must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def check_count(field: str, value: object, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(field, f"must be an integer >= {low}, got {value!r}")
    return value


class OnboardCosts:
    """Running estimates of the disk read rate and the prefill time per token."""

    __slots__ = ("_prefill", "disk_bytes_per_second", "disk_drops", "network_bytes_per_second",
                 "network_drops")

    def __init__(self) -> None:
        self.disk_bytes_per_second: float | None = None
        self.network_bytes_per_second: float | None = None
        self._prefill: dict[int, float] = {}
        """Seconds per prefilled token, by context-length bucket."""
        self.disk_drops = 0
        """Requests whose disk hits were dropped since the disk was last measured."""
        self.network_drops = 0
        """Requests whose remote hits were dropped since the cluster was last measured."""

    def probe_due(self, dropped_disk: bool, dropped_remote: bool) -> bool:
        """Count a decision that drops disk and/or remote hits; True when this one is to be
        read anyway (PROBE_EVERY drops in a row of a tier not measured meanwhile)."""
        due = False
        if dropped_disk:
            self.disk_drops += 1
            due = self.disk_drops >= PROBE_EVERY
        if dropped_remote:
            self.network_drops += 1
            due = due or self.network_drops >= PROBE_EVERY
        if due:
            self.disk_drops = self.network_drops = 0
        return due

    def observe_read(self, num_bytes: float, seconds: float) -> None:
        """One completed read: `num_bytes` in `seconds` (both checked by the caller)."""
        rate = num_bytes / seconds
        old = self.disk_bytes_per_second
        self.disk_bytes_per_second = rate if old is None else old + SMOOTHING * (rate - old)
        self.disk_drops = 0

    def observe_fetch(self, num_bytes: float, seconds: float) -> None:
        """One completed fetch from the shared tier (both checked by the caller)."""
        rate = num_bytes / seconds
        old = self.network_bytes_per_second
        self.network_bytes_per_second = rate if old is None else old + SMOOTHING * (rate - old)
        self.network_drops = 0

    def observe_prefill(self, num_tokens: int, seconds: float, context_tokens: int) -> None:
        """One prefill of `num_tokens` new tokens that took `seconds`, ending at a context of
        `context_tokens` (checked by the caller)."""
        per_token = seconds / num_tokens
        bucket = _bucket(context_tokens)
        old = self._prefill.get(bucket)
        self._prefill[bucket] = per_token if old is None else old + SMOOTHING * (per_token - old)

    def prefill_seconds_per_token(self, context_tokens: int) -> float | None:
        """The estimate at `context_tokens`: its own bucket's, else the nearest bucket's
        (the shorter one on a tie: it underestimates the cost of recomputing, so the cache
        errs towards reading).  None before any prefill was reported."""
        prefill = self._prefill
        if not prefill:
            return None
        want = _bucket(context_tokens)
        best = min(prefill, key=lambda b: (abs(b - want), b))
        return prefill[best]


def cheapest_cut(kinds: list[int], *, block_bytes: int, block_size: int,
                 disk_rate: float | None, net_rate: float | None, per_token: float) -> int:
    """Where to end a match of blocks of `kinds` (0: on hand, 1: a disk read, 2: a shared-tier
    fetch) so that the request is fastest: the number of blocks to take.

    Ending the match at a block means recomputing every matched token from there on (a
    request's computed tokens are a prefix), so the candidates are the starts of the runs of
    transferred blocks, each costing the transfers before it plus a prefill of the rest; no
    cut costs every transfer.  A kind whose rate is None costs nothing.  Ties keep the longer
    match.
    """
    total_n = len(kinds)

    def transfers(disk: int, fetched: int) -> float:
        cost = disk * block_bytes / disk_rate if disk and disk_rate else 0.0
        if fetched and net_rate:
            cost += fetched * block_bytes / net_rate
        return cost

    best = total_n
    best_cost = transfers(kinds.count(1), kinds.count(2))
    disk_before = fetched_before = 0
    previous = 0
    for i, kind in enumerate(kinds):
        if kind and kind != previous:
            cost = transfers(disk_before, fetched_before) + (total_n - i) * block_size * per_token
            if cost < best_cost:
                best, best_cost = i, cost
        disk_before += kind == 1
        fetched_before += kind == 2
        previous = kind
    return best
