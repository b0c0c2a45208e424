"""Where the serving loop's steps go (``LoopStatistics.decode_steps`` / ``prefill_steps``):
each step that ran a pass is counted once, under the kind of batch it carried, and its
parts are the clock's readings around what the loop did.

The clock is the test's: the model's forward pass and the cache's calls before and after
the pass move it by known amounts, so each part's sum is exact, not timed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from bench.serving import step_parts_line
from io_actors.embed import BlockingCache
from models.config import preset
from models.model import Chunk, PagedDecoder, StepOutput
from models.serving_loop import Cache, ServeRequest, ServingLoop, StepParts
from tests.test_serving_prefetch import serving_config

LAUNCH, ALLOCATE, COMMIT = 5.0, 1.0, 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedModel:
    """The real model; its forward pass moves the clock by LAUNCH."""

    def __init__(self, model: PagedDecoder, clock: Clock) -> None:
        self._model, self._clock = model, clock

    def forward(self, pool: torch.Tensor, chunks: Sequence[Chunk], **kw: Any) -> StepOutput:
        self._clock.now += LAUNCH
        return self._model.forward(pool, chunks, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class TimedCache:
    """The real cache; an allocation moves the clock by ALLOCATE, a commit by COMMIT."""

    def __init__(self, cache: BlockingCache, clock: Clock) -> None:
        self._cache, self._clock = cache, clock
        self.allocations = self.commits = 0

    def allocate_nowait(self, request_id: str, num_tokens: int) -> None:
        self.allocations += 1
        self._clock.now += ALLOCATE
        self._cache.allocate_nowait(request_id, num_tokens)

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        self.commits += 1
        self._clock.now += COMMIT
        self._cache.commit(request_id, num_computed_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def test_each_step_is_one_kind_and_its_parts_are_what_the_loop_spent(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"))
    clock = Clock()
    with BlockingCache(serving_config(tmp_path, model, disk=False)) as real:
        cache = TimedCache(real, clock)
        loop = ServingLoop(cast(PagedDecoder, TimedModel(model, clock)), cast(Cache, cache),
                           clock=clock)
        # Two requests of 9 prompt tokens and 4 new tokens each, the second arriving while
        # the first decodes: one prefill step alone, one mixed (a decode beside the second's
        # prefill), then decode-only steps.
        loop.submit(ServeRequest(request_id="a", prompt=tuple(range(9)), max_new_tokens=4))
        loop.step()
        loop.submit(ServeRequest(request_id="b", prompt=tuple(range(20, 29)),
                                 max_new_tokens=4))
        while not loop.idle:
            loop.step()
        stats = loop.statistics()
    prefill, decode = stats.prefill_steps, stats.decode_steps
    assert isinstance(prefill, StepParts) and isinstance(decode, StepParts)
    assert prefill.steps == 2  # "a" alone, then "b" beside a decode of "a"
    assert decode.steps == len(stats.step_seconds) - 2 == 3
    for parts in (prefill, decode):
        assert parts.launch_seconds == LAUNCH * parts.steps
        assert parts.readback_seconds == 0.0  # the pass moves this clock only at launch
    # Every allocation happens while scheduling (before the pass), every commit after it.
    assert prefill.prepare_seconds + decode.prepare_seconds == ALLOCATE * cache.allocations
    assert prefill.advance_seconds + decode.advance_seconds == COMMIT * cache.commits
    assert prefill.advance_seconds == COMMIT * 3  # "a"'s prompt; "a"'s decode, "b"'s prompt
    # The step times the loop already kept are the same steps' launch + readback + advance.
    assert sum(stats.step_seconds) == sum(
        p.launch_seconds + p.readback_seconds + p.advance_seconds for p in (prefill, decode))


def test_a_loop_with_no_steps_has_no_means() -> None:
    parts = StepParts(steps=0, prepare_seconds=0.0, launch_seconds=0.0,
                      readback_seconds=0.0, advance_seconds=0.0)
    assert all(math.isnan(ms) for ms in parts.mean_ms().values())


def test_the_printed_line_names_both_kinds() -> None:
    summary: dict[str, float] = {f"run_steps_{k}": n for k, n in (("prefill", 7),
                                                                   ("decode", 3))}
    summary |= {f"run_step_{k}_{p}_ms": 1.5 for k in ("prefill", "decode")
                for p in ("prepare", "launch", "readback", "advance")}
    line = step_parts_line(summary, "run_")
    assert "7 prefill steps" in line and "3 decode steps" in line and "\n" not in line
