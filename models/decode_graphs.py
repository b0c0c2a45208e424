"""Decode-only forward passes replayed from CUDA graphs.

A forward pass of a few dozen decodes through a handful of layers is bound by launching its
kernels, not by the GPU: a few hundred torch calls a step.  Each call lets the interpreter
lock go and takes it back, and with the cache's own threads busy with disk traffic the
serving thread waited for the lock at many of those points (``bench.io``'s busy step on the
H200, profiled with py-spy: a third of the forward pass's samples).  A CUDA graph replays the
whole pass with one launch: the step then makes a handful of torch calls, not hundreds.

A graph has fixed shapes and fixed addresses, so one is captured per *bucket*: the KV pool
it reads and writes, the number of decodes rounded up to a power of two, and the longest
context rounded up to a multiple of an eighth of the power of two at or above it (four
buckets an octave, at most a quarter more than needed).  A batch
is padded to its bucket:

- *Padding context entries* of a real decode repeat its own position-0 row, as the eager
  pass's own padding does: K/V written by the model, so finite, which the mask weighs 0.
  A row of stale pool bytes could be NaN, and a masked score still multiplies its value
  row (0 * NaN is NaN).  A padding decode's entries all read its parking row (below): its
  row of the batch mixes with no other and its logits are dropped, but no NaN flows
  through the pass at all.
- *Padding decodes* must not write the pool.  Each one's K/V write goes to a row that the
  batch only reads (position 0 of a real decode whose context is longer than its new
  token), carrying the bytes that row already holds, so the write changes nothing; its
  attention reads that row alone.  A batch with no such row (every decode a one-token
  prompt) runs eagerly.

Graphs are captured on first use, one warm-up pass first (which is the step itself: it
writes the same K/V rows with the same values as the replay that follows).  At most
`max_graphs` are kept; the least recently used is dropped for a new one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

import attrs
import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from statekv.errors import ConfigError

DecodeBody = Callable[[Tensor, Tensor, int, int], Tensor]
"""(pool, inputs, batch, width) -> [batch, vocab] float32 logits: the decode-only forward
pass over padded device inputs laid out as :func:`input_sizes` says."""

MIN_WIDTH_STEP: Final = 16
"""The finest context bucket: widths are rounded up to a multiple of at least this."""


def input_sizes(batch: int, width: int) -> list[int]:
    """Sizes of the int64 input's parts, in order: token ids, positions, write rows, write
    masks (1 = a real decode's write), context rows [batch, width], context masks."""
    return [batch, batch, batch, batch, batch * width, batch * width]


def bucket_batch(n: int) -> int:
    """The number of decodes a graph for `n` decodes runs: the next power of two."""
    return 1 << (n - 1).bit_length()


def bucket_width(width: int) -> int:
    """The context width a graph for `width` runs: rounded up to a multiple of an eighth of
    the power of two at or above it (at least :data:`MIN_WIDTH_STEP`)."""
    step = max(MIN_WIDTH_STEP, bucket_batch(width) // 8)
    return -(-width // step) * step


@attrs.frozen(kw_only=True, eq=False)
class DecodeInputs:
    """Host-side indices of a decode-only batch, as the model computed and checked them."""

    token_ids: NDArray[np.int64]
    """[n] each decode's new token."""
    positions: NDArray[np.int64]
    """[n] its position."""
    write_rows: NDArray[np.int64]
    """[n] the flat layer-0 K row its K/V goes to."""
    context_rows: NDArray[np.int64]
    """[n, width] flat layer-0 K rows of its context [0, position]; padding entries repeat
    its position-0 row."""
    context_valid: NDArray[np.bool_]
    """[n, width] which entries of `context_rows` are real."""


@attrs.frozen(kw_only=True)
class DecodeGraphStatistics:
    """What the decode graphs did since the model was made."""

    captured: int
    """Graphs captured (each on a bucket's first batch)."""
    replayed: int
    """Decode-only batches that ran as a graph replay."""
    eager: int
    """Decode-only batches that ran eagerly: no row to park padding writes on, or more
    decodes than `max_batch`."""
    dropped: int
    """Graphs dropped to make room for another (least recently used first)."""
    kept: int
    """Graphs held now."""


@attrs.define(eq=False)
class _Graph:
    inputs: Tensor
    """The static device input the graph reads."""
    output: Tensor
    """The static [batch, vocab] logits the graph writes."""
    graph: torch.cuda.CUDAGraph | None
    """None where graphs are not captured (a CPU device): the body runs eagerly on the
    padded inputs, which is what the tests of the padding check."""


class DecodeGraphs:
    """CUDA graphs of a model's decode-only forward pass, one per bucket (module docstring).

    `capture=False` runs the same padded pass eagerly (on any device): the padding's
    arithmetic without graphs, for the tests.
    """

    def __init__(
        self, body: DecodeBody, *, device: torch.device, capture: bool,
        max_graphs: int = 64, max_batch: int = 256,
    ) -> None:
        for name, value in (("max_graphs", max_graphs), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if capture and device.type != "cuda":
            raise ConfigError("cuda_graphs", f"CUDA graphs need a CUDA device, not {device}")
        self._body = body
        self._device = device
        self._capture = capture
        self._max_graphs = max_graphs
        self._max_batch = max_batch
        self._graphs: OrderedDict[tuple[int, tuple[int, ...], int, int], _Graph] = OrderedDict()
        # One memory pool for every graph: they replay one at a time on one stream, so their
        # intermediates can share memory.
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        # Graphs hold fixed input and output buffers: one batch at a time goes through them.
        self._lock = threading.Lock()
        self._captured = self._replayed = self._eager = self._dropped = 0

    def statistics(self) -> DecodeGraphStatistics:
        with self._lock:
            return DecodeGraphStatistics(
                captured=self._captured, replayed=self._replayed, eager=self._eager,
                dropped=self._dropped, kept=len(self._graphs),
            )

    def run(self, pool: Tensor, batch: DecodeInputs) -> Tensor | None:
        """The batch's [n, vocab] logits from its bucket's graph, or None if it must run
        eagerly (the caller then runs the ordinary pass)."""
        n, width = batch.context_rows.shape
        parking = _parking_row(batch)
        if n > self._max_batch or parking is None:
            with self._lock:
                self._eager += 1
            return None
        size, span = bucket_batch(n), bucket_width(width)
        host = _padded_inputs(batch, parking, size, span)
        with self._lock:
            key = (pool.data_ptr(), tuple(pool.shape), size, span)
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._new_graph(pool, host, size, span)
                while len(self._graphs) >= self._max_graphs:
                    self._graphs.popitem(last=False)
                    self._dropped += 1
                self._graphs[key] = entry
            else:
                self._graphs.move_to_end(key)
                _upload(entry.inputs, host)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                entry.output = self._body(pool, entry.inputs, size, span)
            self._replayed += 1
            # A copy: the graph overwrites its output at the next replay, and the caller may
            # keep these logits longer than that.
            return entry.output[:n].clone()

    def _new_graph(self, pool: Tensor, host: NDArray[np.int64], size: int, span: int) -> _Graph:
        inputs = torch.empty(host.size, dtype=torch.int64, device=self._device)
        _upload(inputs, host)
        if not self._capture:
            return _Graph(inputs=inputs, output=inputs, graph=None)
        # Warm up on a side stream, as torch's capture needs: the pass's lazy setup (library
        # handles, workspaces) must not happen inside the capture.  The warm-up is this very
        # step; the replay below writes the same K/V rows with the same values again.
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._body(pool, inputs, size, span)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the cache's threads keep enqueuing copies and waiting on events while
        # the serving thread captures; only this thread's calls must be capture-safe.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            output = self._body(pool, inputs, size, span)
        self._captured += 1
        return _Graph(inputs=inputs, output=output, graph=graph)


def _parking_row(batch: DecodeInputs) -> int | None:
    """A row the batch reads but does not write: position 0 of the first decode whose
    context holds more than its new token (its write goes to a later position, and no other
    chunk may write a page it reads)."""
    longer = np.flatnonzero(batch.positions >= 1)
    if longer.size == 0:
        return None
    return int(batch.context_rows[int(longer[0]), 0])


def _padded_inputs(
    batch: DecodeInputs, parking: int, size: int, span: int,
) -> NDArray[np.int64]:
    n, width = batch.context_rows.shape
    host = np.zeros(sum(input_sizes(size, span)), dtype=np.int64)
    tok, pos, wr, keep, rows, valid = np.split(host, np.cumsum(input_sizes(size, span))[:-1])
    tok[:n] = batch.token_ids
    pos[:n] = batch.positions
    wr[:n] = batch.write_rows
    wr[n:] = parking
    keep[:n] = 1
    rows2 = rows.reshape(size, span)
    valid2 = valid.reshape(size, span)
    rows2[:n, :width] = batch.context_rows
    rows2[:n, width:] = batch.context_rows[:, :1]
    valid2[:n, :width] = batch.context_valid
    rows2[n:] = parking
    valid2[n:, 0] = 1
    return host


def _upload(device_inputs: Tensor, host: NDArray[np.int64]) -> None:
    # From pinned memory, so that queuing the copy does not wait for the compute stream
    # (see models.model._to_device); torch's pinned allocator keeps the staging block until
    # the copy has run.
    source = torch.from_numpy(host)
    if device_inputs.device.type == "cuda":
        device_inputs.copy_(source.pin_memory(), non_blocking=True)
    else:
        device_inputs.copy_(source)
