"""``vlm`` (alias ``qwen3vl``): batch vision-language samples with any number of images (of any sizes) per
sample, for every image format of mm-data-vlm. The padding of the token fields is mm-core's
(:mod:`mm_core.data.collate`, shared with the text and audio collators)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.collate import COLLATE_FIELDS, META_FIELDS, Padding, meta_fields, pad_tokens
from mm_core.data.packing import pack_tokens

__all__ = ["COLLATE_FIELDS", "META_FIELDS", "TOKEN_FIELDS", "Qwen3VLCollator", "VLMCollator"]

#: per-token fields: right-padded to the batch's width with these values (labels: see ``ignore_pad_token``)
TOKEN_FIELDS = ("input_ids", "labels", "mm_token_type_ids")


class VLMCollator:
    """Right-pads ``input_ids`` (pad id), ``labels`` (-100) and ``mm_token_type_ids`` (0, when the samples
    carry it) to the longest sample (rounded up to ``pad_to_multiple_of``), adds ``attention_mask``, and
    concatenates every sample's pixel inputs along dim 0 in sample order (the order the image tokens appear
    in the flattened batch): Qwen-VL's ``pixel_values`` [patches, dim] and ``image_grid_thw`` [images, 3],
    Kimi K2.5's [patches, 3, P, P], Step 3.7's global views and crops, ... A batch without images has no
    pixel key. ``sample_id`` is a tensor [B]; ``skipped_samples`` (records skipped by ``on_error: skip``) an
    int. With ``packing`` (``data.dataloader_param.packing``) the token fields are concatenated into one row
    (:func:`mm_core.data.packing.pack_tokens`; the pixel inputs stay in sample order)."""

    #: set by mm_core.data.builder when ``data.dataloader_param.packing`` is true
    packing = False

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        self.padding = Padding.read(collate_param, dataset)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        pads = {
            "input_ids": self.padding.pad_token_id,
            "labels": self.padding.label_pad_id,
            "mm_token_type_ids": 0,
        }
        present = {k: pads[k] for k in TOKEN_FIELDS if features and k in features[0]}
        batch: dict[str, Any] = (pack_tokens if self.packing else pad_tokens)(features, present, self.padding)
        skip = (*TOKEN_FIELDS, *META_FIELDS)
        pixel_keys = sorted({k for f in features for k in f if k not in skip})
        for key in pixel_keys:
            parts = [f[key] for f in features if key in f]
            batch[key] = torch.cat(parts)
        batch.update(meta_fields(features))
        return batch


#: the name the Qwen-VL recipes use
Qwen3VLCollator = VLMCollator
