"""The serving loop on a thread of its own, fed by a thread-safe queue.

The continuous-batching loop (``statekv_models.serving_loop``) is synchronous and steps as
fast as it can; the HTTP server is an asyncio program.  They meet here: a request handler
calls :meth:`Engine.submit` (or :meth:`Engine.cancel`) from any thread, which puts a message
on the engine's inbox; the engine thread owns the loop (nothing else touches it) and tells
each request's :class:`TokenSink` what happened.  The sink decides how to cross back to its
own thread (the server's uses ``loop.call_soon_threadsafe``).  The cache below the loop is a
:class:`io_actors.BlockingCache`, thread-safe on its own, whose statistics any thread may read.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Final, Protocol

import attrs
from prometheus_client import Histogram

from io_actors.actors.scheduler import SystemStatistics
from io_actors.embed import BlockingCache

from ._models import model as model_module
from ._models import sampling as sampling_module
from ._models import serving_loop

IDLE_WAIT: Final = 0.05
"""Seconds the idle engine waits on its inbox before looking again (it wakes at once when a
message arrives; this only bounds how late it notices a stop)."""
PARKED_WAIT: Final = 0.0005
"""Seconds it sleeps when every request waits for disk reads (the loop never blocks on disk;
this keeps it from spinning)."""


LATENCY_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                          1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


class TokenSink(Protocol):
    """What the engine tells about one request; called on the engine thread."""

    def token(self, token: int, logprob: sampling_module.TokenLogprob | None) -> None: ...

    def finished(self, result: serving_loop.RequestResult) -> None: ...

    def failed(self, error: BaseException) -> None: ...


@attrs.frozen(kw_only=True)
class GenerateRequest:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    ttl_seconds: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    sampling: sampling_module.Sampling | None = None
    stop: tuple[tuple[int, ...], ...] = ()


@attrs.frozen(kw_only=True)
class EngineStatistics:
    loop: serving_loop.LoopStatistics
    requests: int
    """Requests submitted and neither finished nor cancelled (waiting, parked, running)."""
    cancelled: int
    """Requests cancelled before they finished (a client went away)."""
    failed: bool
    """The loop raised: every request then failed, and new ones are refused."""


@attrs.frozen
class _Submit:
    request: GenerateRequest
    sink: TokenSink


@attrs.frozen
class _Cancel:
    request_id: str


@attrs.frozen
class _Statistics:
    reply: Future[EngineStatistics]


class EngineStopped(RuntimeError):
    """The engine is stopped or its loop failed; no request is taken."""


class Engine:
    """Owns a ServingLoop on a thread; every public method is thread-safe."""

    def __init__(self, model: model_module.PagedDecoder, cache: BlockingCache, *,
                 max_running: int = 64, max_step_tokens: int = 512,
                 prefill_chunk: int = 256) -> None:
        self.cache = cache
        self._sinks: dict[str, TokenSink] = {}
        self._loop = serving_loop.ServingLoop(
            model, cache, max_running=max_running, max_step_tokens=max_step_tokens,
            prefill_chunk=prefill_chunk, on_token=self._on_token,
        )
        self._inbox: queue.SimpleQueue[_Submit | _Cancel | _Statistics] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._cancelled = 0
        # Observed on the engine thread as requests finish and steps end; read at scrape
        # time (prometheus-client's histograms are thread-safe).  Not on any registry: the
        # server's collector yields them.
        self.ttft = Histogram("statekv_serving_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.",
                              registry=None, buckets=LATENCY_BUCKETS)
        self.step_seconds = Histogram("statekv_serving_step_seconds",
                                      "Seconds of one step of the serving loop.",
                                      registry=None, buckets=LATENCY_BUCKETS)
        self._thread = threading.Thread(target=self._run, name="statekv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def submit(self, request: GenerateRequest, sink: TokenSink) -> None:
        if self._stop.is_set() or self._error is not None:
            raise EngineStopped("the engine is not running")
        self._inbox.put(_Submit(request, sink))

    def cancel(self, request_id: str) -> None:
        """Drop the request if it is still there (a no-op once it finished)."""
        self._inbox.put(_Cancel(request_id))

    def statistics(self, timeout: float | None = 30.0) -> EngineStatistics:
        """A snapshot taken by the engine thread between two steps."""
        if not self._thread.is_alive():
            return self._snapshot()
        reply: Future[EngineStatistics] = Future()
        self._inbox.put(_Statistics(reply))
        return reply.result(timeout)

    @property
    def healthy(self) -> bool:
        """Whether the serving loop runs and takes requests (False once it failed or was
        stopped): what /health reports."""
        return self._error is None and not self._stop.is_set() and self._thread.is_alive()

    def cache_statistics(self) -> SystemStatistics:
        return self.cache.statistics()

    def stop(self) -> None:
        """Stop stepping; requests still in the loop fail.  Idempotent."""
        self._stop.set()
        self._thread.join()

    # ------------------------------------------------------------------ the engine thread

    def _snapshot(self) -> EngineStatistics:
        return EngineStatistics(loop=self._loop.statistics(), requests=len(self._sinks),
                                cancelled=self._cancelled, failed=self._error is not None)

    def _on_token(self, request_id: str, token: int,
                  logprob: sampling_module.TokenLogprob | None) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.token(token, logprob)

    def _handle(self, message: _Submit | _Cancel | _Statistics) -> None:
        if isinstance(message, _Statistics):
            message.reply.set_result(self._snapshot())
        elif isinstance(message, _Cancel):
            if self._sinks.pop(message.request_id, None) is not None:
                self._loop.cancel(message.request_id)
                self._cancelled += 1
        else:
            req = message.request
            if self._error is not None:
                message.sink.failed(EngineStopped("the serving loop failed"))
                return
            self._sinks[req.request_id] = message.sink
            self._loop.submit(serving_loop.ServeRequest(
                request_id=req.request_id, prompt=req.prompt,
                max_new_tokens=req.max_new_tokens, arrival=self._loop.now(),
                ttl_seconds=req.ttl_seconds, priority=req.priority, cache_salt=req.cache_salt,
                sampling=req.sampling, stop=req.stop,
            ))

    def _drain_inbox(self, wait: float | None) -> None:
        try:
            message = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(message)
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _run(self) -> None:
        loop = self._loop
        try:
            while not self._stop.is_set():
                self._drain_inbox(IDLE_WAIT if loop.idle else None)
                if loop.idle:
                    continue
                started = time.perf_counter()
                finished = loop.step()
                self.step_seconds.observe(time.perf_counter() - started)
                for result in finished:
                    if result.ttft is not None:
                        self.ttft.observe(result.ttft)
                    sink = self._sinks.pop(result.request_id, None)
                    if sink is not None:
                        sink.finished(result)
                if not loop.idle and not loop.any_runnable():
                    self._stop.wait(PARKED_WAIT)
        except BaseException as exc:  # the loop is broken: fail everyone, refuse new work
            self._error = exc
            raise
        finally:
            error = self._error or EngineStopped("the engine stopped")
            for request_id, sink in list(self._sinks.items()):
                loop.cancel(request_id)
                sink.failed(error)
            self._sinks.clear()
            self._answer_statistics_requests()

    def _answer_statistics_requests(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Statistics):
                message.reply.set_result(self._snapshot())
            elif isinstance(message, _Submit):
                message.sink.failed(EngineStopped("the engine stopped"))
