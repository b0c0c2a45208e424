"""``StateKVConnector``: statekv as a vLLM v1 KV connector (vLLM 0.32; the interface is
experimental upstream, so the version is pinned in the ``vllm`` extra).

Load it with::

    --kv-transfer-config '{"kv_connector": "StateKVConnector",
                           "kv_connector_module_path": "io_actors.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host": "4 GiB", "disk": "100 GiB",
                                                         "disk_dir": "/var/cache/statekv"}}'

This module is the only one that imports vLLM: it reads vLLM's objects (the config, the
request, the scheduler output) and hands plain data to the two halves,
:class:`~io_actors.vllm.scheduler_side.SchedulerSide` in the engine-core process and
:class:`~io_actors.vllm.worker_side.WorkerSide` in each worker.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from io_actors.config import StateKVConfig
from io_actors.memory.pools import TORCH_DTYPES
from io_actors.vllm.plans import StepPlan, WorkerReport
from io_actors.vllm.scheduler_side import REPORTED_COUNTERS, SchedulerSide
from io_actors.vllm.settings import connector_config, write_through_policy
from io_actors.vllm.worker_side import WorkerSide
from statekv.config import KVLayout
from statekv.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_DTYPE_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}


class StateKVStepMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """The scheduler side's plan for one step, as vLLM carries it to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class StateKVWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """One worker's report for one step; vLLM merges the ranks' reports with aggregate."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, StateKVWorkerMetadata):
            return self
        return StateKVWorkerMetadata(self.report.merged(other.report))


class StateKVStats(KVConnectorStats):  # type: ignore[misc]
    """The core's counters' increases over an interval: ``data`` maps a CacheStatistics
    field to how much it grew.  vLLM logs ``reduce()`` and feeds Prometheus from ``data``."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in (other.data or {}).items():
            merged[name] = merged.get(name, 0) + value
        return StateKVStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {f"statekv_{name}": value for name, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StateKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One counter per reported core counter: ``vllm:statekv_<name>_total``, per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:statekv_{name}_total",
                documentation=f"statekv's {name.replace('_', ' ')} (CacheStatistics.{name})",
                labelnames=labelnames)
            for name in REPORTED_COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name)
            if counter is not None and value > 0:
                counter.labels(*labels).inc(value)


def engine_config(vllm_config: VllmConfig, *, rank: int) -> StateKVConfig:
    """The StateKVConfig of one rank, from vLLM's config and the connector's extra config.

    Both halves build it the same way from the same vLLM config, so the scheduler side's
    pages and slots mean the same bytes on every worker (the worker checks its caches
    against this layout at register_kv_caches).
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    transfer = vllm_config.kv_transfer_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size", "statekv's connector supports tensor "
                          "parallelism only (one worker per rank)")
    if model.use_mla:
        raise ConfigError("model", "MLA caches (one latent vector per token) are not "
                          "supported by statekv's connector")
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    dtype_name = _DTYPE_NAMES.get(dtype) if isinstance(dtype, torch.dtype) else None
    if dtype_name is None:
        raise ConfigError("cache_dtype", f"statekv stores float32, float16, bfloat16 and fp8 "
                          f"KV, not {dtype!r}")
    layers = model.get_num_layers(parallel)
    layout = KVLayout(num_layers=layers, num_kv_heads=model.get_num_kv_heads(parallel),
                      head_dim=model.get_head_size(), dtype=dtype_name)
    block_size = cache.block_size
    fingerprint = f"vllm:{model.model}:{model.revision}:{dtype_name}:{model.quantization}"
    load_format = getattr(vllm_config.load_config, "load_format", "")
    if load_format == "dummy":  # random weights: the seed is the weights
        fingerprint += f":dummy-seed={model.seed}"
    extra = transfer.kv_connector_extra_config if transfer is not None else {}
    return connector_config(
        extra, layout=layout, block_size=block_size,
        gpu_blocks=-(-model.max_model_len // block_size) + 1, rank=rank,
        default_fingerprint=fingerprint,
    )


def _salt(request: Request) -> str:
    """The key salt of a request: vLLM's ``cache_salt`` and, for a multimodal request, the
    identity and place of every input beside its tokens.  A placeholder token stands for an
    image or audio clip: two requests with the same tokens and other images must never share
    KV, so every block of such a request is keyed by all of its inputs (vLLM keys only the
    blocks an input overlaps; statekv gives up sharing the text before an image instead of
    being wrong about it).  JSON keeps the encoding one-to-one: no tenant's salt can spell
    another request's inputs."""
    features = getattr(request, "mm_features", None) or ()
    inputs = [[str(f.modality), str(f.identifier), int(f.mm_position.offset),
               int(f.mm_position.length)] for f in features]
    salt: object = request.cache_salt
    return json.dumps([salt if isinstance(salt, str) else None, inputs],
                      separators=(",", ":"))


def _cacheable(request: Request) -> bool:
    """Requests whose KV statekv keys by tokens: not prompt embeddings (no token ids)."""
    return getattr(request, "prompt_embeds", None) is None


def _lora_id(request: Request) -> int | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else int(lora.lora_int_id)


class StateKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """statekv's tiers (pinned host, local disk, persistent, with per-request TTLs) beneath
    vLLM's prefix cache."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        instance = vllm_config.instance_id
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # The local prefix hit each request was matched past, until its pages are allocated:
        # vLLM sets request.num_computed_tokens only after update_state_after_alloc.
        self._local_hit: dict[str, int] = {}
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ConfigError("kv_cache_config", f"{len(groups)} KV cache groups (a hybrid or "
                              "sliding-window model): statekv's connector supports models "
                              "whose layers share one paged KV cache")
        if role == KVConnectorRole.SCHEDULER:
            config = engine_config(vllm_config, rank=0)
            transfer = vllm_config.kv_transfer_config
            extra = transfer.kv_connector_extra_config if transfer is not None else {}
            self._scheduler = SchedulerSide(
                config, world_size=vllm_config.parallel_config.tensor_parallel_size,
                instance=instance, write_through=write_through_policy(extra))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            config = engine_config(vllm_config, rank=get_tensor_model_parallel_rank())
            self._worker = WorkerSide(config, instance=instance)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StateKVStepMetadata)
        self._worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # every load is asynchronous: vLLM schedules a request once it landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return None  # saves copy whole finished blocks (start_load_kv), not layer by layer

    def wait_for_save(self) -> None:
        return None  # save copies ran in start_load_kv; vLLM keeps the pages until reported

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        report = self._worker.report()
        return None if report is None else StateKVWorkerMetadata(report)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if not _cacheable(request):
            return 0, False
        n = self._scheduler.matched(
            list(request.all_token_ids), num_computed_tokens,
            cache_salt=_salt(request), lora_id=_lora_id(request))
        if n > 0:
            self._local_hit[request.request_id] = num_computed_tokens
        return n, n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        local_hit = self._local_hit.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        if local_hit is None:
            raise RuntimeError(f"statekv: request {request.request_id} was allocated "
                               f"{num_external_tokens} external tokens it was never matched")
        # The external tokens follow the local hit: request.num_computed_tokens is still 0
        # here on a first schedule (vLLM sets it after this call).
        (block_ids,) = blocks.get_block_ids()
        self._scheduler.allocated(
            request.request_id, list(request.all_token_ids), block_ids, num_external_tokens,
            local_hit, cache_salt=_salt(request), lora_id=_lora_id(request))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        longest = 0
        for new in scheduler_output.scheduled_new_reqs:
            longest = max(longest, len(new.prompt_token_ids or ()))
        cached = scheduler_output.scheduled_cached_reqs
        for computed in getattr(cached, "num_computed_tokens", ()):
            longest = max(longest, int(computed) + 1)
        plan = self._scheduler.plan(
            num_new_tokens=int(scheduler_output.total_num_scheduled_tokens),
            longest_context=longest)
        return StateKVStepMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, StateKVWorkerMetadata) else None
        self._scheduler.reported(report, connector_output.finished_recving or ())

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._local_hit.pop(request.request_id, None)
        if not _cacheable(request):
            return False, None
        tokens = list(request.all_token_ids)[: request.num_computed_tokens]
        return self._scheduler.finished(
            request.request_id, tokens, block_ids, request.kv_transfer_params,
            cache_salt=_salt(request), lora_id=_lora_id(request))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler side's counters since the last call (None in a worker: its
        transfers are counted by the core when they report)."""
        if self._scheduler is None:
            return None
        grown = self._scheduler.counter_increases()
        return StateKVStats(data=grown) if grown else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> KVConnectorStats | None:
        return StateKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return StateKVPromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """The engine-core half (None in a worker): its statistics, for tests and metrics."""
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide | None:
        return self._worker
