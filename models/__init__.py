"""Random-weight paged-attention decoders and workload generators for statekv.

Installed as ``statekv_models`` (a top-level ``models`` package would shadow users' own).
"""

from .config import MODEL_DTYPES, PRESETS, WEIGHTS_VERSION, ModelConfig, preset
from .decode_graphs import DecodeGraphStatistics
from .model import (
    ATTENTION_BACKENDS,
    AllReduce,
    AttentionBackend,
    Chunk,
    PagedDecoder,
    StepOutput,
    generate_weight,
    greedy,
)
from .workloads import (
    ChatSession,
    ChatWorkload,
    ChatWorkloadConfig,
    OpenChatWorkload,
    RagWorkload,
    RagWorkloadConfig,
    Workload,
    WorkloadRequest,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "MODEL_DTYPES",
    "PRESETS",
    "WEIGHTS_VERSION",
    "AllReduce",
    "AttentionBackend",
    "ChatSession",
    "ChatWorkload",
    "ChatWorkloadConfig",
    "Chunk",
    "DecodeGraphStatistics",
    "ModelConfig",
    "OpenChatWorkload",
    "PagedDecoder",
    "RagWorkload",
    "RagWorkloadConfig",
    "StepOutput",
    "Workload",
    "WorkloadRequest",
    "generate_weight",
    "greedy",
    "preset",
]
