"""Workload generators: multi-round chat (LMBenchmark-style) and shared-document RAG.

Both are deterministic functions of their config and seed, and both speak one small protocol
(:class:`Workload`) that a serving loop drives with its own clock, in seconds from the
workload's start::

    while not workload.done():
        for request in workload.poll(now):       # every request that has arrived by `now`
            ...add_request(request.request_id, request.prompt, ttl_seconds=..., ...)
        ...serve; when a request has produced its answer:
        workload.complete(request.request_id, answer_tokens, now=now)

Multi-round chat is *closed loop*, as in LMBenchmark's synthetic multi-round QA: the next
round of a user is its previous prompt, the answer the model produced, and a new question,
so it cannot be issued before that answer is complete.  A seeded Poisson process schedules
rounds (round-robin over users); a round whose user is still waiting for its previous answer
arrives when that answer completes.  RAG is *open loop*: every request is known up front.

:class:`OpenChatWorkload` is the same chat with *open-loop arrivals*, as vLLM's serving
benchmark offers load: arrival times are a seeded Poisson process fixed in advance, and each
arrival is given to a user who is free (its previous answer is complete), so a user's rounds
never overlap and yet no arrival waits on the server; when no user is free, a new user joins.
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import math
import random
from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from statekv.errors import ConfigError, UsageError

# ---------------------------------------------------------------------------- validation


def _int_at_least(low: int) -> Any:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(attribute.name, f"must be an integer, got {value!r}")
        if value < low:
            raise ConfigError(attribute.name, f"must be >= {low}, got {value}")

    return check


def _check_rate(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(attribute.name, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(attribute.name, f"must be finite and > 0 (per second), got {value!r}")


def _check_ttl(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(attribute.name, f"must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(attribute.name, f"must be finite and > 0, or None, got {value!r}")


def _check_fraction(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(attribute.name, f"must be a number, got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ConfigError(attribute.name, f"must be in [0, 1], got {value!r}")


def _check_salt(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(attribute.name, f"must be a string or None, got {value!r}")


_MAX_SKEW = 8.0
"""Beyond this, the weights of unpopular documents underflow to 0 in large corpora."""


def _check_skew(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(attribute.name, f"must be a number, got {value!r}")
    if not 0 <= value <= _MAX_SKEW:
        raise ConfigError(attribute.name, f"must be in [0, {_MAX_SKEW}], got {value!r}")


def _check_seed(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(attribute.name, f"must be an integer >= 0, got {value!r}")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError("name", f"must be a non-empty string, got {name!r}")
    return name


def _rng(seed: int, *tag: object) -> random.Random:
    # A named stream per purpose: changing how many tokens one part draws never shifts
    # another part's tokens.  (random.Random hashes a bytes seed with sha512: stable across
    # processes, unlike hash().)
    key = ":".join(str(t) for t in (seed, *tag)).encode()
    return random.Random(hashlib.blake2b(key, digest_size=16).digest())


def _tokens(rng: random.Random, n: int, vocab_size: int) -> array[int]:
    return array("I", (rng.randrange(vocab_size) for _ in range(n)))


def _check_answer(answer: object, vocab_size: int) -> array[int]:
    if isinstance(answer, str | bytes) or not isinstance(answer, Sequence):
        raise UsageError("answer", "must be a sequence of integer token ids")
    for t in answer:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise UsageError("answer", f"token {t!r} is not an id in [0, {vocab_size})")
    return array("I", answer)


def _check_now(now: object) -> float:
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise UsageError("now", f"must be a finite number of seconds, got {now!r}")
    return float(now)


# ---------------------------------------------------------------------------- records


@attrs.frozen(kw_only=True)
class WorkloadRequest:
    """One request as the serving loop receives it."""

    request_id: str
    arrival: float
    """Seconds from the workload's start at which the request arrived."""
    prompt: tuple[int, ...]
    max_new_tokens: int
    ttl_seconds: float | None
    priority: int
    cache_salt: str | None
    user: int | None = None
    """Chat: the user (conversation) it belongs to."""
    round: int | None = None
    """Chat: 0 for a conversation's first request."""
    documents: tuple[int, ...] = ()
    """RAG: the documents in the prompt, in order."""


class Workload(Protocol):
    """What a serving loop drives; see the module docstring."""

    def poll(self, now: float) -> list[WorkloadRequest]:
        """Requests that arrived by `now` and were not returned before, by arrival time."""
        ...

    def complete(self, request_id: str, answer: Sequence[int], *, now: float) -> None:
        """The request's answer is complete (closed-loop workloads build on it)."""
        ...

    def next_arrival(self) -> float | None:
        """When the next request arrives if nothing else completes; None if none is due."""
        ...

    def done(self) -> bool:
        """Every request was issued and completed."""
        ...


# ---------------------------------------------------------------------------- chat


@attrs.frozen(kw_only=True)
class ChatWorkloadConfig:
    """LMBenchmark-style synthetic multi-round QA."""

    num_users: int = attrs.field(validator=_int_at_least(1))
    num_rounds: int = attrs.field(validator=_int_at_least(1))
    system_prompt_tokens: int = attrs.field(validator=_int_at_least(0))
    """S: shared by every user (a reusable prefix across conversations)."""
    question_tokens: int = attrs.field(validator=_int_at_least(1))
    """Q: new user text per round."""
    answer_tokens: int = attrs.field(validator=_int_at_least(1))
    """A: tokens the model generates per round (max_new_tokens)."""
    arrival_rate: float = attrs.field(validator=_check_rate)
    """Requests per second of the Poisson schedule, over all users."""
    vocab_size: int = attrs.field(validator=_int_at_least(1))
    seed: int = attrs.field(default=0, validator=_check_seed)
    user_history_tokens: int = attrs.field(default=0, validator=_int_at_least(0))
    """Per-user context after the system prompt (LMBenchmark's user-specific history)."""
    ttl_seconds: float | None = attrs.field(default=None, validator=_check_ttl)
    retained_fraction: float = attrs.field(default=1.0, validator=_check_fraction)
    """Share of users (chosen by the seed) whose requests carry `ttl_seconds`."""
    priority: int = attrs.field(default=0, validator=_int_at_least(0))
    per_user_salt: bool = attrs.field(default=False)
    """Give each user its own cache_salt (a tenant each: nothing is shared across users,
    not even the system prompt)."""

    @per_user_salt.validator
    def _check_bool(self, _attribute: attrs.Attribute[bool], value: object) -> None:
        if not isinstance(value, bool):
            raise ConfigError("per_user_salt", f"must be True or False, got {value!r}")


class ChatSession:
    """One user's conversation: its growing context, one prompt per round."""

    def __init__(self, config: ChatWorkloadConfig, user: int, system_prompt: array[int], *,
                 rounds: int | None = None, any_user: bool = False) -> None:
        """`rounds`: this conversation's length (default the config's num_rounds);
        `any_user`: the user id may lie beyond num_users (an open pool's joining users)."""
        if not isinstance(config, ChatWorkloadConfig):
            raise ConfigError("config", f"must be a ChatWorkloadConfig, got {config!r}")
        if isinstance(user, bool) or not isinstance(user, int) or user < 0 or (
            not any_user and user >= config.num_users
        ):
            raise ConfigError("user", f"must be in [0, {config.num_users}), got {user!r}")
        if rounds is None:
            rounds = config.num_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not (
            1 <= rounds <= config.num_rounds
        ):
            raise ConfigError("rounds", f"must be in [1, {config.num_rounds}], got {rounds!r}")
        self.config = config
        self.user = user
        self.num_rounds = rounds
        self._context = array("I", system_prompt)
        self._context.extend(
            _tokens(_rng(config.seed, "history", user), config.user_history_tokens,
                    config.vocab_size)
        )
        self.rounds_issued = 0
        self._awaiting_answer = False

    @property
    def rounds_left(self) -> int:
        return self.num_rounds - self.rounds_issued

    @property
    def awaiting_answer(self) -> bool:
        return self._awaiting_answer

    def next_prompt(self, previous_answer: Sequence[int] | None) -> tuple[int, ...]:
        """The prompt of the next round: the context so far, the answer, a new question.

        Round 0 takes no answer (None); every later round takes the answer the model gave to
        the previous one.
        """
        c = self.config
        if self.rounds_left == 0:
            raise UsageError("user", f"user {self.user} has no rounds left ({self.num_rounds})")
        if self.rounds_issued == 0:
            if previous_answer is not None:
                raise UsageError("previous_answer", "round 0 has no previous answer: pass None")
        else:
            if previous_answer is None:
                raise UsageError(
                    "previous_answer",
                    f"round {self.rounds_issued} of user {self.user} builds on the answer "
                    "to the previous round",
                )
            self._context.extend(_check_answer(previous_answer, c.vocab_size))
        question = _tokens(
            _rng(c.seed, "question", self.user, self.rounds_issued), c.question_tokens,
            c.vocab_size,
        )
        self._context.extend(question)
        self.rounds_issued += 1
        self._awaiting_answer = True
        return tuple(self._context)

    def answered(self) -> None:
        self._awaiting_answer = False


class ChatWorkload:
    """Closed-loop multi-round chat over `num_users` sessions; implements Workload."""

    def __init__(self, config: ChatWorkloadConfig, *, name: str = "chat") -> None:
        if not isinstance(config, ChatWorkloadConfig):
            raise ConfigError("config", f"must be a ChatWorkloadConfig, got {config!r}")
        self.config = config
        self.name = _check_name(name)
        c = config
        self.system_prompt: tuple[int, ...] = tuple(
            _tokens(_rng(c.seed, "system"), c.system_prompt_tokens, c.vocab_size)
        )
        system = array("I", self.system_prompt)
        self.sessions = [ChatSession(c, u, system) for u in range(c.num_users)]
        # The Poisson schedule: slot k (exponential gaps) belongs to round k // U of user k % U.
        arrivals = _rng(c.seed, "arrivals")
        t = 0.0
        self._schedule: list[list[float]] = [[] for _ in range(c.num_users)]
        for k in range(c.num_users * c.num_rounds):
            t += arrivals.expovariate(c.arrival_rate)
            self._schedule[k % c.num_users].append(t)
        order = list(range(c.num_users))
        _rng(c.seed, "retained").shuffle(order)
        retained = set(order[: round(c.retained_fraction * c.num_users)])
        self._ttl = [c.ttl_seconds if u in retained else None for u in range(c.num_users)]
        self._due: list[tuple[float, int]] = [(s[0], u) for u, s in enumerate(self._schedule)]
        heapq.heapify(self._due)
        self._answers: list[array[int] | None] = [None] * c.num_users
        self._in_flight: dict[str, int] = {}
        self._completed = 0

    @property
    def total_requests(self) -> int:
        return self.config.num_users * self.config.num_rounds

    def request_id(self, user: int, round_: int) -> str:
        return f"{self.name}-u{user}-r{round_}"

    def poll(self, now: float) -> list[WorkloadRequest]:
        now = _check_now(now)
        c = self.config
        out: list[WorkloadRequest] = []
        while self._due and self._due[0][0] <= now:
            arrival, user = heapq.heappop(self._due)
            session = self.sessions[user]
            round_ = session.rounds_issued
            prompt = session.next_prompt(self._answers[user])
            rid = self.request_id(user, round_)
            self._in_flight[rid] = user
            out.append(WorkloadRequest(
                request_id=rid, arrival=arrival, prompt=prompt, max_new_tokens=c.answer_tokens,
                ttl_seconds=self._ttl[user], priority=c.priority,
                cache_salt=f"{self.name}-user-{user}" if c.per_user_salt else None,
                user=user, round=round_,
            ))
        return out

    def complete(self, request_id: str, answer: Sequence[int], *, now: float) -> None:
        now = _check_now(now)
        user = self._in_flight.get(request_id)
        if user is None:
            raise UsageError("request_id", f"{request_id!r} is not an issued, unanswered request")
        tokens = _check_answer(answer, self.config.vocab_size)
        del self._in_flight[request_id]
        session = self.sessions[user]
        session.answered()
        self._answers[user] = tokens
        self._completed += 1
        if session.rounds_left:
            scheduled = self._schedule[user][session.rounds_issued]
            heapq.heappush(self._due, (max(scheduled, now), user))

    def next_arrival(self) -> float | None:
        return self._due[0][0] if self._due else None

    def done(self) -> bool:
        return self._completed == self.total_requests


class OpenChatWorkload:
    """Multi-round chat with open-loop arrivals; implements Workload.

    `num_requests` arrival times are drawn up front from a seeded Poisson process at the
    config's `arrival_rate`, independent of completions, so the load offered is the load
    served whenever the server keeps up, and keeps arriving when it does not.

    Who asks: a queue of users ordered by when each last asked (the initial pool of
    `num_users` first, by id).  An arrival goes to the first user in the queue whose previous
    answer is complete, and that user moves to the back: round-robin over the pool, as
    LMBenchmark's users take turns, while the server keeps up.  The order depends only on the
    arrival schedule, so every server that keeps up sees the same requests; a user passed
    over because it still waits for an answer is counted (`busy_skips`).  When every user
    waits, a new user joins and asks its first round (`joined_for_load`): sessions grow under
    overload, as they do when users keep arriving at a busy service.  A user who asked its
    last round leaves and a new user takes its place at the back, so the pool keeps its size.

    Initial user i plays ``num_rounds - i % num_rounds`` rounds (later users all of them), so
    that users leave and join at an even pace instead of in waves of the whole pool.
    """

    def __init__(self, config: ChatWorkloadConfig, *, num_requests: int,
                 name: str = "chat") -> None:
        if not isinstance(config, ChatWorkloadConfig):
            raise ConfigError("config", f"must be a ChatWorkloadConfig, got {config!r}")
        if isinstance(num_requests, bool) or not isinstance(num_requests, int) \
                or num_requests < 1:
            raise ConfigError("num_requests", f"must be an integer >= 1, got {num_requests!r}")
        self.config = config
        self.name = _check_name(name)
        c = config
        self.system_prompt: tuple[int, ...] = tuple(
            _tokens(_rng(c.seed, "system"), c.system_prompt_tokens, c.vocab_size)
        )
        self._system = array("I", self.system_prompt)
        rng = _rng(c.seed, "open-arrivals")
        t = 0.0
        times: list[float] = []
        for _ in range(num_requests):
            t += rng.expovariate(c.arrival_rate)
            times.append(t)
        self.arrival_times: tuple[float, ...] = tuple(times)
        """When each request arrives, in seconds from the start: the schedule."""
        self._sessions: dict[int, ChatSession] = {}
        self._queue: list[int] = []
        for u in range(c.num_users):
            self._join(u, rounds=c.num_rounds - u % c.num_rounds)
        self._next_user = c.num_users
        self._busy: set[int] = set()
        self._answers: dict[int, array[int]] = {}
        self._in_flight: dict[str, int] = {}
        self._next = 0
        self._completed = 0
        self.busy_skips = 0
        """Arrivals that passed over the longest-waiting user because it was still waiting
        for an answer (0 whenever the server keeps up)."""
        self.joined_for_load = 0
        """Users that joined because every user was waiting for an answer."""
        self.users_started = 0
        """Users that asked at least one round."""

    def continued(self, *, arrival_rate: float, num_requests: int) -> OpenChatWorkload:
        """A copy of this workload, with every request it issued answered, that offers
        `num_requests` more arrivals at `arrival_rate` per second, timed from 0: the same
        users, conversations and queue as now, so a server whose cache served this workload
        (a disk tier persisted at its close, say) goes on from where it stopped.

        The new arrival times are a seeded Poisson process of their own (the seed and the
        requests issued before), the same draws at every rate, scaled; the counters start
        from 0.
        """
        if self._in_flight:
            raise UsageError("continued", f"{len(self._in_flight)} requests are unanswered")
        if isinstance(num_requests, bool) or not isinstance(num_requests, int) \
                or num_requests < 1:
            raise ConfigError("num_requests", f"must be an integer >= 1, got {num_requests!r}")
        config = attrs.evolve(self.config, arrival_rate=arrival_rate)
        rng = _rng(config.seed, "open-arrivals-continued", self._next)
        t = 0.0
        times: list[float] = []
        for _ in range(num_requests):
            t += rng.expovariate(config.arrival_rate)
            times.append(t)
        other = copy.deepcopy(self)
        other.config = config
        other.arrival_times = tuple(times)
        other._next = other._completed = 0
        other.busy_skips = other.joined_for_load = other.users_started = 0
        return other

    def _join(self, user: int, *, rounds: int | None = None) -> None:
        self._sessions[user] = ChatSession(self.config, user, self._system, rounds=rounds,
                                           any_user=True)
        self._queue.append(user)

    @property
    def total_requests(self) -> int:
        return len(self.arrival_times)

    def request_id(self, user: int, round_: int) -> str:
        return f"{self.name}-u{user}-r{round_}"

    def _pick(self) -> int:
        for position, user in enumerate(self._queue):
            if user not in self._busy:
                if position:
                    self.busy_skips += 1
                del self._queue[position]
                return user
        self.joined_for_load += 1
        user = self._next_user
        self._next_user += 1
        self._sessions[user] = ChatSession(self.config, user, self._system, any_user=True)
        return user

    def poll(self, now: float) -> list[WorkloadRequest]:
        now = _check_now(now)
        c = self.config
        out: list[WorkloadRequest] = []
        while self._next < len(self.arrival_times) and self.arrival_times[self._next] <= now:
            arrival = self.arrival_times[self._next]
            self._next += 1
            user = self._pick()
            session = self._sessions[user]
            round_ = session.rounds_issued
            prompt = session.next_prompt(self._answers.pop(user, None))
            rid = self.request_id(user, round_)
            self._in_flight[rid] = user
            self._busy.add(user)
            self.users_started += round_ == 0
            if session.rounds_left:
                self._queue.append(user)
            else:  # its last round: a new user takes its place at the back
                self._join(self._next_user)
                self._next_user += 1
            out.append(WorkloadRequest(
                request_id=rid, arrival=arrival, prompt=prompt, max_new_tokens=c.answer_tokens,
                ttl_seconds=self._ttl(user), priority=c.priority,
                cache_salt=f"{self.name}-user-{user}" if c.per_user_salt else None,
                user=user, round=round_,
            ))
        return out

    def _ttl(self, user: int) -> float | None:
        # Per user, from the seed alone: users join without bound, so no shuffled list.
        c = self.config
        retained = _rng(c.seed, "retained", user).random() < c.retained_fraction
        return c.ttl_seconds if retained else None

    def complete(self, request_id: str, answer: Sequence[int], *, now: float) -> None:
        _check_now(now)
        user = self._in_flight.get(request_id)
        if user is None:
            raise UsageError("request_id", f"{request_id!r} is not an issued, unanswered request")
        tokens = _check_answer(answer, self.config.vocab_size)
        del self._in_flight[request_id]
        self._busy.discard(user)
        self._completed += 1
        session = self._sessions[user]
        session.answered()
        if session.rounds_left:
            self._answers[user] = tokens
        else:
            del self._sessions[user]  # done: its context is no longer needed

    def next_arrival(self) -> float | None:
        return self.arrival_times[self._next] if self._next < len(self.arrival_times) else None

    def done(self) -> bool:
        return self._completed == self.total_requests


# ---------------------------------------------------------------------------- RAG


@attrs.frozen(kw_only=True)
class RagWorkloadConfig:
    """Requests over a shared corpus: [system prompt] + documents + question."""

    num_documents: int = attrs.field(validator=_int_at_least(1))
    """D."""
    document_tokens: int = attrs.field(validator=_int_at_least(1))
    """L: tokens per document."""
    num_requests: int = attrs.field(validator=_int_at_least(1))
    question_tokens: int = attrs.field(validator=_int_at_least(1))
    answer_tokens: int = attrs.field(validator=_int_at_least(1))
    arrival_rate: float = attrs.field(validator=_check_rate)
    vocab_size: int = attrs.field(validator=_int_at_least(1))
    seed: int = attrs.field(default=0, validator=_check_seed)
    documents_per_request: int = attrs.field(default=1, validator=_int_at_least(1))
    system_prompt_tokens: int = attrs.field(default=0, validator=_int_at_least(0))
    popularity_skew: float = attrs.field(default=1.0, validator=_check_skew)
    """Zipf exponent of document popularity (0: uniform); document 0 is the most popular."""
    ttl_seconds: float | None = attrs.field(default=None, validator=_check_ttl)
    priority: int = attrs.field(default=0, validator=_int_at_least(0))
    cache_salt: str | None = attrs.field(default=None, validator=_check_salt)

    def __attrs_post_init__(self) -> None:
        if self.documents_per_request > self.num_documents:
            raise ConfigError(
                "documents_per_request",
                f"must be <= num_documents ({self.num_documents}), "
                f"got {self.documents_per_request}",
            )


class RagWorkload:
    """Open-loop requests over shared documents; implements Workload."""

    def __init__(self, config: RagWorkloadConfig, *, name: str = "rag") -> None:
        if not isinstance(config, RagWorkloadConfig):
            raise ConfigError("config", f"must be a RagWorkloadConfig, got {config!r}")
        self.config = config
        self.name = _check_name(name)
        c = config
        self._system = _tokens(_rng(c.seed, "system"), c.system_prompt_tokens, c.vocab_size)
        # array('I'): 4 bytes a token, where a tuple of ints would cost ~36.
        self._documents = [
            _tokens(_rng(c.seed, "document", d), c.document_tokens, c.vocab_size)
            for d in range(c.num_documents)
        ]
        weights = [1.0 / (d + 1) ** c.popularity_skew for d in range(c.num_documents)]
        picks = _rng(c.seed, "picks")
        arrivals = _rng(c.seed, "arrivals")
        t = 0.0
        self._plan: list[tuple[float, tuple[int, ...]]] = []
        for _ in range(c.num_requests):
            t += arrivals.expovariate(c.arrival_rate)
            self._plan.append((t, _sample_without_replacement(
                picks, weights, c.documents_per_request
            )))
        self._next = 0
        self._in_flight: set[str] = set()
        self._completed = 0

    @property
    def total_requests(self) -> int:
        return self.config.num_requests

    @property
    def system_prompt(self) -> tuple[int, ...]:
        return tuple(self._system)

    def document(self, index: int) -> tuple[int, ...]:
        if isinstance(index, bool) or not isinstance(index, int) or not (
            0 <= index < self.config.num_documents
        ):
            raise UsageError("index", f"must be in [0, {self.config.num_documents}), got {index!r}")
        return tuple(self._documents[index])

    def request_id(self, k: int) -> str:
        return f"{self.name}-{k}"

    def poll(self, now: float) -> list[WorkloadRequest]:
        now = _check_now(now)
        c = self.config
        out: list[WorkloadRequest] = []
        while self._next < len(self._plan) and self._plan[self._next][0] <= now:
            arrival, docs = self._plan[self._next]
            prompt = array("I", self._system)
            for d in docs:
                prompt.extend(self._documents[d])
            prompt.extend(_tokens(_rng(c.seed, "question", self._next), c.question_tokens,
                                  c.vocab_size))
            rid = self.request_id(self._next)
            self._in_flight.add(rid)
            out.append(WorkloadRequest(
                request_id=rid, arrival=arrival, prompt=tuple(prompt),
                max_new_tokens=c.answer_tokens, ttl_seconds=c.ttl_seconds, priority=c.priority,
                cache_salt=c.cache_salt, documents=docs,
            ))
            self._next += 1
        return out

    def complete(self, request_id: str, answer: Sequence[int], *, now: float) -> None:
        _check_now(now)
        if request_id not in self._in_flight:
            raise UsageError("request_id", f"{request_id!r} is not an issued, unanswered request")
        _check_answer(answer, self.config.vocab_size)
        self._in_flight.remove(request_id)
        self._completed += 1

    def next_arrival(self) -> float | None:
        return self._plan[self._next][0] if self._next < len(self._plan) else None

    def done(self) -> bool:
        return self._completed == self.total_requests


def _sample_without_replacement(
    rng: random.Random, weights: list[float], k: int
) -> tuple[int, ...]:
    chosen: list[int] = []
    w = list(weights)
    for _ in range(k):
        (pick,) = rng.choices(range(len(w)), weights=w)
        chosen.append(pick)
        w[pick] = 0.0
    return tuple(chosen)
