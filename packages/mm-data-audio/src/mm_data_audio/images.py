"""Images beside audio, for processors whose folder also holds a Qwen-VL image processor (Qwen3-Omni's thinker
takes images and audio; its ``preprocessor_config.json`` carries both the feature extractor's and the image
processor's keys).

transformers' own ``Qwen2VLImageProcessorPil`` (PIL, no torchvision) gives ``pixel_values`` [patches, C·T·P²]
and ``image_grid_thw`` [images, 3]; an image becomes ``<|vision_start|>`` + N ``<|image_pad|>`` +
``<|vision_end|>`` with N its merged patches (``grid.prod() // merge²``), computed from the image's size,
which the header gives without decoding (so the datasets count tokens from headers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import EncodeError

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
#: ``image_processor_type`` values served (the torchvision, PIL and fast names of one processor)
IMAGE_PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")
#: the fields a sample with images carries (concatenated along dim 0 by the collator)
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


def has_images(config: Mapping[str, Any]) -> bool:
    """Whether a ``preprocessor_config.json`` also configures an image processor."""
    return bool(config.get("image_processor_type"))


class QwenImages:
    """Qwen-VL pixels and placeholders from a ``preprocessor_config.json`` with ``image_processor_type``."""

    special_tokens = (VISION_START, VISION_END, IMAGE_PAD)
    image_token = IMAGE_PAD

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        kind = config.get("image_processor_type")
        if kind not in IMAGE_PROCESSOR_TYPES:
            known = ", ".join(IMAGE_PROCESSOR_TYPES)
            raise ValueError(f"image_processor_type {kind!r} is not one mm-data-audio serves ({known})")
        limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        try:
            self.processor = Qwen2VLImageProcessorPil.from_dict(dict(config), **limits)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Qwen2VLImageProcessorPil refused the configuration: {e}") from None
        self.merge_size = int(getattr(self.processor, "merge_size", 1) or 1)

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        try:
            out = self.processor(images=list(images), return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def placeholder(self, width: int, height: int) -> str:
        try:
            patches = int(self.processor.get_number_of_image_patches(height, width))
        except ValueError as e:
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return VISION_START + IMAGE_PAD * (patches // self.merge_size**2) + VISION_END

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        grid = pixels.get("image_grid_thw")
        return 0 if grid is None else sum(int(g.prod()) // self.merge_size**2 for g in grid)


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) from the header, nothing decoded; OSError naming the file when it is not an image
    (Pillow's decompression-bomb guard applies)."""
    from PIL import Image

    if not path.is_file():
        raise OSError(f"{path}: no such image file")
    try:
        with Image.open(path) as im:
            return im.size
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise OSError(f"{path}: not an image Pillow can read: {e}") from None


def load_image(path: Path) -> Any:
    """The image decoded as RGB; OSError naming the file when it cannot be."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise OSError(f"{path}: cannot decode the image: {e}") from None
