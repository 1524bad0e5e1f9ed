"""Qwen-VL images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5): transformers' own
``Qwen2VLImageProcessorPil`` (PIL, no torchvision) gives ``pixel_values`` [patches, C·T·P²] and
``image_grid_thw``; an image becomes ``<|vision_start|>`` + N ``<|image_pad|>`` + ``<|vision_end|>``
with N its merged patches (``grid_thw.prod() // merge²``, the ``Qwen3VLProcessor`` rule).

The pixels and placeholders are :class:`mm_data_vlm.qwen_vl_images.QwenVLImages` (shared with mm-data-audio,
whose Qwen3-Omni samples carry Qwen-VL images); this is the :class:`ImageFormat` around them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from mm_data_vlm.qwen_vl_images import IMAGE_PAD, VISION_END, VISION_START, QwenVLImages

from . import ImageFormat

__all__ = ["IMAGE_PAD", "VISION_END", "VISION_START", "QwenVLFormat"]


class QwenVLFormat(ImageFormat):
    name: ClassVar[str] = "qwen-vl"
    processor_types: ClassVar[tuple[str, ...]] = ("Qwen2VLImageProcessor",)
    image_token: ClassVar[str] = IMAGE_PAD
    special_tokens: ClassVar[tuple[str, ...]] = (VISION_START, VISION_END, IMAGE_PAD)
    token_type_ids: ClassVar[bool] = True

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        super().__init__(config, min_pixels, max_pixels)
        self.qwen = QwenVLImages(self.config, min_pixels, max_pixels)
        self.processor = self.qwen.processor

    @property
    def target_pixels(self) -> int | None:
        size: Any = getattr(self.processor, "size", None)  # a dict or a SizeDict, or None
        value = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
        value = value or getattr(self.processor, "max_pixels", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        return self.qwen.pixels(images)

    def placeholder(self, width: int, height: int) -> str:
        return self.qwen.placeholder(width, height)

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        return self.qwen.feature_rows(pixels)
