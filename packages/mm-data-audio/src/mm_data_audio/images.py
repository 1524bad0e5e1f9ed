"""Images beside audio, for processors whose folder also holds a Qwen-VL image processor (Qwen3-Omni's thinker
takes images and audio; its ``preprocessor_config.json`` carries both the feature extractor's and the image
processor's keys).

The pixels and placeholders are :class:`mm_data_vlm.qwen_vl_images.QwenVLImages` (shared with mm-data-vlm's
Qwen-VL format): ``pixel_values`` [patches, C·T·P²] and ``image_grid_thw`` [images, 3]; an image becomes
``<|vision_start|>`` + N ``<|image_pad|>`` + ``<|vision_end|>`` with N its merged patches, computed from the
image's size, which the header gives without decoding (so the datasets count tokens from headers).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mm_data_vlm.qwen_vl_images import IMAGE_FIELDS, IMAGE_PAD, VISION_END, VISION_START, QwenVLImages

__all__ = [
    "IMAGE_FIELDS",
    "IMAGE_PAD",
    "IMAGE_PROCESSOR_TYPES",
    "VISION_END",
    "VISION_START",
    "QwenImages",
    "has_images",
    "image_size",
    "load_image",
]

#: ``image_processor_type`` values served (the torchvision, PIL and fast names of one processor)
IMAGE_PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")


def has_images(config: Mapping[str, Any]) -> bool:
    """Whether a ``preprocessor_config.json`` also configures an image processor."""
    return bool(config.get("image_processor_type"))


class QwenImages(QwenVLImages):
    """Qwen-VL pixels and placeholders from a ``preprocessor_config.json`` with ``image_processor_type``; a
    ``ValueError`` saying what is wrong when the type is not Qwen-VL's or the processor refuses the values."""

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        kind = config.get("image_processor_type")
        if kind not in IMAGE_PROCESSOR_TYPES:
            known = ", ".join(IMAGE_PROCESSOR_TYPES)
            raise ValueError(f"image_processor_type {kind!r} is not one mm-data-audio serves ({known})")
        try:
            super().__init__(config, min_pixels, max_pixels)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Qwen2VLImageProcessorPil refused the configuration: {e}") from None


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
