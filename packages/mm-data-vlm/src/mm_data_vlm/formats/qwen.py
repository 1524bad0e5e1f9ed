"""Qwen-VL images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5): transformers' own
``Qwen2VLImageProcessorPil`` (PIL, no torchvision) gives ``pixel_values`` [patches, C·T·P²] and
``image_grid_thw``; an image becomes ``<|vision_start|>`` + N ``<|image_pad|>`` + ``<|vision_end|>``
with N its merged patches (``grid_thw.prod() // merge²``, the ``Qwen3VLProcessor`` rule)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..errors import EncodeError
from . import ImageFormat

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


class QwenVLFormat(ImageFormat):
    name: ClassVar[str] = "qwen-vl"
    processor_types: ClassVar[tuple[str, ...]] = ("Qwen2VLImageProcessor",)
    image_token: ClassVar[str] = IMAGE_PAD
    special_tokens: ClassVar[tuple[str, ...]] = (VISION_START, VISION_END, IMAGE_PAD)
    token_type_ids: ClassVar[bool] = True

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        super().__init__(config, min_pixels, max_pixels)
        limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        self.processor = Qwen2VLImageProcessorPil.from_dict(self.config, **limits)
        self.merge_size = int(getattr(self.processor, "merge_size", 1) or 1)

    @property
    def target_pixels(self) -> int | None:
        size: Any = getattr(self.processor, "size", None)  # a dict or a SizeDict, or None
        value = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
        value = value or getattr(self.processor, "max_pixels", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        try:
            out = self.processor(images=list(images), return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def placeholder(self, width: int, height: int) -> str:
        try:
            patches = int(self.processor.get_number_of_image_patches(height, width))
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return VISION_START + IMAGE_PAD * (patches // self.merge_size**2) + VISION_END

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        grid = pixels.get("image_grid_thw")
        return 0 if grid is None else sum(int(g.prod()) // self.merge_size**2 for g in grid)
