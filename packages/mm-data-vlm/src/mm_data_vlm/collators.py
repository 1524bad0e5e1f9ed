"""``vlm`` (alias ``qwen3vl``): batch vision-language samples with any number of images (of any sizes) per
sample, for every image format of mm-data-vlm."""

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

#: per-token fields: right-padded to the batch's width with these values (labels: see ``ignore_pad_token``)
TOKEN_FIELDS = ("input_ids", "labels", "mm_token_type_ids")
#: per-sample bookkeeping, never pixel inputs
META_FIELDS = ("sample_id", "skipped_samples")


class VLMCollator:
    """Right-pads ``input_ids`` (pad id), ``labels`` (-100) and ``mm_token_type_ids`` (0, when the samples
    carry it) to the longest sample (rounded up to ``pad_to_multiple_of``), adds ``attention_mask``, and
    concatenates every sample's pixel inputs along dim 0 in sample order (the order the image tokens appear
    in the flattened batch): Qwen-VL's ``pixel_values`` [patches, dim] and ``image_grid_thw`` [images, 3],
    Kimi K2.5's [patches, 3, P, P], Step 3.7's global views and crops, ... A batch without images has no
    pixel key. ``sample_id`` is a tensor [B]; ``skipped_samples`` (records skipped by ``on_error: skip``) an
    int."""

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
        pads = {"input_ids": self.pad_token_id, "labels": self.label_pad_id, "mm_token_type_ids": 0}
        token_fields = [k for k in TOKEN_FIELDS if k in features[0]]
        batch: dict[str, Any] = {k: torch.full((b, width), pads[k], dtype=torch.long) for k in token_fields}
        batch["attention_mask"] = torch.zeros((b, width), dtype=torch.long)
        for row, (f, n) in enumerate(zip(features, lengths)):
            for k in token_fields:
                batch[k][row, :n] = f[k]
            batch["attention_mask"][row, :n] = 1
        skip = (*TOKEN_FIELDS, *META_FIELDS)
        pixel_keys = sorted({k for f in features for k in f if k not in skip})
        for key in pixel_keys:
            parts = [f[key] for f in features if key in f]
            batch[key] = torch.cat(parts)
        batch["sample_id"] = torch.tensor([int(f.get("sample_id", -1)) for f in features], dtype=torch.long)
        batch["skipped_samples"] = sum(int(f.get("skipped_samples", 0)) for f in features)
        return batch


#: the name the Qwen-VL recipes use
Qwen3VLCollator = VLMCollator
