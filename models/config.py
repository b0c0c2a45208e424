"""The shape of a random-weight decoder, and the presets the benchmarks use.

A :class:`ModelConfig` names the weights completely: they are generated from the config and
its seed (:func:`statekv_models.model.generate_weight`), never downloaded, and they are
bit-identical on every device.  :meth:`ModelConfig.fingerprint` therefore identifies them, and
is what goes into ``statekv.CacheConfig.model_fingerprint`` so that KV persisted for other
weights is never reused.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Final

import attrs

from statekv.config import KVLayout
from statekv.errors import ConfigError

MODEL_DTYPES: Final = ("float32", "float16", "bfloat16")
"""Dtypes the decoder computes in (its KV pool has the same dtype)."""

WEIGHTS_VERSION: Final = 1
"""Version of the weight generator.  Part of the fingerprint: a change to how weights are
drawn from the seed must bump it, or KV persisted for the old weights would be served."""

MAX_SEED: Final = 2**64 - 1


def _positive_int(high: int | None = None) -> Any:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(attribute.name, f"must be an integer, got {value!r}")
        if value < 1:
            raise ConfigError(attribute.name, f"must be >= 1, got {value}")
        if high is not None and value > high:
            raise ConfigError(attribute.name, f"must be <= {high}, got {value}")

    return check


def _positive_float(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(attribute.name, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(attribute.name, f"must be finite and > 0, got {value!r}")


def _to_float(value: object) -> object:
    # Ints are accepted for convenience (rope_theta=500000) but stored as floats so that equal
    # configs have equal fingerprints whichever spelling built them.
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    vocab_size: int = attrs.field(validator=_positive_int(2**31 - 1))
    hidden: int = attrs.field(validator=_positive_int(65536))
    ffn: int = attrs.field(validator=_positive_int(262144))
    num_layers: int = attrs.field(validator=_positive_int(4096))
    num_heads: int = attrs.field(validator=_positive_int(4096))
    num_kv_heads: int = attrs.field(validator=_positive_int(4096))
    head_dim: int = attrs.field(validator=_positive_int(4096))
    rope_theta: float = attrs.field(
        default=500000.0, converter=_to_float, validator=_positive_float
    )
    rms_eps: float = attrs.field(default=1e-5, converter=_to_float, validator=_positive_float)
    dtype: str = attrs.field(default="bfloat16")
    seed: int = attrs.field(default=0)

    @dtype.validator
    def _check_dtype(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if value not in MODEL_DTYPES:
            raise ConfigError("dtype", f"unknown dtype {value!r} (known: {list(MODEL_DTYPES)})")

    @seed.validator
    def _check_seed(self, _attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
            raise ConfigError("seed", f"must be an integer in [0, 2**64), got {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_kv_heads",
                f"must divide num_heads ({self.num_heads}) for grouped-query attention, "
                f"got {self.num_kv_heads}",
            )
        if self.head_dim % 2:
            raise ConfigError(
                "head_dim", f"must be even for rotary embeddings, got {self.head_dim}"
            )

    def fingerprint(self) -> str:
        """A stable string that identifies these weights (config, seed, generator version).

        The same on every process, machine and device, because the weights are too.
        """
        fields = attrs.asdict(self)
        fields["weights_version"] = WEIGHTS_VERSION
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        digest = hashlib.blake2b(canonical, digest_size=16, person=b"statekv-model").hexdigest()
        return f"statekv-decoder-v{WEIGHTS_VERSION}-{digest}"

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ConfigError unless heads and the FFN split evenly across `tp_size` ranks."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError("tp_size", f"must be an integer >= 1, got {tp_size!r}")
        for name, count in (
            ("num_kv_heads", self.num_kv_heads),
            ("num_heads", self.num_heads),
            ("ffn", self.ffn),
        ):
            if count % tp_size:
                raise ConfigError(
                    "tp_size", f"must divide {name} ({count}) to split it across ranks, "
                    f"got {tp_size}",
                )

    def kv_layout(self, tp_size: int = 1) -> KVLayout:
        """The KV block layout of one tensor-parallel rank (its share of the kv heads)."""
        self.check_tp_size(tp_size)
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads // tp_size,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """KV bytes one token occupies on one rank, over all layers."""
        return self.kv_layout(tp_size).block_bytes(1)


@attrs.frozen(kw_only=True)
class _Preset:
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int
    """Layers a preset gets unless the caller asks for another depth."""
    full_depth: int
    """Layers of the real model of this shape (for reference; too deep for one GPU at 70B)."""
    rope_theta: float
    dtype: str


# The three Llama 3 shapes of DEVICE.md's break-even table.  A few layers keep the same
# FLOPs-per-KV-byte ratio as the full depth (a property of one layer), so benchmarks run a
# shallow model of the real width: 4 layers of the 70B class are ~3.4 B weights.
PRESETS: Final[dict[str, _Preset]] = {
    "tiny": _Preset(
        hidden=64, ffn=176, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512,
        num_layers=2, full_depth=2, rope_theta=10000.0, dtype="float32",
    ),
    "1b-class": _Preset(
        hidden=2048, ffn=8192, num_heads=32, num_kv_heads=8, head_dim=64, vocab_size=128256,
        num_layers=4, full_depth=16, rope_theta=500000.0, dtype="bfloat16",
    ),
    "8b-class": _Preset(
        hidden=4096, ffn=14336, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256,
        num_layers=4, full_depth=32, rope_theta=500000.0, dtype="bfloat16",
    ),
    "70b-class": _Preset(
        hidden=8192, ffn=28672, num_heads=64, num_kv_heads=8, head_dim=128, vocab_size=128256,
        num_layers=4, full_depth=80, rope_theta=500000.0, dtype="bfloat16",
    ),
}


def preset(
    name: str,
    *,
    num_layers: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> ModelConfig:
    """A named shape (``tiny``, ``1b-class``, ``8b-class``, ``70b-class``) as a ModelConfig.

    `num_layers` defaults to a shallow depth that fits one GPU (see PRESETS); `dtype` to the
    preset's (float32 for ``tiny``, which runs on CPUs, bfloat16 for the others).
    """
    if name not in PRESETS:
        raise ConfigError("name", f"unknown preset {name!r} (known: {sorted(PRESETS)})")
    p = PRESETS[name]
    return ModelConfig(
        vocab_size=p.vocab_size if vocab_size is None else vocab_size,
        hidden=p.hidden,
        ffn=p.ffn,
        num_layers=p.num_layers if num_layers is None else num_layers,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        rope_theta=p.rope_theta,
        dtype=p.dtype if dtype is None else dtype,
        seed=seed,
    )
