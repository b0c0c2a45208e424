"""Per-request sampling in the serving loop (models/sampling.py): draws, stop sequences."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from models.config import preset
from models.model import PagedDecoder
from models.sampling import LOGPROB_FLOOR, Sampling, logprob_of, new_generator, sample
from models.serving_loop import RequestResult, ServeRequest, ServingLoop
from statekv.errors import UsageError


@pytest.mark.parametrize(("fields", "field"), [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"logprobs": -1}, "logprobs"),
])
def test_a_bad_sampling_value_is_a_usage_error_naming_it(
    fields: dict[str, object], field: str,
) -> None:
    with pytest.raises(UsageError) as raised:
        Sampling(**fields)  # type: ignore[arg-type]
    assert raised.value.field == field


def test_draws_follow_the_seed_and_a_tiny_top_p_is_the_arg_max() -> None:
    logits = torch.tensor([0.0, 2.0, 2.0, 1.0, -1.0])
    hot = Sampling(temperature=5.0, seed=9)

    def draws(sampling: Sampling) -> list[int]:
        generator = new_generator(sampling, torch.device("cpu"))
        return [sample(logits, sampling, generator) for _ in range(64)]

    assert draws(hot) == draws(hot)
    assert draws(hot) != draws(Sampling(temperature=5.0, seed=10))
    assert len(set(draws(hot))) == 5  # hot enough to reach every token
    # The nucleus keeps the likeliest token, the lowest id among equals, as greedy does.
    assert set(draws(Sampling(temperature=5.0, top_p=1e-9, seed=9))) == {1}
    # At temperature 5 the probabilities are .248, .248, .203, .166, .136: the two likeliest
    # hold .496, so a top_p of .45 keeps those two and one of .5 a third.
    assert set(draws(Sampling(temperature=5.0, top_p=0.45, seed=9))) == {1, 2}
    assert set(draws(Sampling(temperature=5.0, top_p=0.5, seed=9))) == {1, 2, 3}
    with pytest.raises(UsageError):
        sample(logits, Sampling(), new_generator(Sampling(), torch.device("cpu")))


def test_logprobs_are_the_models_and_finite() -> None:
    logits = torch.tensor([0.0, math.log(3.0), -math.inf])
    entry = logprob_of(logits, 0, 2)
    assert entry.logprob == pytest.approx(math.log(0.25))
    assert [token for token, _logprob in entry.top] == [1, 0]
    assert [logprob for _token, logprob in entry.top] == pytest.approx(
        [math.log(0.75), math.log(0.25)])
    assert logprob_of(logits, 2, 0).logprob == LOGPROB_FLOOR  # JSON has no -inf


def run(tmp_path: Path, requests: list[ServeRequest]) -> dict[str, RequestResult]:
    model = PagedDecoder(preset("tiny"), device="cpu")
    config = StateKVConfig(layout=model.config.kv_layout(), block_size=4, gpu=64, host=2,
                           reserved_host=2, disk=32, disk_dir=tmp_path, device="cpu",
                           model_fingerprint=model.config.fingerprint())
    with BlockingCache(config) as cache:
        # batch_invariant: a request's numerics do not depend on what shares its batches.
        loop = ServingLoop(model, cache, batch_invariant=True)
        for request in requests:
            loop.submit(request)
        results = {result.request_id: result for result in loop.drain(timeout=300)}
        assert cache.statistics().cache.requests_released == len(requests)
    return results


def test_sampled_requests_leave_the_greedy_ones_in_their_batch_alone(tmp_path: Path) -> None:
    prompt = tuple(range(20, 40))
    alone = run(tmp_path / "a", [ServeRequest(request_id="g", prompt=prompt,
                                              max_new_tokens=12)])["g"]
    mixed = run(tmp_path / "b", [
        ServeRequest(request_id="g", prompt=prompt, max_new_tokens=12),
        ServeRequest(request_id="s", prompt=prompt, max_new_tokens=12,
                     sampling=Sampling(temperature=1.0, seed=1, logprobs=2)),
        ServeRequest(request_id="l", prompt=prompt, max_new_tokens=12,
                     sampling=Sampling(logprobs=1)),
    ])
    assert mixed["g"].output == alone.output and mixed["g"].logprobs is None
    assert mixed["s"].output != alone.output
    assert mixed["l"].output == alone.output  # logprobs alone: still greedy
    assert [entry.token for entry in mixed["l"].logprobs or []] == alone.output
    assert len(mixed["s"].logprobs or []) == 12


def test_a_stop_sequence_ends_the_request_and_is_not_its_answer(tmp_path: Path) -> None:
    prompt = tuple(range(50, 70))
    free = run(tmp_path / "a", [ServeRequest(request_id="r", prompt=prompt,
                                             max_new_tokens=16)])["r"]
    assert free.finish_reason == "length" and free.answer == free.output
    stop = tuple(free.output[5:7])
    first = next(i for i in range(15) if tuple(free.output[i:i + 2]) == stop)
    stopped = run(tmp_path / "b", [ServeRequest(request_id="r", prompt=prompt,
                                                max_new_tokens=16,
                                                stop=(stop, (999,)))])["r"]
    assert stopped.output == free.output[:first + 2]
    assert stopped.answer == free.output[:first]
    assert (stopped.finish_reason, stopped.stop_tokens) == ("stop", 2)
    # Of two stops the output ends with, the longer counts (its text starts first).
    both = run(tmp_path / "c", [ServeRequest(request_id="r", prompt=prompt,
                                             max_new_tokens=16,
                                             stop=(stop[1:], stop))])["r"]
    assert both.stop_tokens == 2 and both.answer == stopped.answer


def test_an_empty_stop_sequence_is_refused(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    config = StateKVConfig(layout=model.config.kv_layout(), block_size=4, gpu=16, host=2,
                           reserved_host=2, disk=32, disk_dir=tmp_path, device="cpu",
                           model_fingerprint=model.config.fingerprint())
    with BlockingCache(config) as cache:
        loop = ServingLoop(model, cache)
        with pytest.raises(UsageError) as raised:
            loop.submit(ServeRequest(request_id="r", prompt=(1,), max_new_tokens=2,
                                     stop=((),)))
        assert raised.value.field == "stop"
