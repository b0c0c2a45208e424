"""A continuous-batching serving loop that embeds statekv.

Each step:

1. admit arrived requests: ``add_request`` takes the longest cached prefix across GPU, host
   and disk; a request whose prefix is being read back from disk is *parked*;
2. un-park requests whose reads have all landed (``is_ready``, O(1)); a read that failed
   rewinds the request, which then recomputes what it lost;
3. build one batch under a token budget: a decode token for every running request, then
   prefill chunks (long prompts are chunked);
4. run the model: attention reads and writes K/V in statekv's GPU pool through each
   request's block table;
5. commit what was computed (full blocks become shareable), pick each request's token
   (greedy in one batched arg-max; a request with a :class:`Sampling` that samples or wants
   log-probabilities draws from its own row, ``models/sampling.py``), append it, release
   finished requests -- at ``max_new_tokens``, or once the output ends with one of the
   request's stop sequences (their blocks stay cached, stamped with their TTL).

Parked requests are never in the forward pass, and the loop never waits on disk: with the
blocking facade every cache call returns in microseconds.

Where a request's time to first token went (:meth:`RequestResult.breakdown`): queued, queued
with its prefetch reads in flight, parked on reads after admission, in the forward passes
that prefilled it, and the rest (ready, but outside a forward pass).  The loop samples its
queue's state once a step: the queued-and-prefetching time and the time the disk was reading
while queued requests waited on it (:class:`LoopStatistics`) are exact to within one step.

With ``prefetch_ahead`` > 0 the first arrived requests of the waiting queue ask the cache to
read their disk blocks into host pages while they wait (``prefetch``), so that admitting them
is a host -> GPU copy instead of a parked disk read; a request cancelled while it waits gives
its pages back.  Every forward pass that prefilled reports its tokens and time
(``report_prefill``): the estimate cost-aware onboarding weighs disk reads against.

On a GPU the loop holds the cache's *foreground* (``Cache.foreground``) while it works --
from the step's start to the end of the forward pass's launch, and while it commits -- and
lets go while it waits for the logits: the cache's threads run their Python in that wait
instead of taking the interpreter lock at each of the launch's torch calls.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, Final, Protocol

import attrs
import torch

from statekv.config import CacheConfig
from statekv.errors import OutOfBlocks, UsageError
from statekv.ids import PageId
from statekv.manager import PrefetchStarted, PrefixMatch, RequestStatus

from .model import Chunk, PagedDecoder, greedy
from .sampling import Sampling, TokenLogprob, logprob_of, new_generator, sample


class Cache(Protocol):
    """What the loop needs of a cache (io_actors.CacheAPI has it)."""

    @property
    def kv_pool(self) -> torch.Tensor: ...

    @property
    def config(self) -> CacheConfig: ...

    def add_request(self, request_id: str, token_ids: Sequence[int], *,
                    ttl_seconds: float | None = ..., priority: int = ...,
                    cache_salt: str | None = ..., lora_id: int | None = ...) -> PrefixMatch: ...

    def allocate_nowait(self, request_id: str, num_tokens: int) -> None: ...

    def commit(self, request_id: str, num_computed_tokens: int) -> None: ...

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def release(self, request_id: str) -> None: ...

    def is_ready(self, request_id: str) -> bool: ...

    def block_table(self, request_id: str) -> tuple[PageId, ...]: ...

    @property
    def orders_passes_by_page(self) -> bool: ...

    def order_forward_after_copies(self, gpu_pages: Iterable[int]) -> None: ...

    def request_status(self, request_id: str) -> RequestStatus: ...

    def obtainable_gpu_blocks(self) -> int: ...

    def prefetch_reads_pending(self, request_id: str) -> int: ...

    def prefetch_could_start(self) -> bool: ...

    def disk_reads_in_flight(self) -> int: ...

    def prefetch(self, request_id: str, token_ids: Sequence[int], *,
                 cache_salt: str | None = ..., lora_id: int | None = ...
                 ) -> PrefetchStarted: ...

    def foreground(self) -> contextlib.AbstractContextManager[None]: ...

    def report_prefill(self, num_tokens: int, seconds: float, *,
                       context_tokens: int) -> None: ...


@attrs.frozen(kw_only=True)
class ServeRequest:
    """One request as a workload submits it."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: float = 0.0
    """Seconds after the loop started at which the request arrives."""
    ttl_seconds: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    sampling: Sampling | None = None
    """None: greedy, no log-probabilities (the batched path alone)."""
    stop: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end the request as soon as its output ends with one."""


@attrs.define(kw_only=True)
class RequestResult:
    """What happened to one request."""

    request_id: str
    prompt_tokens: int
    output: list[int] = attrs.field(factory=list)
    arrival: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    gpu_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    remote_tokens: int = 0
    """Prompt tokens matched in the shared tier (fetched while the request was parked)."""
    recomputed_tokens: int = 0
    """Prompt tokens computed by the model (not taken from the cache)."""
    parked_seconds: float = 0.0
    """Admitted with reads still in flight (disk or shared tier), until they all landed."""
    prefetch_seconds: float = 0.0
    """Queued (arrived, not admitted) with reads of its prefetch in flight."""
    prefill_seconds: float = 0.0
    """Forward passes that carried its prompt chunks, up to the logits its first token was
    sampled from (a pass is shared with the rest of its batch)."""
    fell_back: bool = False
    """A disk read failed and the request recomputed the tokens it lost."""
    stop_tokens: int = 0
    """> 0: the request ended on a stop sequence, the last `stop_tokens` of `output`
    (generated, so counted, but not part of the answer)."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `output`, when the request's sampling asked for them."""

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" (a stop sequence) or "length" (max_new_tokens)."""
        return "stop" if self.stop_tokens else "length"

    @property
    def answer(self) -> list[int]:
        """The output without the stop sequence that ended it."""
        return self.output[:len(self.output) - self.stop_tokens]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def breakdown(self) -> TTFTBreakdown | None:
        """Where its time to first token went; None before its first token."""
        if self.first_token is None or self.admitted is None:
            return None
        queued = self.admitted - self.arrival
        ttft = self.first_token - self.arrival
        return TTFTBreakdown(
            ttft_s=ttft, queue_s=queued - self.prefetch_seconds,
            prefetch_s=self.prefetch_seconds, parked_s=self.parked_seconds,
            prefill_s=self.prefill_seconds,
            ready_wait_s=(ttft - queued - self.parked_seconds - self.prefill_seconds),
        )


@attrs.frozen(kw_only=True)
class TTFTBreakdown:
    """One request's time to first token, cut into parts that follow one another.

    queue_s + prefetch_s is arrival -> admission; parked_s follows admission; prefill_s and
    ready_wait_s interleave from then to the first token (its prompt chunks' forward passes,
    and the time between them).  The parts add up to ttft_s.  The first token is sampled from
    the logits of the last prompt chunk, so no decode step comes before it.
    """

    ttft_s: float
    queue_s: float
    """Queued with no read of its own in flight (waiting for pages, a running slot, its
    turn, or prefetching nothing)."""
    prefetch_s: float
    """Queued while reads of its prefetch were in flight (disk -> host)."""
    parked_s: float
    """Admitted, parked on the reads its prefix still needed (disk or shared tier)."""
    prefill_s: float
    """In the forward passes that computed its prompt, the last one giving its first token."""
    ready_wait_s: float
    """Ready to run but in no forward pass: steps that had no room for it, and the loop's
    work between passes (admission, un-parking, committing)."""

    PARTS: ClassVar[tuple[str, ...]] = ("queue_s", "prefetch_s", "parked_s", "prefill_s",
                                        "ready_wait_s")
    """The parts, in the order a request meets them."""

    def parts(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.PARTS}


@attrs.define(eq=False)
class _Running:
    req: ServeRequest
    result: RequestResult
    tokens: list[int]
    computed: int = 0
    parked_since: float | None = None
    matched: int = 0
    generator: torch.Generator | None = None
    """The request's own, made at its first draw (on the logits' device)."""
    ordered: tuple[PageId, ...] = ()
    """Its block table as last announced to the cache before a pass (the pages a pass has
    been ordered after their copies: only pages added since are announced again)."""


@attrs.define(eq=False)
class _Prefetch:
    """A waiting request that prefetches."""

    tokens: tuple[int, ...]
    """Its prompt, as the one tuple every prefetch call passes: the cache then checks,
    encodes and keys it once, not at every step's call (statekv.requests.QueuedRecord)."""
    asked_all: bool = False
    """Every disk block of its prefix is asked for (the loop stops asking again each step)."""
    reading_since: float | None = None
    """When its reads were first seen in flight; None while none is."""
    reads_landed: bool = False
    """No read was in flight at the last look since its last ask: the cache starts its
    reads only at its own asks (KVCacheManager.prefetch_reads_pending), so until the next
    ask there is nothing to look at again."""
    seconds: float = 0.0
    """Time queued with its reads in flight, closed intervals."""

    def stop_reading(self, now: float) -> None:
        if self.reading_since is not None:
            self.seconds += now - self.reading_since
            self.reading_since = None

    @property
    def waits_on_disk(self) -> bool:
        return self.reading_since is not None or not self.asked_all


STEP_SECONDS_KEPT: Final = 100_000
"""Step times the loop remembers for statistics()."""


@attrs.frozen(kw_only=True)
class StepParts:
    """Where the loop's steps of one kind went since it started: wall seconds summed over
    those steps (the ones that ran a forward pass), in the order a step runs them.  The
    parts are timed back to back by the loop's clock, so together they are the steps' whole
    wall time."""

    steps: int
    """Steps of this kind that ran a forward pass."""
    prepare_seconds: float
    """Admission, prefetch, un-parking and scheduling: the loop's cache calls and Python
    before the pass."""
    launch_seconds: float
    """Queuing the forward pass (``PagedDecoder.forward`` until it returns): on a GPU, the
    CPU's launches, not the GPU's work."""
    readback_seconds: float
    """Waiting for the logits: the GPU finishing the pass (and whatever it was ordered
    behind), or on a CPU nothing."""
    advance_seconds: float
    """Committing the step's tokens: the loop's cache calls and Python after the pass."""

    def mean_ms(self) -> dict[str, float]:
        """Each part's mean over the steps, in milliseconds (NaN without steps)."""
        n = self.steps
        return {name: (getattr(self, f"{name}_seconds") / n * 1e3 if n else float("nan"))
                for name in ("prepare", "launch", "readback", "advance")}


class _StepAccount:
    """A mutable StepParts being summed."""

    __slots__ = ("advance", "launch", "prepare", "readback", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.prepare = self.launch = self.readback = self.advance = 0.0

    def add(self, prepare: float, launch: float, readback: float, advance: float) -> None:
        self.steps += 1
        self.prepare += prepare
        self.launch += launch
        self.readback += readback
        self.advance += advance

    def frozen(self) -> StepParts:
        return StepParts(steps=self.steps, prepare_seconds=self.prepare,
                         launch_seconds=self.launch, readback_seconds=self.readback,
                         advance_seconds=self.advance)


@attrs.frozen(kw_only=True)
class LoopStatistics:
    steps: int
    forward_tokens: int
    prompt_tokens_computed: int
    decode_tokens: int
    parked_now: int
    running_now: int
    waiting_now: int
    step_seconds: tuple[float, ...]
    """Wall time of every step that ran a forward pass (the last STEP_SECONDS_KEPT)."""
    queued_on_disk_seconds: float
    """Time during which an arrived request of the prefetch window (the first
    `prefetch_ahead` waiting) still had disk blocks to read: reads in flight, or blocks no
    host page could be had for yet.  Sampled once a step; 0 without prefetch."""
    queued_on_disk_reading_seconds: float
    """Of queued_on_disk_seconds, the time the cache had disk reads in flight (the reader
    pool had work).  Their ratio is how busy prefetch kept the disk while requests waited."""
    decode_steps: StepParts
    """Where the steps that carried only decodes went."""
    prefill_steps: StepParts
    """Where the steps that carried a prompt chunk (with or without decodes) went: at
    saturation nearly every step, since a request is always waiting for its prefill."""


class ServingLoop:
    """Continuous batching over a PagedDecoder and a statekv cache."""

    def __init__(
        self,
        model: PagedDecoder,
        cache: Cache,
        *,
        max_step_tokens: int = 512,
        prefill_chunk: int = 256,
        max_running: int = 64,
        batch_invariant: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        ready_everywhere: Callable[[list[str]], set[str]] | None = None,
        on_token: Callable[[str, int, TokenLogprob | None], None] | None = None,
        prefetch_ahead: int = 0,
        hold_foreground: bool | None = None,
    ) -> None:
        for field, value in (("max_step_tokens", max_step_tokens),
                             ("prefill_chunk", prefill_chunk), ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(field, f"must be an integer >= 1, got {value!r}")
        if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) \
                or prefetch_ahead < 0:
            raise UsageError("prefetch_ahead",
                             f"must be an integer >= 0, got {prefetch_ahead!r}")
        if hold_foreground is not None and not isinstance(hold_foreground, bool):
            raise UsageError("hold_foreground",
                             f"must be True, False or None, got {hold_foreground!r}")
        self.prefetch_ahead = prefetch_ahead
        """How many arrived requests at the head of the waiting queue prefetch (0: none)."""
        self.hold_foreground = (cache.kv_pool.device.type == "cuda" if hold_foreground is None
                                else hold_foreground)
        """Whether each step holds the cache's foreground while it works (None: on a GPU,
        where the step waits for the device and the cache's threads can have that wait; on
        a CPU the pass is the CPU's work and there is no wait to give them)."""
        self.model = model
        self.cache = cache
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.batch_invariant = batch_invariant
        self.block_size = cache.config.block_size
        """Run each chunk on its own: a request's numerics then depend only on its own
        chunking, never on what else shared its batch (the identity checks need that)."""
        self._clock = clock
        self._ready_everywhere = ready_everywhere
        """Tensor parallel: of these parked requests, which landed on every rank (all ranks
        must admit the same batch).  None: this cache's own is_ready decides."""
        self._on_token = on_token
        """Told (request id, token, its log-probabilities or None) for every generated token,
        as it is sampled (a server streams them)."""
        self._start = clock()
        self._waiting: deque[ServeRequest] = deque()
        self._running: dict[str, _Running] = {}
        self._prefetching: dict[str, _Prefetch] = {}
        """Waiting requests that prefetch."""
        self._sampled_at: float | None = None
        self._queued_on_disk = False
        self._disk_reading = False
        """The state the last step left (prefetch window waiting on disk; reads in flight),
        charged for the time until the next step samples it again."""
        self._queued_on_disk_seconds = 0.0
        self._queued_on_disk_reading_seconds = 0.0
        self._steps = 0
        self._forward_tokens = 0
        self._prompt_computed = 0
        self._decode_tokens = 0
        # Bounded: a server steps forever.
        self._step_seconds: deque[float] = deque(maxlen=STEP_SECONDS_KEPT)
        self._decode_steps = _StepAccount()
        self._prefill_steps = _StepAccount()

    def now(self) -> float:
        """Seconds since the loop started."""
        return self._clock() - self._start

    def submit(self, request: ServeRequest) -> None:
        if request.max_new_tokens < 1:
            raise UsageError("max_new_tokens", f"must be >= 1, got {request.max_new_tokens}")
        if not request.prompt:
            raise UsageError("prompt", "a request needs at least one token")
        if any(not stop for stop in request.stop):
            raise UsageError("stop", "a stop sequence needs at least one token")
        self._waiting.append(request)

    def cancel(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, parked or running): a running request is
        released, so its pages go back (its full blocks stay cached).  False when the loop
        does not hold it (it finished, or never came)."""
        for index, waiting in enumerate(self._waiting):
            if waiting.request_id == request_id:
                del self._waiting[index]
                if self._prefetching.pop(request_id, None) is not None:
                    self.cache.release(request_id)  # gives its prefetched pages back
                return True
        if self._running.pop(request_id, None) is None:
            return False
        self.cache.release(request_id)
        return True

    def abandon(self) -> list[RequestResult]:
        """Cancel every request the loop holds and return what each got so far (a request
        still waiting has no admission time, one still prefilling no first token): a run
        stopped at a deadline reports its unfinished requests instead of losing them."""
        now = self.now()
        out = [RequestResult(request_id=req.request_id, prompt_tokens=len(req.prompt),
                             arrival=req.arrival)
               for req in self._waiting if req.arrival <= now]
        out += [run.result for run in self._running.values()]
        for rid in [req.request_id for req in self._waiting] + list(self._running):
            self.cancel(rid)
        return out

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def statistics(self) -> LoopStatistics:
        return LoopStatistics(
            steps=self._steps, forward_tokens=self._forward_tokens,
            prompt_tokens_computed=self._prompt_computed, decode_tokens=self._decode_tokens,
            parked_now=sum(1 for r in self._running.values() if r.parked_since is not None),
            running_now=len(self._running), waiting_now=len(self._waiting),
            step_seconds=tuple(self._step_seconds),
            queued_on_disk_seconds=self._queued_on_disk_seconds,
            queued_on_disk_reading_seconds=self._queued_on_disk_reading_seconds,
            decode_steps=self._decode_steps.frozen(),
            prefill_steps=self._prefill_steps.frozen(),
        )

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestResult]:
        """Admit, un-park, run one batch; returns the requests that finished."""
        self._steps += 1
        began = self._clock()
        now = began - self._start
        with self._foreground():
            self._charge_queue_sample(now)
            self._admit(now)
            self._prefetch_queue(now)
            self._unpark(now)
            plan = self._schedule()
            if not plan:
                return []
            contexts = [run.computed + n for run, n in plan
                        if run.computed < len(run.req.prompt)]
            started = self._clock()
            logits = self._forward(plan)
            launched = self._clock()
        tokens = greedy(logits)  # waits for the logits: the pass is over
        read = self._clock()
        with self._foreground():
            finished = self._advance(plan, logits, tokens, started - self._start)
        ended = self._clock()
        seconds = ended - started
        (self._prefill_steps if contexts else self._decode_steps).add(
            started - began, launched - started, read - launched, ended - read)
        self._step_seconds.append(seconds)
        if contexts and seconds > 0:
            self.cache.report_prefill(sum(n for _run, n in plan), seconds,
                                      context_tokens=max(contexts))
        return finished

    def _foreground(self) -> contextlib.AbstractContextManager[None]:
        return self.cache.foreground() if self.hold_foreground else contextlib.nullcontext()

    def _prefetch_queue(self, now: float) -> None:
        """The first `prefetch_ahead` arrived waiting requests ask for their disk blocks;
        one whose blocks could not all get a host page asks again next step.  Then the
        queue's disk state is sampled: which prefetches have reads in flight, whether the
        window still waits on disk, and whether the disk is reading."""
        if not self.prefetch_ahead:
            return
        cache = self.cache
        capacity = cache.config.gpu_blocks * self.block_size
        waits_on_disk = False
        for req in itertools.islice(self._waiting, self.prefetch_ahead):
            if req.arrival > now:
                break
            rid = req.request_id
            prefetch = self._prefetching.get(rid)
            # A prefetch that left blocks unfetched asks again only once a host page could
            # be had: with none, the ask (a walk of the whole prompt's chain under the
            # cache's lock, every step, for each such request) would start nothing.
            if (prefetch is None or (not prefetch.asked_all and cache.prefetch_could_start())
                    ) and len(req.prompt) <= capacity:
                tokens = prefetch.tokens if prefetch is not None else tuple(req.prompt)
                got = cache.prefetch(rid, tokens, cache_salt=req.cache_salt)
                if prefetch is None:
                    prefetch = self._prefetching[rid] = _Prefetch(tokens)
                prefetch.asked_all = got.unfetched_tokens == 0
                prefetch.reads_landed = False
            if prefetch is None:
                continue  # too long to ever be admitted: it asks for nothing
            if not prefetch.reads_landed and cache.prefetch_reads_pending(rid):
                if prefetch.reading_since is None:
                    prefetch.reading_since = now
            else:
                prefetch.reads_landed = True
                prefetch.stop_reading(now)
            waits_on_disk = waits_on_disk or prefetch.waits_on_disk
        self._queued_on_disk = waits_on_disk
        self._disk_reading = waits_on_disk and cache.disk_reads_in_flight() > 0

    def _charge_queue_sample(self, now: float) -> None:
        """Charge the time since the last step to the queue's disk state that step left."""
        if self._sampled_at is not None and self._queued_on_disk:
            elapsed = now - self._sampled_at
            self._queued_on_disk_seconds += elapsed
            if self._disk_reading:
                self._queued_on_disk_reading_seconds += elapsed
        self._sampled_at = now

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _reserved_blocks(self) -> int:
        """Pages running requests will still need to finish (prompt and every new token)."""
        total = 0
        for run in self._running.values():
            final = len(run.req.prompt) + run.req.max_new_tokens
            total += self._blocks_for(final) - len(self.cache.block_table(run.req.request_id))
        return total

    def _admit(self, now: float) -> None:
        """Admit arrived requests, first come first served, while their pages are sure.

        A request is admitted only when the GPU can hold its whole prompt and answer on top
        of what the running requests will still need: no admitted request ever waits for
        pages another admitted request holds, so the loop cannot deadlock.
        """
        cache = self.cache
        if not self._waiting:
            return
        spare = cache.obtainable_gpu_blocks() - self._reserved_blocks()
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting[0]
            if req.arrival > now:
                break
            need = self._blocks_for(len(req.prompt) + req.max_new_tokens)
            if need > spare:
                if not self._running and need > cache.obtainable_gpu_blocks():
                    raise UsageError(
                        "prompt", f"request {req.request_id!r} needs {need} GPU blocks; the "
                        f"pool can never free that many",
                    )
                break
            spare -= need
            # The tuple its prefetch passed: the cache checked, encoded and keyed it then.
            prefetching = self._prefetching.get(req.request_id)
            try:
                match = cache.add_request(
                    req.request_id,
                    req.prompt if prefetching is None else prefetching.tokens,
                    ttl_seconds=req.ttl_seconds,
                    priority=req.priority, cache_salt=req.cache_salt,
                )
            except OutOfBlocks:
                break
            self._waiting.popleft()
            # add_request took the prefetch over: reads still in flight park the request.
            prefetch = self._prefetching.pop(req.request_id, None)
            if prefetch is not None:
                prefetch.stop_reading(now)
            result = RequestResult(
                request_id=req.request_id, prompt_tokens=len(req.prompt), arrival=req.arrival,
                admitted=now, gpu_tokens=match.gpu_tokens, host_tokens=match.host_tokens,
                disk_tokens=match.disk_tokens, remote_tokens=match.remote_tokens,
                prefetch_seconds=prefetch.seconds if prefetch is not None else 0.0,
                logprobs=([] if req.sampling is not None and req.sampling.logprobs is not None
                          else None),
            )
            run = _Running(req=req, result=result, tokens=list(req.prompt),
                           computed=match.matched_tokens, matched=match.matched_tokens)
            if not match.ready:
                run.parked_since = now
            self._running[req.request_id] = run

    def _unpark(self, now: float) -> None:
        parked = [r for r in self._running.values() if r.parked_since is not None]
        if self._ready_everywhere is not None:
            ready = self._ready_everywhere([r.req.request_id for r in parked])
        else:
            ready = {r.req.request_id for r in parked if self.cache.is_ready(r.req.request_id)}
        for run in parked:
            if run.req.request_id not in ready or run.parked_since is None:
                continue
            run.result.parked_seconds += now - run.parked_since
            run.parked_since = None
            status = self.cache.request_status(run.req.request_id)
            computed = status.num_computed_tokens
            if computed < run.computed:
                # A read failed: the cache rewound the request; recompute from there.
                run.result.fell_back = True
                lost = run.computed - computed
                run.result.disk_tokens -= min(lost, run.result.disk_tokens)
                run.computed = computed

    def _schedule(self) -> list[tuple[_Running, int]]:
        """(request, new tokens) pairs of this step's batch, pages allocated."""
        budget = self.max_step_tokens
        plan: list[tuple[_Running, int]] = []
        cache = self.cache
        decodes = [r for r in self._running.values()
                   if r.parked_since is None and r.computed >= len(r.req.prompt)]
        prefills = [r for r in self._running.values()
                    if r.parked_since is None and r.computed < len(r.req.prompt)]
        for run in decodes + prefills:
            if budget <= 0:
                break
            remaining = len(run.tokens) - run.computed
            n = min(remaining, budget, self.prefill_chunk if remaining > 1 else 1)
            if n <= 0:
                continue
            try:
                cache.allocate_nowait(run.req.request_id, run.computed + n)
            except OutOfBlocks:
                continue  # no pages this step; it keeps its place and tries again
            plan.append((run, n))
            budget -= n
        return plan

    def _forward(self, plan: list[tuple[_Running, int]]) -> torch.Tensor:
        pool = self.cache.kv_pool
        tables = [self.cache.block_table(run.req.request_id) for run, _n in plan]
        chunks = [
            Chunk(token_ids=run.tokens[run.computed:run.computed + n], start=run.computed,
                  block_table=table)
            for (run, n), table in zip(plan, tables, strict=True)
        ]
        if self.cache.orders_passes_by_page:
            self._order_after_copies(plan, tables)
        self._forward_tokens += sum(n for _run, n in plan)
        if self.batch_invariant:
            rows = [self.model.forward(pool, [chunk]).last_logits for chunk in chunks]
            return torch.cat(rows, dim=0)
        return self.model.forward(pool, chunks).last_logits

    def _order_after_copies(self, plan: list[tuple[_Running, int]],
                            tables: list[tuple[PageId, ...]]) -> None:
        """Announce the pass's pages to the cache, which orders the pass after their copies
        (only theirs, under compute_waits="pages").  A request's pages announced before a
        pass are not announced again: the cache copies into no page of a running request.
        Only the pages added since are, or the whole table where it is not an extension
        of the one announced (so the cost is per new page, not per page of every context)."""
        pages: list[PageId] = []
        for (run, _n), table in zip(plan, tables, strict=True):
            done = run.ordered
            if table == done:  # the common step: no new page
                continue
            if len(table) > len(done) and table[:len(done)] == done:
                pages += table[len(done):]
            else:
                pages += table
            run.ordered = table
        self.cache.order_forward_after_copies(pages)

    def _advance(self, plan: list[tuple[_Running, int]], logits: torch.Tensor,
                 tokens: list[int], forward_started: float) -> list[RequestResult]:
        finished: list[RequestResult] = []
        cache = self.cache
        now = self.now()
        for row, ((run, n), greedy_token) in enumerate(zip(plan, tokens, strict=True)):
            rid = run.req.request_id
            was_prefill = run.computed < len(run.req.prompt)
            run.computed += n
            cache.commit(rid, run.computed)
            if was_prefill:
                self._prompt_computed += n
                run.result.recomputed_tokens += n
                run.result.prefill_seconds += now - forward_started
                if run.computed < len(run.req.prompt):
                    continue  # more prompt chunks to go; the logits are not a sample
                run.result.first_token = now
            else:
                self._decode_tokens += 1
            token, logprob = self._pick(run, logits, row, greedy_token)
            run.result.output.append(token)
            if logprob is not None and run.result.logprobs is not None:
                run.result.logprobs.append(logprob)
            if self._on_token is not None:
                self._on_token(rid, token, logprob)
            stop = self._stop_length(run)
            if stop or len(run.result.output) >= run.req.max_new_tokens:
                run.result.stop_tokens = stop
                run.result.finished = now
                cache.release(rid)
                del self._running[rid]
                finished.append(run.result)
            else:
                run.tokens.append(token)
                cache.append_tokens(rid, [token])
        return finished

    @staticmethod
    def _pick(run: _Running, logits: torch.Tensor, row: int, greedy_token: int
              ) -> tuple[int, TokenLogprob | None]:
        """The request's token (the batch's arg-max unless it samples) and, when it asked,
        its log-probabilities; only a request with a Sampling that needs it looks at its row."""
        sampling = run.req.sampling
        if sampling is None or not sampling.needs_row:
            return greedy_token, None
        token = greedy_token
        if not sampling.greedy:
            if run.generator is None:
                run.generator = new_generator(sampling, logits.device)
            token = sample(logits[row], sampling, run.generator)
        if sampling.logprobs is None:
            return token, None
        return token, logprob_of(logits[row], token, sampling.logprobs)

    @staticmethod
    def _stop_length(run: _Running) -> int:
        """The length of the stop sequence the output now ends with (0: none); the longest
        when several do, as the text is cut where the first one found begins."""
        if not run.req.stop:
            return 0
        output = run.result.output
        return max((len(stop) for stop in run.req.stop
                    if len(output) >= len(stop) and tuple(output[-len(stop):]) == stop),
                   default=0)

    # ------------------------------------------------------------------ whole runs

    def drain(self, *, on_finished: Callable[[RequestResult], None] | None = None,
              timeout: float = 3600.0) -> list[RequestResult]:
        """Step until every submitted request finished; returns them in finishing order."""
        done: list[RequestResult] = []
        deadline = self._clock() + timeout
        while not self.idle:
            if self._clock() > deadline:
                raise TimeoutError("serving loop did not finish in time")
            finished = self.step()
            for result in finished:
                done.append(result)
                if on_finished is not None:
                    on_finished(result)
            if not finished and not self.any_runnable():
                time.sleep(0.0005)  # everything parked or not yet arrived
        return done

    def any_runnable(self) -> bool:
        """Whether a request could run now (not every one parked on disk reads)."""
        return any(r.parked_since is None for r in self._running.values())
