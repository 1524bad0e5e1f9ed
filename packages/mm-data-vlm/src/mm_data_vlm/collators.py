"""``qwen3vl``: batch Qwen-VL samples with any number of images (of any sizes) per sample."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.params import COLLATE, anything, boolean, optional_positive_int, read_params
from mm_core.errors import DataError

from .encode import IGNORE_INDEX

COLLATE_FIELDS = {
    "collator_id": anything(None),
    "model_name": anything(None),
    "ignore_pad_token_for_loss": boolean(True),
    "pad_to_multiple_of": optional_positive_int(None),
}


class Qwen3VLCollator:
    """Right-pads ``input_ids`` (pad id), ``labels`` (-100), ``mm_token_type_ids`` (0) to the longest sample
    (rounded up to ``pad_to_multiple_of``), adds ``attention_mask``, and concatenates every sample's image
    patches into ``pixel_values`` [all patches, dim] with ``image_grid_thw`` [all images, 3] in sample order
    (the order the model's image tokens appear in the flattened batch). A batch without images has neither
    key. ``sample_id`` is a tensor [B]; ``skipped_samples`` (records skipped by ``on_error: skip``) an int."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        params = read_params(collate_param, COLLATE_FIELDS, COLLATE)
        self.pad_to_multiple_of: int | None = params["pad_to_multiple_of"]
        self.pad_token_id = int(getattr(dataset, "pad_token_id", 0) or 0)
        self.label_pad_id = IGNORE_INDEX if params["ignore_pad_token_for_loss"] else self.pad_token_id

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise DataError("collate: got an empty list of samples")
        lengths = [int(f["input_ids"].shape[-1]) for f in features]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(features)
        batch: dict[str, Any] = {
            "input_ids": torch.full((b, width), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((b, width), self.label_pad_id, dtype=torch.long),
            "attention_mask": torch.zeros((b, width), dtype=torch.long),
            "mm_token_type_ids": torch.zeros((b, width), dtype=torch.long),
        }
        for row, (f, n) in enumerate(zip(features, lengths)):
            batch["input_ids"][row, :n] = f["input_ids"]
            batch["labels"][row, :n] = f["labels"]
            batch["attention_mask"][row, :n] = 1
            batch["mm_token_type_ids"][row, :n] = f["mm_token_type_ids"]
        with_images = [f for f in features if "pixel_values" in f]
        if with_images:
            batch["pixel_values"] = torch.cat([f["pixel_values"] for f in with_images])
            batch["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in with_images])
        batch["sample_id"] = torch.tensor([int(f.get("sample_id", -1)) for f in features], dtype=torch.long)
        batch["skipped_samples"] = sum(int(f.get("skipped_samples", 0)) for f in features)
        return batch
