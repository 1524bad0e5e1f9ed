"""Qwen-VL images: pixel inputs and placeholder text, for every dataset that feeds a Qwen-VL vision tower.

Used by mm-data-vlm's Qwen-VL format (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) and, through its declared
dependency on mm-data-vlm, by mm-data-audio's images beside audio (Qwen3-Omni's thinker, whose
``preprocessor_config.json`` carries the image processor's keys beside the feature extractor's).

transformers' own ``Qwen2VLImageProcessorPil`` (PIL, no torchvision) gives ``pixel_values``
[patches, C·T·P²] and ``image_grid_thw`` [images, 3]; an image becomes ``<|vision_start|>`` + N
``<|image_pad|>`` + ``<|vision_end|>`` with N its merged patches (``grid_thw.prod() // merge²``, the
``Qwen3VLProcessor`` rule), computed from the image's size alone, so datasets count tokens without decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.chat import EncodeError

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
#: the fields a sample with images carries (concatenated along dim 0 by a collator)
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


class QwenVLImages:
    """Qwen-VL pixels and placeholders from a ``preprocessor_config.json``'s image processor values;
    ``min_pixels`` / ``max_pixels`` replace the folder's own when given. The processor's own ``ValueError`` /
    ``TypeError`` for an unusable configuration propagates (the caller names the file)."""

    #: every special token :meth:`placeholder` writes
    special_tokens: tuple[str, ...] = (VISION_START, VISION_END, IMAGE_PAD)
    #: the token whose rows take image features
    image_token: str = IMAGE_PAD

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        self.processor: Any = Qwen2VLImageProcessorPil.from_dict(dict(config), **limits)
        self.merge_size = int(getattr(self.processor, "merge_size", 1) or 1)

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of one sample's RGB PIL images, in placeholder order."""
        try:
            out = self.processor(images=list(images), return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def placeholder(self, width: int, height: int) -> str:
        """The text of one image that reaches :meth:`pixels` at this size."""
        try:
            patches = int(self.processor.get_number_of_image_patches(height, width))
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return VISION_START + IMAGE_PAD * (patches // self.merge_size**2) + VISION_END

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        """Image-token rows the vision tower produces for these pixel inputs."""
        grid = pixels.get("image_grid_thw")
        return 0 if grid is None else sum(int(g.prod()) // self.merge_size**2 for g in grid)
