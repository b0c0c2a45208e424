"""statekv: a correctness-first tiered KV cache for LLM serving (the pure core).

This package holds no I/O: no threads, clocks, trio, torch or environment reads.  It decides;
the actors in ``io_actors`` do.  See ``statekv.manager`` for the step protocol.
"""

from statekv.config import CacheConfig, KVLayout, SpillMode
from statekv.errors import (
    ConfigError,
    DirectoryInUse,
    IllegalTransition,
    InvariantViolation,
    NewerFormat,
    OutOfBlocks,
    StateKVError,
    TransferFailed,
    UsageError,
)
from statekv.ids import BlockHash, BlockId, PageId, RequestId, SlotId, TransferId
from statekv.lifecycle import TRANSITIONS, BlockEvent, BlockState
from statekv.manager import KVCacheManager, PrefixMatch, RequestStatus
from statekv.stats import CacheStatistics
from statekv.trace import RingTrace, TraceSink, TransitionRecord

__all__ = [
    "TRANSITIONS",
    "BlockEvent",
    "BlockHash",
    "BlockId",
    "BlockState",
    "CacheConfig",
    "CacheStatistics",
    "ConfigError",
    "DirectoryInUse",
    "IllegalTransition",
    "InvariantViolation",
    "KVCacheManager",
    "KVLayout",
    "NewerFormat",
    "OutOfBlocks",
    "PageId",
    "PrefixMatch",
    "RequestId",
    "RequestStatus",
    "RingTrace",
    "SlotId",
    "SpillMode",
    "StateKVError",
    "TraceSink",
    "TransferFailed",
    "TransferId",
    "TransitionRecord",
    "UsageError",
]
