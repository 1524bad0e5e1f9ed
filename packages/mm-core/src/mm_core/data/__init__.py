"""Data: datasets and collators from the registries, samplers, the StatefulDataLoader, moving batches."""

from mm_core.data.builder import (
    EpochIterator,
    EpochSampler,
    build_collator,
    build_dataloader,
    build_dataset,
    sample_lengths,
)
from mm_core.data.device import move_to_device
from mm_core.data.sampling import (
    EpochOrder,
    GlobalOrderSampler,
    SourceMixing,
    TokenBudgetBatchSampler,
    largest_remainder,
    mixed_order,
    source_mixing,
)

__all__ = [
    "EpochIterator",
    "EpochOrder",
    "EpochSampler",
    "GlobalOrderSampler",
    "SourceMixing",
    "TokenBudgetBatchSampler",
    "build_collator",
    "build_dataloader",
    "build_dataset",
    "largest_remainder",
    "mixed_order",
    "move_to_device",
    "sample_lengths",
    "source_mixing",
]
