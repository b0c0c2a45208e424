"""A Llama-style decoder with random weights whose KV lives in an external paged pool.

The pool is one tensor of shape ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (2 = K, V), so that one block's bytes -- every layer's K and V for its tokens --
are contiguous: statekv moves whole blocks between tiers with one copy each.  statekv's memory
pool allocates it; :meth:`PagedDecoder.new_pool` makes one for tests.

One forward pass serves a batch of *chunks*.  A chunk is a run of new tokens of one sequence:
its ids, the position it starts at (how many tokens of the sequence already have KV in the
pool) and the block table (pool pages covering positions ``[0, start + len)``).  The pass
writes the new tokens' K/V into their pages and attends causally over ``[0, start + len)``.
So a prefill whose first k blocks came from the cache computes only the rest, a long prompt
can be prefilled in several chunks, and prefill and decode chunks share one batch.

Weights are drawn from a counter-based hash of (seed, tensor name, element index), computed
with exact integer arithmetic: every device produces the same bits, so
:meth:`ModelConfig.fingerprint` identifies them wherever KV was computed, and a
tensor-parallel rank generates exactly its slice of the full matrices.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import warnings
from collections.abc import Callable, Sequence
from typing import Final, Literal

import attrs
import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor
from torch.nn import functional as nnf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from statekv.errors import ConfigError, InvariantViolation, UsageError

from .config import ModelConfig
from .decode_graphs import DecodeGraphs, DecodeGraphStatistics, DecodeInputs, input_sizes

_ATTENTION_BACKENDS: Final = [
    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
]
"""The attention kernels the forward pass may use: every one but cuDNN's.  cuDNN's builds an
execution plan for each new shape, compiling it with NVRTC, and a serving loop's shapes are
new all the time (a decode batch's context grows by a token a step; prefill chunks come in
every length).  On the H200 machine, py-spy --native put 91% of the decode attention's
samples in nvrtcCompileProgram, the step at 24-46 ms where the same steps with their plans
cached took 6 ms."""

DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

AttentionBackend = Literal["sdpa", "flex", "flex-compiled"]
"""How paged attention runs: ``sdpa`` gathers each chunk's pages and calls
scaled_dot_product_attention (the default, chosen by measurement: see ``_sdpa_attend``);
``flex`` packs every chunk's context into one sequence for flex_attention with a block mask
(eager); ``flex-compiled`` is the same under torch.compile, recompiled per batch shape."""
ATTENTION_BACKENDS: Final[tuple[str, ...]] = ("sdpa", "flex", "flex-compiled")

AllReduce = Callable[[Tensor], None]
"""Sums a tensor in place across the tensor-parallel ranks."""

# ---------------------------------------------------------------------------- weights

_MASK32: Final = 0xFFFFFFFF
_GEN_CHUNK: Final = 1 << 22
"""Elements generated per step: bounds the int64 temporaries (~100 MiB) on any model size."""


def _mul32_(h: Tensor, c: int) -> None:
    # h = h * c mod 2**32, in place, for 0 <= h < 2**32.  A constant >= 2**31 is used as
    # c - 2**32 (same residue): then |h * c| < 2**63, so the int64 product never overflows
    # (signed overflow would make the bits depend on the device's kernels), and the mask
    # takes its low 32 bits in two's complement.
    h.mul_(c if c < 2**31 else c - 2**32).bitwise_and_(_MASK32)


def _fmix32_(h: Tensor) -> None:
    # MurmurHash3's finalizer, in place: a bijection of 32-bit values with full avalanche.
    h.bitwise_xor_(h >> 16)
    _mul32_(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    _mul32_(h, 0xC2B2AE35)
    h.bitwise_xor_(h >> 16)


def _tensor_keys(seed: int, name: str) -> tuple[int, int]:
    digest = hashlib.blake2b(
        f"{seed}:{name}".encode(), digest_size=8, person=b"statekv-weights"
    ).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _as_float32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def generate_weight(
    seed: int,
    name: str,
    shape: tuple[int, int],
    *,
    std: float,
    dtype: torch.dtype,
    device: torch.device,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> Tensor:
    """Rows ``rows`` x columns ``cols`` of the full ``shape`` matrix named `name`.

    Values are uniform on [-sqrt(3), sqrt(3)) * std and depend only on (seed, name, element
    index in the full matrix): bit-identical on every device and for every slicing.
    """
    nrows, ncols = shape
    r0, r1 = rows if rows is not None else (0, nrows)
    c0, c1 = cols if cols is not None else (0, ncols)
    if not (0 <= r0 <= r1 <= nrows and 0 <= c0 <= c1 <= ncols):
        raise UsageError("rows", f"slice {rows}, {cols} is outside the matrix {shape}")
    k0, k1 = _tensor_keys(seed, name)
    # One rounding in fp32 (scale) and one to the target dtype; everything before is exact.
    scale = _as_float32(math.sqrt(3.0) * std)
    out = torch.empty((r1 - r0, c1 - c0), dtype=dtype, device=device)
    width = c1 - c0
    if width == 0:
        return out
    col_idx = torch.arange(c0, c1, dtype=torch.int64, device=device)
    step = max(1, _GEN_CHUNK // width)
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        row_idx = torch.arange(a, b, dtype=torch.int64, device=device)
        idx = row_idx[:, None] * ncols + col_idx[None, :]
        h = (idx & _MASK32).bitwise_xor_(k0)
        _fmix32_(h)
        h.bitwise_xor_(idx.bitwise_right_shift_(32)).bitwise_xor_(k1)
        _fmix32_(h)
        # A 24-bit integer times 2**-23, minus 1: exact in fp32, uniform on [-1, 1).
        u = (h >> 8).to(torch.float32) * (2.0**-23) - 1.0
        out[a - r0 : b - r0] = (u * scale).to(dtype)
    return out


# ---------------------------------------------------------------------------- batch records


@attrs.frozen(kw_only=True)
class Chunk:
    """New tokens of one sequence for one forward pass."""

    token_ids: Sequence[int]
    start: int
    """Tokens of the sequence whose KV is already in the pool (the new tokens' first position)."""
    block_table: Sequence[int]
    """Pool pages of the sequence in order; at least those covering [0, start + len)."""


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    """Logits of one forward pass (float32)."""

    last_logits: Tensor
    """[num_chunks, vocab]: the logits of each chunk's last token."""
    logits: tuple[Tensor, ...] | None
    """With ``all_logits=True``: one [len(chunk.token_ids), vocab] tensor per chunk."""


def greedy(logits: Tensor) -> list[int]:
    """Temperature-0 sampling: the arg-max token of each row (the lowest id among ties)."""
    if logits.ndim != 2:
        raise UsageError("logits", f"must be [batch, vocab], got shape {tuple(logits.shape)}")
    return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]


@attrs.frozen(kw_only=True, eq=False)
class _Batch:
    """Per-pass metadata on the device, shared by every layer."""

    token_ids: Tensor
    positions: Tensor
    write_slots: Tensor
    """Flat index (into the pool viewed as rows of [heads, dim]) of each new token's K slot in
    layer 0; layer l's K row is ``+ 2*l*block_size``, its V row ``+ (2*l+1)*block_size``."""
    q_ranges: tuple[tuple[int, int], ...]
    """[start, end) of each chunk's tokens in the packed new-token dimension."""
    last_index: Tensor
    prefill: tuple[tuple[int, int, int, int, int], ...]
    """Chunks attended one call each (all but batched decodes): (chunk, q_start, q_len,
    kv_start, ctx), where [kv_start, kv_start + ctx) is its range in `read_slots`."""
    read_slots: Tensor
    """Flat layer-0 K rows of [0, ctx) of every chunk in `prefill`, packed."""
    decode_chunks: Tensor
    """Batched one-token chunks, by their packed token index."""
    decode_slots: Tensor
    """[num_decodes, max_ctx] flat layer-0 K rows.  A padding entry repeats a row of the
    decode's own context (position 0's): K/V the model wrote, so finite, which the mask then
    weighs 0 (stale pool bytes could be NaN, and 0 * NaN is NaN)."""
    decode_valid: Tensor
    """[num_decodes, max_ctx] which entries of `decode_slots` are real."""
    flex_mask: BlockMask | None
    kv_offsets: Tensor
    """[layers, 2, 1]: what layer l adds to a layer-0 K row index for its K row ([l, 0])
    and its V row ([l, 1])."""
    write_keep: Tensor | None = None
    """[2 * new tokens, 1, 1], for a padded batch (a decode graph's): which K/V writes are
    real; the others write back the bytes their row holds (models.decode_graphs)."""


@attrs.frozen(kw_only=True, eq=False)
class _Prepared:
    """A checked batch on the host: its decode-only form, if it is one, and its upload."""

    decodes: DecodeInputs | None
    """Set when every chunk is a batched decode and the model has decode graphs: what a
    decode graph takes."""
    upload: Callable[[], _Batch]
    """The batch's indices on the model's device, for the ordinary pass."""


# ---------------------------------------------------------------------------- the model


class _Layer(torch.nn.Module):
    wqkv: Tensor
    wo: Tensor
    wgu: Tensor
    wdown: Tensor

    def __init__(
        self, wqkv: Tensor, wo: Tensor, wgu: Tensor, wdown: Tensor
    ) -> None:
        super().__init__()
        self.register_buffer("wqkv", wqkv)
        self.register_buffer("wo", wo)
        self.register_buffer("wgu", wgu)
        self.register_buffer("wdown", wdown)


def _dist_all_reduce(x: Tensor) -> None:
    torch.distributed.all_reduce(x)


class PagedDecoder(torch.nn.Module):
    """Llama-style decoder over a paged KV pool; see the module docstring for the protocol.

    With ``tp_size > 1`` this instance holds rank `tp_rank`'s share of the heads and of the FFN
    (Megatron split: q/k/v and gate/up by output rows, o and down by input columns) and sums
    the partial outputs of o and down with `all_reduce` (``torch.distributed.all_reduce`` on the
    default group unless given).  Embeddings and the LM head are replicated.  Its KV pool holds
    only its kv heads: ``config.kv_layout(tp_size)``.
    """

    embed: Tensor
    lm_head: Tensor
    inv_freq: Tensor

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str = "cpu",
        attention: AttentionBackend = "sdpa",
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
        batch_decodes: bool | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ConfigError("config", f"must be a ModelConfig, got {config!r}")
        if attention not in ATTENTION_BACKENDS:
            raise ConfigError(
                "attention", f"unknown backend {attention!r} (known: {list(ATTENTION_BACKENDS)})"
            )
        config.check_tp_size(tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not (
            0 <= tp_rank < tp_size
        ):
            raise ConfigError("tp_rank", f"must be in [0, {tp_size}), got {tp_rank!r}")
        if tp_size > 1 and all_reduce is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ConfigError(
                    "tp_size",
                    "tensor parallelism needs an all_reduce, or an initialized torch.distributed",
                )
            all_reduce = _dist_all_reduce
        self.config = config
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError("device", f"not a torch device: {exc}") from None
        self.dtype = DTYPES[config.dtype]
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.attention = attention
        self._all_reduce = all_reduce
        if batch_decodes is not None and not isinstance(batch_decodes, bool):
            raise ConfigError(
                "batch_decodes", f"must be True, False or None, got {batch_decodes!r}"
            )
        # One padded SDPA call for all one-token chunks, or one call each.  Per chunk measured
        # faster on CPU (see _sdpa_attend); on accelerators one call saves a few kernel
        # launches per decode per layer, which is what dominates small decodes there.
        self.batch_decodes = self.device.type != "cpu" if batch_decodes is None else batch_decodes
        if not isinstance(cuda_graphs, bool):
            raise ConfigError("cuda_graphs", f"must be True or False, got {cuda_graphs!r}")
        if cuda_graphs and (attention != "sdpa" or batch_decodes is False or tp_size != 1):
            raise ConfigError(
                "cuda_graphs",
                "decode graphs need attention='sdpa', batched decodes and tp_size 1",
            )
        if cuda_graphs and self.device.type != "cuda":
            raise ConfigError("cuda_graphs", f"CUDA graphs need a CUDA device, not {device}")
        # Decode-only passes as CUDA graph replays: one launch a step instead of a few
        # hundred torch calls (see models.decode_graphs for why that matters here).  Off
        # unless asked for: not yet measured on a GPU against the eager pass.
        self._decode_graphs = (
            DecodeGraphs(self._decode_body, device=self.device, capture=True)
            if cuda_graphs else None
        )
        self._flex: Callable[..., Tensor] = flex_attention
        if attention == "flex-compiled":
            # Static shapes: one compile per distinct batch shape, so this backend suits
            # fixed-shape benchmarks, not a serving loop.  dynamic=True would avoid that, but
            # with torch 2.13 the CPU flex template then fails to compile (C++ codegen error).
            self._flex = torch.compile(flex_attention, dynamic=False)

        c = config
        self.num_heads = c.num_heads // tp_size
        self.num_kv_heads = c.num_kv_heads // tp_size
        self.ffn = c.ffn // tp_size
        d, hq, hkv = c.head_dim, self.num_heads, self.num_kv_heads
        dev, dt, seed = self.device, self.dtype, c.seed

        def weight(
            name: str, shape: tuple[int, int], std: float, *,
            rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
        ) -> Tensor:
            return generate_weight(
                seed, name, shape, std=std, dtype=dt, device=dev, rows=rows, cols=cols
            )

        def share(total: int) -> tuple[int, int]:
            part = total // tp_size
            return tp_rank * part, (tp_rank + 1) * part

        # Fan-in scaling keeps every projection's output at unit variance; the two residual
        # branches are further scaled by 1/sqrt(2L) so the residual stream stays O(1) at any
        # depth (GPT-2's rule).  Norm gains are 1 (Llama's initial value) and are left out.
        in_std = 1.0 / math.sqrt(c.hidden)
        branch = 1.0 / math.sqrt(2 * c.num_layers)
        self.register_buffer("embed", weight("embed", (c.vocab_size, c.hidden), 1.0))
        self.layers = torch.nn.ModuleList()
        for i in range(c.num_layers):
            p = f"layer{i}."
            q = weight(p + "q", (c.num_heads * d, c.hidden), in_std, rows=share(c.num_heads * d))
            k = weight(
                p + "k", (c.num_kv_heads * d, c.hidden), in_std, rows=share(c.num_kv_heads * d)
            )
            v = weight(
                p + "v", (c.num_kv_heads * d, c.hidden), in_std, rows=share(c.num_kv_heads * d)
            )
            wo = weight(
                p + "o", (c.hidden, c.num_heads * d), branch / math.sqrt(c.num_heads * d),
                cols=share(c.num_heads * d),
            )
            gate = weight(p + "gate", (c.ffn, c.hidden), in_std, rows=share(c.ffn))
            up = weight(p + "up", (c.ffn, c.hidden), in_std, rows=share(c.ffn))
            down = weight(
                p + "down", (c.hidden, c.ffn), branch / math.sqrt(c.ffn), cols=share(c.ffn)
            )
            # Fused q|k|v and gate|up: one GEMM each instead of three and two.
            self.layers.append(
                _Layer(torch.cat([q, k, v]), wo, torch.cat([gate, up]), down)
            )
            del q, k, v, gate, up
        self.register_buffer("lm_head", weight("lm_head", (c.vocab_size, c.hidden), in_std))
        self.register_buffer(
            "inv_freq",
            (1.0 / c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            .to(torch.float32).to(dev),
        )
        self._q_size = hq * d
        self._kv_size = hkv * d

    # ------------------------------------------------------------------ pool helpers

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        """The KV pool shape this model (rank) reads and writes."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(name, f"must be an integer >= 1, got {value!r}")
        c = self.config
        return (num_blocks, c.num_layers, 2, block_size, self.num_kv_heads, c.head_dim)

    def new_pool(self, num_blocks: int, block_size: int, *, fill: float = 0.0) -> Tensor:
        """A KV pool for this model on its device (statekv's memory pool makes the real one)."""
        return torch.full(
            self.pool_shape(num_blocks, block_size), fill, dtype=self.dtype, device=self.device
        )

    # ------------------------------------------------------------------ the forward pass

    @torch.inference_mode()
    def forward(
        self, pool: Tensor, chunks: Sequence[Chunk], *, all_logits: bool = False
    ) -> StepOutput:
        """Write the chunks' K/V into `pool`, attend, and return their logits.

        Pages a chunk writes (those covering [start, start + len)) must belong to no other
        chunk of the batch; pages before `start` may be shared (a cached prefix).  Only the
        positions [0, start + len) of a chunk's own pages are read.
        """
        self._check_pool(pool)
        prepared = self._prepare(pool, chunks)
        if (self._decode_graphs is not None and prepared.decodes is not None
                and not all_logits):
            replayed = self._decode_graphs.run(pool, prepared.decodes)
            if replayed is not None:
                return StepOutput(last_logits=replayed, logits=None)
        batch = prepared.upload()
        x = self._hidden(pool, batch)
        last_logits = self._logits(x.index_select(0, batch.last_index))
        logits: tuple[Tensor, ...] | None = None
        if all_logits:
            full = self._logits(x)
            logits = tuple(full[a:b] for a, b in batch.q_ranges)
        return StepOutput(last_logits=last_logits, logits=logits)

    def decode_graph_statistics(self) -> DecodeGraphStatistics | None:
        """What the decode graphs did (None when this model runs without them)."""
        return None if self._decode_graphs is None else self._decode_graphs.statistics()

    def _hidden(self, pool: Tensor, batch: _Batch) -> Tensor:
        """The new tokens' final hidden states, normalized; writes their K/V into `pool`."""
        x = nnf.embedding(batch.token_ids, self.embed)
        rotary = self._rotary(batch.positions)
        with sdpa_kernel(_ATTENTION_BACKENDS):
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, _Layer)
                x = self._layer(
                    x, rotary, layer,
                    functools.partial(self._paged_attend, pool, batch, i),
                )
        return self._norm(x)

    def _logits(self, x: Tensor) -> Tensor:
        return nnf.linear(x, self.lm_head).float()

    def _decode_body(self, pool: Tensor, inputs: Tensor, size: int, span: int) -> Tensor:
        """The decode-only pass over a padded batch's device inputs (what a decode graph
        captures): every tensor's shape follows from (size, span) alone."""
        tok, pos, wr, keep, rows, valid = inputs.split_with_sizes(input_sizes(size, span))
        order = torch.arange(size, dtype=torch.int64, device=inputs.device)
        nlayers = len(self.layers)
        kv_offsets = torch.arange(2 * nlayers, dtype=torch.int64, device=inputs.device)
        batch = _Batch(
            token_ids=tok, positions=pos, write_slots=wr, q_ranges=(), last_index=order,
            prefill=(), read_slots=rows[:0], decode_chunks=order,
            decode_slots=rows.view(size, span), decode_valid=valid.view(size, span).bool(),
            flex_mask=None, kv_offsets=(kv_offsets * pool.shape[3]).view(nlayers, 2, 1),
            write_keep=keep.bool().repeat(2)[:, None, None],
        )
        return self._logits(self._hidden(pool, batch))

    @torch.inference_mode()
    def reference_logits(self, token_ids: Sequence[int]) -> Tensor:
        """[len, vocab] logits of one whole sequence with no pool: dense causal attention.

        Written independently of the paged path (explicit softmax, no SDPA) to check it.
        """
        ids = self._token_tensor("token_ids", token_ids).to(self.device)
        n = ids.numel()
        positions = torch.arange(n, dtype=torch.int64, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        group = self.num_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.config.head_dim)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
            scores = scores.masked_fill(~causal, -math.inf)
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())
            return out.to(self.dtype).reshape(n, self._q_size)

        x = nnf.embedding(ids, self.embed)
        rotary = self._rotary(positions)
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            x = self._layer(x, rotary, layer, attend)
        return nnf.linear(self._norm(x), self.lm_head).float()

    # ------------------------------------------------------------------ layers

    def _norm(self, x: Tensor) -> Tensor:
        # x * rsqrt(mean(x^2) + eps), computed in float32 and returned in x's dtype: one
        # fused kernel on CUDA where the spelled-out form launched seven.  The forward pass is
        # bound by its kernel launches at decode batch sizes (py-spy on the H200: the serving
        # thread's step time went to launching, not to waiting for the GPU).
        return nnf.rms_norm(x, (x.shape[-1],), eps=self.config.rms_eps)

    def _rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of every token's rotary angles, [n, 1, head_dim / 2] each: once per
        forward pass, shared by every layer."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        x32 = x.float()
        x1, x2 = x32[..., :half], x32[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def _reduce(self, x: Tensor) -> Tensor:
        if self._all_reduce is not None:
            self._all_reduce(x)
        return x

    def _layer(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor],
        layer: _Layer,
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:
        n = x.shape[0]
        d = self.config.head_dim
        qkv = nnf.linear(self._norm(x), layer.wqkv)
        # q's and k's heads are rotated as one [n, heads + kv_heads, d] tensor: half the
        # kernel launches of rotating each, the same arithmetic on every element.
        qk = self._rope(qkv[:, : self._q_size + self._kv_size].reshape(
            n, self.num_heads + self.num_kv_heads, d), *rotary)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self._q_size + self._kv_size :].reshape(n, self.num_kv_heads, d)
        x = x + self._reduce(nnf.linear(attend(q, k, v), layer.wo))
        gate, up = nnf.linear(self._norm(x), layer.wgu).chunk(2, dim=-1)
        return x + self._reduce(nnf.linear(nnf.silu(gate) * up, layer.wdown))

    # ------------------------------------------------------------------ paged attention

    def _paged_attend(
        self, pool: Tensor, batch: _Batch, layer: int, q: Tensor, k: Tensor, v: Tensor
    ) -> Tensor:
        bs = pool.shape[3]
        rows = pool.view(-1, self.num_kv_heads, self.config.head_dim)
        k_off, v_off = 2 * layer * bs, (2 * layer + 1) * bs
        # K and V rows move together, [K rows; V rows], one index per kernel: a forward pass
        # at decode batch sizes is bound by its launches.
        kv_off = batch.kv_offsets[layer]
        targets = (batch.write_slots + kv_off).reshape(-1)
        kv = torch.cat((k, v))
        if batch.write_keep is not None:
            kv = torch.where(batch.write_keep, kv, rows.index_select(0, targets))
        rows.index_copy_(0, targets, kv)
        if self.attention == "sdpa":
            return self._sdpa_attend(rows, batch, kv_off, q)
        return self._flex_attend(rows, batch, k_off, v_off, q)

    def _sdpa_attend(
        self, rows: Tensor, batch: _Batch, kv_off: Tensor, q: Tensor
    ) -> Tensor:
        # Gather + SDPA, chosen over flex_attention by measurement on a 2-core CPU machine
        # (python -m statekv_models.bench_attention --threads 1 --repeats 40 [--decodes 64]
        # [--variants flex | flex-compiled]): tiny model, block size 16, one batch of a
        # 256-token prefill, a 128-token prefill after a 512-token cached prefix and 16 (64)
        # decodes at contexts 300-600.  CPU ms per forward pass, median:
        #   gather + SDPA, one call per chunk ........ 17.2  (35.5)
        #   gather + SDPA, decodes in one padded call  19.3  (51.0)
        #   packed gather + flex_attention, eager .... 1040     (materializes every score)
        #   packed gather + flex_attention, compiled . 71, of which 52 build the block mask,
        #                                              after a 10 s compile per batch shape
        # With 2 threads the two SDPA variants tie (13.3 / 13.7 ms wall, 16 decodes).  The
        # machine is shared, so wall times drift; the ratios held across runs.
        # Reading only [0, ctx) of a chunk's own pages is also what makes stale or NaN bytes
        # elsewhere in the pool harmless: a masked score still multiplies its value row, and
        # 0 * NaN is NaN.
        out = torch.empty_like(q).reshape(q.shape[0], self._q_size)
        hkv, d = self.num_kv_heads, self.config.head_dim
        if batch.read_slots.numel():
            kk, vv = rows.index_select(0, (batch.read_slots + kv_off).reshape(-1)).view(
                2, -1, hkv, d).unbind(0)
            for _chunk, qs, qn, ks, ctx in batch.prefill:
                qc = q[qs : qs + qn].transpose(0, 1).unsqueeze(0)
                kc = kk[ks : ks + ctx].transpose(0, 1).unsqueeze(0)
                vc = vv[ks : ks + ctx].transpose(0, 1).unsqueeze(0)
                if ctx == qn:
                    o = nnf.scaled_dot_product_attention(
                        qc, kc, vc, is_causal=True, enable_gqa=True
                    )
                else:
                    # Queries sit at the end of the context: lower-right causal alignment,
                    # which CausalBias dispatches to flash / memory-efficient kernels on GPUs.
                    o = nnf.scaled_dot_product_attention(
                        qc, kc, vc, attn_mask=causal_lower_right(qn, ctx), enable_gqa=True
                    )
                out[qs : qs + qn] = o.squeeze(0).transpose(0, 1).reshape(qn, self._q_size)
        nd = batch.decode_chunks.numel()
        if nd:
            valid = batch.decode_valid
            shape = (*batch.decode_slots.shape, hkv, d)
            flat = batch.decode_slots.reshape(-1)
            # Padding entries repeat a written row of their own decode's context, so they
            # are finite and the mask alone weighs them 0 (see the NaN note above): no pass
            # over the gathered context to zero them.
            kd, vd = rows.index_select(0, (flat + kv_off).reshape(-1)).view(2, *shape).unbind(0)
            # One query per sequence: the query heads that share a KV head are laid out as
            # that head's query rows ([nd, hkv, group, d]; head h reads KV head h // group,
            # as enable_gqa would).  The call then needs no GQA support, only a padding mask,
            # which the memory-efficient kernel takes.  With enable_gqa and a mask, no fused
            # CUDA kernel but cuDNN's applies (flash takes no mask, memory-efficient no GQA),
            # and the math fallback repeats every KV head group times over the whole context.
            qd = q.index_select(0, batch.decode_chunks).view(nd, hkv, -1, d)
            o = nnf.scaled_dot_product_attention(
                qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=valid[:, None, None, :],
            )
            out.index_copy_(0, batch.decode_chunks, o.reshape(nd, self._q_size))
        return out

    def _flex_attend(
        self, rows: Tensor, batch: _Batch, k_off: int, v_off: int, q: Tensor
    ) -> Tensor:
        # Every chunk's context, packed into one KV sequence; the block mask keeps each query
        # to its own chunk's [0, position].
        assert batch.flex_mask is not None
        kk = rows.index_select(0, batch.read_slots + k_off).transpose(0, 1).unsqueeze(0)
        vv = rows.index_select(0, batch.read_slots + v_off).transpose(0, 1).unsqueeze(0)
        with warnings.catch_warnings():
            # Eager flex is selected knowingly (attention="flex"): see _sdpa_attend's numbers.
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            o = self._flex(
                q.transpose(0, 1).unsqueeze(0), kk, vv, block_mask=batch.flex_mask,
                enable_gqa=True,
            )
        return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], self._q_size)

    # ------------------------------------------------------------------ validation, metadata

    def _check_pool(self, pool: object) -> None:
        if not isinstance(pool, Tensor):
            raise UsageError("pool", f"must be a torch.Tensor, got {type(pool).__name__}")
        c = self.config
        expected = (c.num_layers, 2, pool.shape[3] if pool.ndim == 6 else -1,
                    self.num_kv_heads, c.head_dim)
        if pool.ndim != 6 or tuple(pool.shape[1:]) != expected or pool.shape[0] < 1:
            raise UsageError(
                "pool",
                f"must have shape [num_blocks, {c.num_layers}, 2, block_size, "
                f"{self.num_kv_heads}, {c.head_dim}], got {tuple(pool.shape)}",
            )
        if pool.dtype != self.dtype:
            raise UsageError("pool", f"must have dtype {self.dtype}, got {pool.dtype}")
        if pool.device != self.device and not (
            pool.device.type == self.device.type and self.device.index is None
        ):
            raise UsageError("pool", f"must be on {self.device}, got {pool.device}")
        if not pool.is_contiguous():
            raise UsageError("pool", "must be contiguous (one block's bytes in one run)")

    def _token_tensor(self, field: str, token_ids: object) -> Tensor:
        if isinstance(token_ids, str | bytes | Tensor) or not isinstance(token_ids, Sequence):
            raise UsageError(field, "must be a sequence of integer token ids")
        if len(token_ids) == 0:
            raise UsageError(field, "must hold at least one token")
        return torch.from_numpy(
            _int_array(field, list(token_ids), self.config.vocab_size, "the vocabulary"))

    def _prepare(self, pool: Tensor, chunks: Sequence[Chunk]) -> _Prepared:
        # Python touches each chunk once (validation, list building); everything per token or
        # per page is a fixed number of vectorized CPU ops, then one copy to the device.
        if not isinstance(chunks, Sequence) or not chunks:
            raise UsageError("chunks", "must be a non-empty sequence of Chunk")
        num_blocks, bs = pool.shape[0], pool.shape[3]
        page_rows = pool.shape[1] * 2 * bs  # flat [heads, dim] rows per page
        tokens: list[int] = []
        pages: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        npages: list[int] = []
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, Chunk):
                raise UsageError(f"chunks[{i}]", f"must be a Chunk, got {type(chunk).__name__}")
            ids, start, bt = chunk.token_ids, chunk.start, chunk.block_table
            if isinstance(ids, str | bytes | Tensor) or not isinstance(ids, Sequence):
                raise UsageError(f"chunks[{i}].token_ids", "must be a sequence of integer ids")
            if len(ids) == 0:
                raise UsageError(f"chunks[{i}].token_ids", "must hold at least one token")
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise UsageError(f"chunks[{i}].start", f"must be an integer >= 0, got {start!r}")
            if isinstance(bt, str | bytes | Tensor) or not isinstance(bt, Sequence):
                raise UsageError(f"chunks[{i}].block_table", "must be a sequence of page ids")
            ctx = start + len(ids)
            need = -(-ctx // bs)
            if len(bt) < need:
                raise UsageError(
                    f"chunks[{i}].block_table",
                    f"has {len(bt)} pages, positions [0, {ctx}) need {need} of {bs} tokens",
                )
            tokens.extend(ids)
            pages.extend(bt[:need])
            starts.append(start)
            lens.append(len(ids))
            npages.append(need)
        # The index arithmetic runs in NumPy: each torch call lets the interpreter lock go
        # and takes it back, about a hundred of them here a step, and under disk load the
        # cache's threads took the lock at those moments (bench.io's busy step on the H200).
        tok = _int_array_per_chunk("token_ids", tokens, lens, self.config.vocab_size,
                                   "the vocabulary")
        tab = _int_array_per_chunk("block_table", pages, npages, num_blocks, "the pool")

        nchunks = len(chunks)
        i64 = np.int64
        start_t = np.array(starts, dtype=i64)
        len_t = np.array(lens, dtype=i64)
        np_t = np.array(npages, dtype=i64)
        q_off = np.cumsum(len_t) - len_t
        t_off = np.cumsum(np_t) - np_t
        chunk_ids = np.arange(nchunks, dtype=i64)
        _check_page_ownership(tab, np.repeat(chunk_ids, np_t), t_off, start_t // bs,
                              num_blocks)

        def slots(chunk_of: NDArray[np.int64], pos: NDArray[np.int64]) -> NDArray[np.int64]:
            found: NDArray[np.int64] = tab[t_off[chunk_of] + pos // bs] * page_rows + pos % bs
            return found

        ntok = len(tokens)
        tok_chunk = np.repeat(chunk_ids, len_t)
        positions = np.arange(ntok, dtype=i64) - q_off[tok_chunk] + start_t[tok_chunk]
        write_slots = slots(tok_chunk, positions)
        last_index = q_off + len_t - 1

        flex = self.attention != "sdpa"
        batched = not flex and self.batch_decodes
        prefill: list[tuple[int, int, int, int, int]] = []
        decode_idx: list[int] = []
        qs = ks = 0
        for i in range(nchunks):
            n, ctx = lens[i], starts[i] + lens[i]
            if n == 1 and batched:
                decode_idx.append(i)
            else:
                prefill.append((i, qs, n, ks, ctx))
                ks += ctx
            qs += n
        pre_t = np.array([p[0] for p in prefill], dtype=i64)
        pre_ctx = start_t[pre_t] + len_t[pre_t]
        kv_chunk = np.repeat(pre_t, pre_ctx)
        kv_pos = np.arange(ks, dtype=i64) - np.repeat(np.cumsum(pre_ctx) - pre_ctx, pre_ctx)
        read_slots = slots(kv_chunk, kv_pos)

        dec_t = np.array(decode_idx, dtype=i64)
        dec_ctx = start_t[dec_t] + 1
        width = int(dec_ctx.max()) if decode_idx else 0
        decode_valid = np.arange(width, dtype=i64)[None, :] < dec_ctx[:, None]
        decode_slots = _decode_rows(tab, t_off[dec_t], np_t[dec_t], decode_valid, bs,
                                    page_rows)
        decode_chunks = q_off[dec_t]

        decodes = None
        if not prefill and self._decode_graphs is not None:
            decodes = DecodeInputs(
                token_ids=tok, positions=positions, write_rows=write_slots,
                context_rows=decode_slots, context_valid=decode_valid,
            )
        return _Prepared(decodes=decodes, upload=functools.partial(
            self._upload, tok=tok, positions=positions, write_slots=write_slots,
            last_index=last_index, read_slots=read_slots, decode_chunks=decode_chunks,
            decode_slots=decode_slots, decode_valid=decode_valid, q_off=q_off, lens=lens,
            prefill=tuple(prefill), tok_chunk=tok_chunk, kv_chunk=kv_chunk, kv_pos=kv_pos,
            block_size=bs,
        ))

    def _upload(
        self, *, tok: NDArray[np.int64], positions: NDArray[np.int64],
        write_slots: NDArray[np.int64], last_index: NDArray[np.int64],
        read_slots: NDArray[np.int64], decode_chunks: NDArray[np.int64],
        decode_slots: NDArray[np.int64], decode_valid: NDArray[np.bool_],
        q_off: NDArray[np.int64], lens: list[int],
        prefill: tuple[tuple[int, int, int, int, int], ...], tok_chunk: NDArray[np.int64],
        kv_chunk: NDArray[np.int64], kv_pos: NDArray[np.int64], block_size: int,
    ) -> _Batch:
        dev = self.device
        nlayers = len(self.layers)
        ntok, ks, i64 = tok.size, read_slots.size, np.int64
        parts = [tok, positions, write_slots, last_index, read_slots, decode_chunks,
                 decode_slots.reshape(-1), np.arange(2 * nlayers, dtype=i64) * block_size]
        ints = _to_device(torch.from_numpy(np.concatenate(parts)), dev)
        t, pos, wr, last, rd, dch, dsl, kv_offsets = ints.split_with_sizes(
            [p.size for p in parts])
        flex_mask: BlockMask | None = None
        if self.attention != "sdpa":
            docs = _to_device(torch.from_numpy(np.concatenate([tok_chunk, kv_chunk, kv_pos])),
                              dev)
            q_doc, kv_doc, kv_p = docs.split_with_sizes([ntok, ks, ks])

            def same_chunk_causal(
                _b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor
            ) -> Tensor:
                allowed: Tensor = (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_p[kv_idx] <= pos[q_idx])
                return allowed

            flex_mask = create_block_mask(same_chunk_causal, None, None, ntok, ks, device=dev)
        return _Batch(
            token_ids=t, positions=pos, write_slots=wr,
            q_ranges=tuple((a, a + n) for a, n in zip(q_off.tolist(), lens, strict=True)),
            last_index=last, prefill=prefill, read_slots=rd, decode_chunks=dch,
            decode_slots=dsl.view(decode_slots.shape),
            decode_valid=_to_device(torch.from_numpy(decode_valid), dev), flex_mask=flex_mask,
            kv_offsets=kv_offsets.view(nlayers, 2, 1),
        )


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` copied to `device` without making the calling thread wait for the GPU.

    A copy from pageable memory does: the driver stages it only once the stream has drained
    what was queued before it, and the compute stream may be waiting there behind the copy
    stream's page copies (the cache orders each forward pass after them), so the serving
    thread would stall on other requests' transfers.  From pinned memory the copy is queued
    and the thread goes on; torch's pinned allocator keeps the staging block until the copy
    has run.
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _int_array(field: str, values: list[object], high: int, what: str) -> NDArray[np.int64]:
    """values as an int64 array, each in [0, high); UsageError naming `field` otherwise."""
    try:
        # No dtype given: NumPy infers float, bool or object for values that are not all
        # integers, which are refused below instead of being truncated to integers.
        a = np.array(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(field, f"must hold integers: {exc}") from None
    if a.ndim != 1 or a.dtype != np.int64:
        raise UsageError(field, "must be a flat sequence of integers")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= high:
        raise UsageError(field, f"{lo if lo < 0 else hi} is outside {what} [0, {high})")
    return a


def _int_array_per_chunk(
    name: str, values: list[int], counts: list[int], high: int, what: str
) -> NDArray[np.int64]:
    """One array for every chunk's values; on error, name the chunk at fault."""
    try:
        return _int_array(name, list(values), high, what)
    except UsageError:
        pass
    offset = 0
    for i, count in enumerate(counts):
        _int_array(f"chunks[{i}].{name}", list(values[offset : offset + count]), high, what)
        offset += count
    raise InvariantViolation(f"{name}: the batch failed validation but no chunk did")


def _decode_rows(
    table: NDArray[np.int64], table_offset: NDArray[np.int64], pages: NDArray[np.int64],
    valid: NDArray[np.bool_], block_size: int, page_rows: int,
) -> NDArray[np.int64]:
    """[decodes, width] flat layer-0 K rows of each decode's context (`valid`: [decodes,
    width], its [0, ctx)), built a page at a time: at long contexts a decode step's
    preparation goes here (3 decodes of 18k tokens are 54k entries).  Each decode's entries
    past its own context repeat its position-0 row: a row of its own table, written, so
    finite (_Batch.decode_slots)."""
    n, width = valid.shape
    span = -(-width // block_size)
    page_of = np.minimum(np.arange(span, dtype=np.int64)[None, :], pages[:, None] - 1)
    first = table[table_offset[:, None] + page_of] * page_rows
    rows = (first[:, :, None] + np.arange(block_size, dtype=np.int64)).reshape(
        n, span * block_size)
    padded: NDArray[np.int64] = np.where(valid, rows[:, :width], rows[:, :1])
    return padded


def _check_page_ownership(
    table: NDArray[np.int64], page_chunk: NDArray[np.int64], table_offset: NDArray[np.int64],
    first_written: NDArray[np.int64], num_blocks: int,
) -> None:
    """Refuse aliasing: a page listed twice by one chunk, or written by one and used by another.

    A page before a chunk's start may be shared (a cached prefix, read only); a page it writes
    into must be its own, or one chunk would read K/V that another is overwriting.
    """
    ordered = np.sort(table)
    if not (ordered[1:] == ordered[:-1]).any():
        return  # no page listed twice anywhere: the common batch, one sort
    keys, counts = np.unique(table + page_chunk * num_blocks, return_counts=True)
    if int(counts.max()) > 1:
        key = int(keys[counts > 1][0])
        raise UsageError(
            f"chunks[{key // num_blocks}].block_table",
            f"lists page {key % num_blocks} more than once",
        )
    pages, users = np.unique(table, return_counts=True)
    shared = pages[users > 1]
    if shared.size == 0:
        return
    local = np.arange(table.size, dtype=np.int64) - table_offset[page_chunk]
    written = local >= first_written[page_chunk]
    bad = np.flatnonzero(written & np.isin(table, shared))
    if bad.size:
        j = int(bad[0])
        raise UsageError(
            f"chunks[{int(page_chunk[j])}].block_table",
            f"page {int(table[j])} is written by this chunk and used by another of the batch",
        )
