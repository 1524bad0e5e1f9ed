"""Memory features: activation recompute (full / selective), activation offload to host memory, and FSDP2
prefetch in execution order. Each takes modules and plain arguments; none knows about configs."""

from mm_parallel.memory.offload import ActivationOffloader, OffloadStats
from mm_parallel.memory.prefetch import ExecutionOrderPrefetch
from mm_parallel.memory.recompute import (
    OP_GROUPS,
    apply_recompute,
    read_once,
    resolve_ops,
    selective_policy,
    tape_contexts,
)

__all__ = [
    "OP_GROUPS",
    "ActivationOffloader",
    "ExecutionOrderPrefetch",
    "OffloadStats",
    "apply_recompute",
    "read_once",
    "resolve_ops",
    "selective_policy",
    "tape_contexts",
]
