"""A KV connector that moves no data and writes down every call vLLM makes to it, with the
process and role, one JSON object a line in kv_connector_extra_config["log"]; FACTS.md rests on
what it recorded.

It can pretend to load asynchronously (requests whose kv_transfer_params say
{"probe_async_load": true}: it claims all but the last block-aligned part of the prompt and
reports the load done two worker steps later) and to save asynchronously
({"probe_async_save": true}: request_finished keeps the blocks, the worker reports the save
two steps after the request finished).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

_STEPS_UNTIL_DONE = 2


@dataclass
class ProbeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    step: int
    loads: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)


class ProbeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._log_path = str(extra["log"])
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._step = 0
        self._to_load: list[str] = []
        self._to_save: list[str] = []
        self._loading: dict[str, int] = {}
        self._saving: dict[str, int] = {}
        self._finished_seen: set[str] = set()
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._record(
            "init",
            kv_load_failure_policy=str(vllm_config.kv_transfer_config.kv_load_failure_policy),
        )

    def _record(self, event: str, **fields: Any) -> None:
        line = {"pid": os.getpid(), "role": self._role_name, "event": event, **fields}
        with open(self._log_path, "a") as log:
            log.write(json.dumps(line, default=str) + "\n")

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._record(
            "register_kv_caches",
            layers={
                name: {
                    "shape": list(t.shape),
                    "dtype": str(t.dtype),
                    "stride": list(t.stride()),
                    "contiguous": t.is_contiguous(),
                    "data_ptr": t.data_ptr(),
                    "storage_bytes": t.untyped_storage().nbytes(),
                }
                for name, t in kv_caches.items()
            },
        )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Called before each step's forward: on the first, clear what warm-up left in the
        # caches, so that _nonzero_rows shows where this step's tokens land.
        if kv_connector_metadata.step == 1:
            for cache in self._kv_caches.values():
                cache.zero_()
        self._record("handle_preemptions", step=kv_connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id in meta.loads:
            self._loading[req_id] = _STEPS_UNTIL_DONE
        self._record("start_load_kv", step=meta.step, loads=meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._record("save_kv_layer", layer=layer_name, shape=list(kv_layer.shape))

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for req_id in meta.saves:
            self._saving[req_id] = _STEPS_UNTIL_DONE
        self._record("wait_for_save", step=meta.step, saves=meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_seen |= finished_req_ids
        done_loading = _count_down(self._loading)
        done_saving = {r for r in _count_down(self._saving) if r in self._finished_seen}
        self._record(
            "get_finished",
            finished_req_ids=sorted(finished_req_ids),
            finished_sending=sorted(done_saving),
            finished_recving=sorted(done_loading),
            nonzero_rows=self._nonzero_rows(),
        )
        return done_saving or None, done_loading or None

    def _nonzero_rows(self) -> dict[int, list[int]]:
        """For the first layer: per block that holds anything, the rows (of block_size *
        2 rows of head_size) that are non-zero for head 0 -- which half holds K and V."""
        if not self._kv_caches:
            return {}
        cache = next(iter(self._kv_caches.values()))
        if cache.dim() != 4:
            return {}
        blocks, _heads, block_size, _content = cache.shape
        rows = cache[:, 0].reshape(blocks, block_size * 2, -1).abs().sum(-1) != 0
        return {
            int(b): [int(r) for r in rows[b].nonzero().flatten()]
            for b in rows.any(-1).nonzero().flatten()[:4]
        }

    def build_connector_worker_meta(self) -> None:
        self._record("build_connector_worker_meta")

    def shutdown(self) -> None:
        self._record("shutdown")

    # Scheduler side.

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        claim = 0
        if params.get("probe_async_load"):
            block = self._vllm_config.cache_config.block_size
            claim = max(0, (request.num_tokens - 1) // block * block - num_computed_tokens)
        self._record(
            "get_num_new_matched_tokens",
            request_id=request.request_id,
            num_computed_tokens=num_computed_tokens,
            num_tokens=request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_token_ids_len=len(request.prompt_token_ids or ()),
            all_token_ids_len=len(request.all_token_ids),
            request_num_computed_tokens=request.num_computed_tokens,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
            kv_transfer_params=request.kv_transfer_params,
            num_block_hashes=len(request.block_hashes),
            status=str(request.status),
            claim=claim,
        )
        return claim, claim > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._to_load.append(request.request_id)
        self._record(
            "update_state_after_alloc",
            request_id=request.request_id,
            num_external_tokens=num_external_tokens,
            block_ids=[list(g) for g in blocks.get_block_ids()],
        )

    def build_connector_meta(self, scheduler_output: Any) -> ProbeMetadata:
        self._step += 1
        meta = ProbeMetadata(step=self._step, loads=self._to_load, saves=self._to_save)
        self._to_load, self._to_save = [], []
        self._record(
            "build_connector_meta",
            step=self._step,
            total_num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            finished_req_ids=sorted(scheduler_output.finished_req_ids),
            preempted_req_ids=sorted(scheduler_output.preempted_req_ids or ()),
            loads=meta.loads,
            saves=meta.saves,
        )
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._record(
            "update_connector_output",
            finished_sending=sorted(connector_output.finished_sending or ()),
            finished_recving=sorted(connector_output.finished_recving or ()),
            invalid_block_ids=sorted(connector_output.invalid_block_ids or ()),
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        keep = bool(params.get("probe_async_save"))
        if keep:
            self._to_save.append(request.request_id)
        self._record(
            "request_finished",
            request_id=request.request_id,
            block_ids=list(block_ids),
            status=str(request.status),
            keep_blocks=keep,
        )
        return keep, {"probe_echo": params, "probe_pid": os.getpid()}


def _count_down(pending: dict[str, int]) -> set[str]:
    done = set()
    for req_id in list(pending):
        pending[req_id] -= 1
        if pending[req_id] <= 0:
            done.add(req_id)
            del pending[req_id]
    return done
