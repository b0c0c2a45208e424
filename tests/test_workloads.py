"""Workload generators: deterministic from their seed, shaped as configured, closed-loop chat."""

from __future__ import annotations

import itertools
import statistics
from array import array

import pytest

from models.workloads import (
    ChatSession,
    ChatWorkload,
    ChatWorkloadConfig,
    RagWorkload,
    RagWorkloadConfig,
    Workload,
    WorkloadRequest,
)
from statekv.errors import ConfigError, UsageError

VOCAB = 300


def chat_config(**overrides: object) -> ChatWorkloadConfig:
    kw: dict[str, object] = {
        "num_users": 4, "num_rounds": 3, "system_prompt_tokens": 40, "question_tokens": 7,
        "answer_tokens": 5, "arrival_rate": 20.0, "vocab_size": VOCAB, "seed": 1,
        "user_history_tokens": 9,
    }
    kw.update(overrides)
    return ChatWorkloadConfig(**kw)  # type: ignore[arg-type]


def rag_config(**overrides: object) -> RagWorkloadConfig:
    kw: dict[str, object] = {
        "num_documents": 6, "document_tokens": 32, "num_requests": 40, "question_tokens": 8,
        "answer_tokens": 4, "arrival_rate": 50.0, "vocab_size": VOCAB, "seed": 2,
        "documents_per_request": 2, "system_prompt_tokens": 10,
    }
    kw.update(overrides)
    return RagWorkloadConfig(**kw)  # type: ignore[arg-type]


def answer_for(request: WorkloadRequest, n: int) -> list[int]:
    # Stands in for the model: any deterministic function of the prompt.
    return [(sum(request.prompt) + i) % VOCAB for i in range(n)]


def drive(workload: Workload, *, service_time: float, answer_len: int) -> list[WorkloadRequest]:
    """Serve every request `service_time` after it arrives; return requests in issue order."""
    issued: list[WorkloadRequest] = []
    finishing: list[tuple[float, WorkloadRequest]] = []
    now = 0.0
    while not workload.done():
        candidates = [t for t, _ in finishing]
        nxt = workload.next_arrival()
        if nxt is not None:
            candidates.append(nxt)
        now = max(now, min(candidates))
        for request in workload.poll(now):
            assert request.arrival <= now
            issued.append(request)
            finishing.append((now + service_time, request))
        for t, request in sorted(finishing, key=lambda f: f[0]):
            if t <= now:
                workload.complete(request.request_id, answer_for(request, answer_len), now=now)
        finishing = [(t, r) for t, r in finishing if t > now]
    return issued


# ---------------------------------------------------------------------------- chat


def test_chat_is_deterministic_from_its_seed() -> None:
    a = drive(ChatWorkload(chat_config()), service_time=0.05, answer_len=5)
    b = drive(ChatWorkload(chat_config()), service_time=0.05, answer_len=5)
    c = drive(ChatWorkload(chat_config(seed=2)), service_time=0.05, answer_len=5)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len(a) == 12 and len({r.request_id for r in a}) == 12


def test_chat_prompts_grow_by_answer_and_question() -> None:
    cfg = chat_config()
    workload = ChatWorkload(cfg)
    issued = drive(workload, service_time=0.05, answer_len=5)
    by_user: dict[int, list[WorkloadRequest]] = {}
    for r in issued:
        assert r.user is not None
        by_user.setdefault(r.user, []).append(r)
    system = workload.system_prompt
    assert len(system) == cfg.system_prompt_tokens
    for rounds in by_user.values():
        assert [r.round for r in rounds] == [0, 1, 2]
        first = rounds[0].prompt
        assert first[: len(system)] == system  # shared by every user
        assert len(first) == 40 + 9 + 7
        for prev, cur in itertools.pairwise(rounds):
            answer = tuple(answer_for(prev, 5))
            assert cur.prompt[: len(prev.prompt)] == prev.prompt
            assert cur.prompt[len(prev.prompt) : len(prev.prompt) + 5] == answer
            assert len(cur.prompt) == len(prev.prompt) + 5 + 7
        assert all(0 <= t < VOCAB for r in rounds for t in r.prompt)
        assert all(r.max_new_tokens == 5 for r in rounds)
    # Different users have different histories after the system prompt.
    firsts = {by_user[u][0].prompt[40:] for u in by_user}
    assert len(firsts) == cfg.num_users


def test_chat_round_waits_for_the_previous_answer() -> None:
    workload = ChatWorkload(chat_config(num_users=1, num_rounds=2, arrival_rate=1000.0))
    (first,) = workload.poll(10.0)
    assert workload.poll(10.0) == []  # round 1 is due, but round 0 is unanswered
    assert workload.next_arrival() is None
    workload.complete(first.request_id, [1, 2, 3], now=12.5)
    (second,) = workload.poll(12.5)
    assert second.arrival == 12.5 and second.round == 1
    assert second.prompt[len(first.prompt) : len(first.prompt) + 3] == (1, 2, 3)
    with pytest.raises(UsageError) as info:
        workload.complete(first.request_id, [1], now=13.0)
    assert info.value.field == "request_id"
    with pytest.raises(UsageError) as info:
        workload.complete(second.request_id, [VOCAB], now=13.0)
    assert info.value.field == "answer"
    workload.complete(second.request_id, [], now=13.0)
    assert workload.done()


def test_chat_arrivals_are_poisson_at_the_configured_rate() -> None:
    workload = ChatWorkload(chat_config(num_users=50, num_rounds=1, arrival_rate=100.0,
                                        system_prompt_tokens=1, user_history_tokens=0))
    arrivals = [r.arrival for r in workload.poll(1e9)]
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert 0.005 < statistics.mean(gaps) < 0.02  # 1/rate = 0.01 s, 50 samples
    assert statistics.stdev(gaps) > 0.003  # exponential, not a fixed interval


def test_chat_request_options() -> None:
    cfg = chat_config(ttl_seconds=600.0, retained_fraction=0.5, priority=2, per_user_salt=True)
    requests = ChatWorkload(cfg, name="t").poll(1e9)
    assert sum(r.ttl_seconds == 600.0 for r in requests) == 2
    assert all(r.ttl_seconds in (None, 600.0) for r in requests)
    assert all(r.priority == 2 for r in requests)
    assert sorted(r.cache_salt or "" for r in requests) == [f"t-user-{u}" for u in range(4)]
    assert {r.request_id for r in requests} == {f"t-u{u}-r0" for u in range(4)}
    assert all(r.cache_salt is None for r in ChatWorkload(chat_config()).poll(1e9))


def test_chat_session_takes_the_previous_answer() -> None:
    cfg = chat_config(num_rounds=2)
    session = ChatSession(cfg, 0, array("I", [1, 2, 3]))
    with pytest.raises(UsageError) as info:
        session.next_prompt([4])
    assert info.value.field == "previous_answer"
    first = session.next_prompt(None)
    assert first[:3] == (1, 2, 3) and len(first) == 3 + 9 + 7
    with pytest.raises(UsageError):
        session.next_prompt(None)
    second = session.next_prompt([8, 9])
    assert second[: len(first) + 2] == (*first, 8, 9)
    with pytest.raises(UsageError) as info:
        session.next_prompt([1])
    assert info.value.field == "user"


# ---------------------------------------------------------------------------- RAG


def test_rag_is_deterministic_and_shaped() -> None:
    cfg = rag_config()
    a = drive(RagWorkload(cfg), service_time=0.01, answer_len=4)
    b = drive(RagWorkload(cfg), service_time=0.01, answer_len=4)
    assert a == b
    assert a != drive(RagWorkload(rag_config(seed=3)), service_time=0.01, answer_len=4)
    workload = RagWorkload(cfg)
    for r in a:
        assert len(r.documents) == 2 and len(set(r.documents)) == 2
        expected = workload.system_prompt
        for d in r.documents:
            expected += workload.document(d)
        assert r.prompt[: len(expected)] == expected
        assert len(r.prompt) == 10 + 2 * 32 + 8
        assert all(0 <= t < VOCAB for t in r.prompt)
        assert r.max_new_tokens == 4 and r.user is None and r.round is None
    assert len(workload.document(0)) == 32
    assert workload.document(0) != workload.document(1)


def test_rag_popularity_is_skewed() -> None:
    requests = RagWorkload(rag_config(num_requests=400, documents_per_request=1,
                                      popularity_skew=1.5)).poll(1e9)
    counts = [sum(r.documents == (d,) for r in requests) for d in range(6)]
    assert counts[0] > counts[1] > counts[5]
    uniform = RagWorkload(rag_config(num_requests=400, documents_per_request=1,
                                     popularity_skew=0.0)).poll(1e9)
    assert min(sum(r.documents == (d,) for r in uniform) for d in range(6)) > 30


def test_rag_is_open_loop_and_needs_completions() -> None:
    workload = RagWorkload(rag_config(num_requests=3, arrival_rate=1.0))
    requests = workload.poll(1e9)
    assert len(requests) == 3 and workload.next_arrival() is None
    assert not workload.done()
    for r in requests:
        workload.complete(r.request_id, [0], now=1.0)
    assert workload.done()
    with pytest.raises(UsageError):
        workload.complete(requests[0].request_id, [0], now=1.0)
    with pytest.raises(UsageError) as info:
        workload.document(6)
    assert info.value.field == "index"


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_users": 0}, "num_users"),
        ({"arrival_rate": 0.0}, "arrival_rate"),
        ({"arrival_rate": float("inf")}, "arrival_rate"),
        ({"ttl_seconds": -5.0}, "ttl_seconds"),
        ({"ttl_seconds": float("nan")}, "ttl_seconds"),
        ({"retained_fraction": 1.5}, "retained_fraction"),
        ({"per_user_salt": 1}, "per_user_salt"),
        ({"seed": -1}, "seed"),
        ({"question_tokens": 0}, "question_tokens"),
    ],
)
def test_bad_chat_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        chat_config(**overrides)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"documents_per_request": 7}, "documents_per_request"),
        ({"popularity_skew": -1.0}, "popularity_skew"),
        ({"cache_salt": 3}, "cache_salt"),
        ({"document_tokens": 0}, "document_tokens"),
    ],
)
def test_bad_rag_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        rag_config(**overrides)
    assert info.value.field == field


def test_bad_poll_time_and_name_are_refused() -> None:
    with pytest.raises(UsageError) as info:
        ChatWorkload(chat_config()).poll(float("nan"))
    assert info.value.field == "now"
    with pytest.raises(ConfigError) as config_info:
        RagWorkload(rag_config(), name="")
    assert config_info.value.field == "name"


# ---------------------------------------------------------------------------- open-loop chat


def test_open_chat_arrivals_do_not_wait_on_answers() -> None:
    from models.workloads import OpenChatWorkload

    cfg = chat_config(num_users=3, num_rounds=2)
    fast, slow = (OpenChatWorkload(cfg, num_requests=12) for _ in range(2))
    assert fast.arrival_times == slow.arrival_times  # seeded, fixed before the run
    end = fast.arrival_times[-1]
    # `fast` answers each request at once; `slow` never answers: arrivals come on time anyway.
    got_fast = []
    for t in fast.arrival_times:
        for r in fast.poll(t):
            got_fast.append(r)
            fast.complete(r.request_id, [1, 2], now=t)
    got_slow = slow.poll(end)
    assert [r.arrival for r in got_fast] == [r.arrival for r in got_slow] == list(
        fast.arrival_times)
    assert fast.done() and not slow.done()
    # Round-robin over the pool while the server keeps up; initial user i plays 2 - i % 2
    # rounds, and a user who asked its last round is replaced at the back.
    assert [(r.user, r.round) for r in got_fast[:6]] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (3, 0), (2, 1)]
    assert fast.busy_skips == 0 and fast.joined_for_load == 0
    # Nobody answers: no user ever has two rounds in flight; new users join instead.
    assert all(r.round == 0 for r in got_slow)
    # the pool of 3 and the replacement of user 1 (one round) ask first, then 8 join
    assert len({r.user for r in got_slow}) == 12 and slow.joined_for_load == 12 - 4
    with pytest.raises(ConfigError):
        OpenChatWorkload(cfg, num_requests=0)


def test_a_continued_open_chat_goes_on_with_the_same_conversations() -> None:
    from models.workloads import OpenChatWorkload

    cfg = chat_config(num_users=3, num_rounds=3)
    first = OpenChatWorkload(cfg, num_requests=3)
    issued = []
    for t in first.arrival_times:
        for r in first.poll(t):
            issued.append(r)
            first.complete(r.request_id, [5, 6], now=t)
    assert first.done()
    slow, fast = (first.continued(arrival_rate=rate, num_requests=6) for rate in (1.0, 4.0))
    # The same draws at every rate, scaled, timed from 0; the original is untouched.
    assert fast.arrival_times == pytest.approx([t / 4 for t in slow.arrival_times])
    assert first.done() and first.total_requests == 3 and slow.total_requests == 6
    got = []
    for t in slow.arrival_times:
        for r in slow.poll(t):
            got.append(r)
            slow.complete(r.request_id, [7], now=t)
    assert slow.done() and slow.busy_skips == 0
    # The users' next rounds, their prompts extending what they asked and were answered.
    assert [(r.user, r.round) for r in got[:2]] == [(0, 1), (1, 1)]
    assert got[0].prompt[:len(issued[0].prompt) + 2] == (*issued[0].prompt, 5, 6)
    # Another seed, another schedule; unanswered requests cannot be continued.
    other = OpenChatWorkload(chat_config(num_users=3, num_rounds=3, seed=9), num_requests=3)
    for t in other.arrival_times:
        for r in other.poll(t):
            other.complete(r.request_id, [5], now=t)
    assert other.continued(arrival_rate=1.0, num_requests=6).arrival_times != \
        slow.arrival_times
    pending = OpenChatWorkload(cfg, num_requests=3)
    pending.poll(pending.arrival_times[0])
    with pytest.raises(UsageError) as info:
        pending.continued(arrival_rate=1.0, num_requests=2)
    assert info.value.field == "continued"
    with pytest.raises(ConfigError):
        first.continued(arrival_rate=1.0, num_requests=0)
