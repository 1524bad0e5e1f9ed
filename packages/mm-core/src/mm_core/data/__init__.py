"""Data: datasets and collators from the registries, the StatefulDataLoader, and moving batches."""

from mm_core.data.builder import EpochIterator, build_collator, build_dataloader, build_dataset
from mm_core.data.device import move_to_device

__all__ = ["EpochIterator", "build_collator", "build_dataloader", "build_dataset", "move_to_device"]
