"""Per-request sampling for the serving loop: temperature, nucleus (top-p), seeds, logprobs.

The loop picks every row's arg-max in one batched call (:func:`models.model.greedy`); only the
rows of requests that sample or want log-probabilities come here, one row at a time, because
each request draws from its own :class:`torch.Generator` (a seeded request then gives the same
tokens whatever else shares its batches, as far as its logits do).  A greedy request never
pays for any of this.

Log-probabilities are the model's own (``log_softmax`` of the raw logits, before temperature
and top-p), as vLLM reports them by default.
"""

from __future__ import annotations

import math
from typing import Final

import attrs
import torch
from torch import Tensor

from statekv.errors import UsageError

SEED_MODULUS: Final = 2**64
"""torch.Generator.manual_seed takes [-2**63, 2**64); seeds are reduced into [0, 2**64)."""
LOGPROB_FLOOR: Final = -9999.0
"""An impossible token's log-probability (-inf) is reported as this: JSON has no -inf."""


def _check_temperature(_instance: object, _attribute: object, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not math.isfinite(value) or value < 0:
        raise UsageError("temperature", f"must be a finite number >= 0, got {value!r}")


def _check_top_p(_instance: object, _attribute: object, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not 0 < value <= 1:
        raise UsageError("top_p", f"must be a number in (0, 1], got {value!r}")


def _check_logprobs(_instance: object, _attribute: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise UsageError("logprobs", f"must be None or an integer >= 0, got {value!r}")


def _check_seed(_instance: object, _attribute: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise UsageError("seed", f"must be None or an integer, got {value!r}")


@attrs.frozen(kw_only=True)
class Sampling:
    """How one request picks its tokens.  The default is greedy, as a request without one."""

    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    """0: the arg-max (greedy, whatever top_p and seed say); > 0: a draw from
    softmax(logits / temperature)."""
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    """Draw only among the most likely tokens whose probabilities sum to top_p (the most
    likely token is always kept, so a tiny top_p is greedy)."""
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    """The request's generator seed: the same seed gives the same draws.  None: a fresh
    random seed."""
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)
    """Report each generated token's log-probability and this many most likely alternatives
    (None: report nothing)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_row(self) -> bool:
        """Whether the loop must look at this request's logits row on its own."""
        return not self.greedy or self.logprobs is not None


@attrs.frozen
class TokenLogprob:
    """A generated token, its log-probability and the most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token, log-probability) pairs, most likely first."""


def new_generator(sampling: Sampling, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()  # nondeterministic, as an unseeded OpenAI request is
    else:
        generator.manual_seed(sampling.seed % SEED_MODULUS)
    return generator


def sample(row: Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token drawn from `row` (one request's logits, [vocab]) as `sampling` says; the
    caller takes the arg-max itself when the request is greedy."""
    if sampling.greedy:
        raise UsageError("sampling", "a greedy request takes the arg-max, not a draw")
    probs = torch.softmax(row.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        # Stable: among equally likely tokens the lowest id comes first, as in the arg-max,
        # so a top_p that keeps one token keeps exactly the greedy one.
        ordered, ids = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(ordered, dim=-1) - ordered
        kept = torch.where(before < sampling.top_p, ordered, torch.zeros_like(ordered))
        kept[0] = ordered[0]  # rounding must never empty the nucleus
        drawn = torch.multinomial(kept, 1, generator=generator)
        return int(ids[drawn].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def logprob_of(row: Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `row` and the `top` most likely tokens'."""
    logprobs = torch.log_softmax(row.float(), dim=-1)
    pairs: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        pairs = tuple((int(i), _finite(float(v)))
                      for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, _finite(float(logprobs[token].item())), pairs)


def _finite(value: float) -> float:
    return max(value, LOGPROB_FLOOR)
