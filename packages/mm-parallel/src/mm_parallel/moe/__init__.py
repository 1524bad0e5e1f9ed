"""Expert parallelism for mixture-of-experts models with fused 3-D expert weights.

- :class:`ExpertParallelExperts` replaces a model's fused experts module: experts split over an ``ep`` mesh,
  tokens exchanged with all-to-all (uneven splits), grouped matrix products for the expert MLPs.
- :func:`swap_experts` installs it in a model's module tree; :func:`shard_experts` FSDP2-shards the expert
  weights over the ``efsdp`` mesh with the gradient divide factor that keeps gradients layout-independent.
- :func:`load_balancing_loss` is the router auxiliary loss computed from statistics reduced over the
  data-parallel ranks, so it equals the one-process value of the global micro-batch.
"""

from mm_parallel.moe.all_to_all import CommTimer, all_to_all, exchange_counts
from mm_parallel.moe.aux_loss import load_balancing_loss
from mm_parallel.moe.experts import (
    ExpertParallelExperts,
    expert_owner,
    expert_placement_fn,
    shard_experts,
    swap_experts,
    total_comm_seconds,
)
from mm_parallel.moe.grouped import expert_mlp, grouped_linear, grouped_mm_supported, tokens_per_expert

__all__ = [
    "CommTimer",
    "ExpertParallelExperts",
    "all_to_all",
    "exchange_counts",
    "expert_mlp",
    "expert_owner",
    "expert_placement_fn",
    "grouped_linear",
    "grouped_mm_supported",
    "load_balancing_loss",
    "shard_experts",
    "swap_experts",
    "tokens_per_expert",
    "total_comm_seconds",
]
