"""Kimi K2.5 images (``Kimi_K25ForConditionalGeneration``): what transformers' ``Kimi_K25ImageProcessor`` and
``Kimi_K25Processor`` produce, computed without torchvision.

Per image (``Kimi_K25ImageProcessor._preprocess``):

1. the NaViT size rule (``navit_resize``): never upscale; shrink so that the patch count
   ``(h // P) · (w // P)`` stays within ``max_patches`` and each side within ``size.max_height`` patches; then
   pad (right, bottom, with 0) to multiples of ``merge_size · P``;
2. antialiased bicubic resize of the uint8 image. torchvision resizes uint8 bicubic on the CPU with torch's
   native uint8 kernel (``interpolate(..., mode="bicubic", antialias=True)``); the same torch call is made
   here, so the pixels are those of the reference processor;
3. rescale and normalise, fused as ``(x - 255 · mean) / (255 · std)`` in float32;
4. ``pixel_values [gh · gw, 3, P, P]`` (patches in row-major grid order), ``image_grid_thw [[1, gh, gw]]``.

Placeholder: the model's chat template writes
``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` for an image and
``Kimi_K25Processor.replace_image_token`` expands the ``<|media_pad|>`` to ``gh · gw // merge²`` of them (the
rows the vision tower's 2 × 2 merge produces), so an image becomes ``<|media_begin|>image<|media_content|>`` +
N × ``<|media_pad|>`` + ``<|media_end|>`` ("image" is plain text).
The forward takes no ``mm_token_type_ids``.

``image_max_pixels`` of the YAML sets Kimi's patch budget ``max_patches = max_pixels // P²``; Kimi never
upscales, so ``image_min_pixels`` has no meaning for it and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import EncodeError
from . import ImageFormat

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
IMAGE_PREFIX = MEDIA_BEGIN + "image" + MEDIA_CONTENT

#: the defaults of ``Kimi_K25ImageProcessor`` (transformers 5.x)
DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "max_patches": 16384,
    "size": {"max_height": 512, "max_width": 512},
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255,
    "do_rescale": True,
    "do_normalize": True,
    "do_resize": True,
    "resample": 3,
}

#: PIL's code for bicubic resampling (``PILImageResampling.BICUBIC``), the only one Kimi uses
BICUBIC = 3


def navit_size(
    height: int, width: int, patch_size: int, merge_size: int, max_patches: int, max_side_patches: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((resized height, width), (padded height, width))`` of an image under Kimi's NaViT rule: the
    largest scale ≤ 1 that keeps ``(h // P) · (w // P)`` within ``max_patches`` and each side within
    ``max_side_patches · P`` pixels, then padding up to multiples of ``merge_size · P``."""
    rows = max(1.0, height // patch_size)
    cols = max(1.0, width // patch_size)
    side = max_side_patches * patch_size
    scale = min(1.0, math.sqrt(max_patches / (rows * cols)), side / height, side / width)
    new_h = min(max(1, int(height * scale)), side)
    new_w = min(max(1, int(width * scale)), side)
    unit = merge_size * patch_size
    return (new_h, new_w), (-(-new_h // unit) * unit, -(-new_w // unit) * unit)


class KimiK25Format(ImageFormat):
    """Kimi K2.5 images; see the module docstring for the rules it reproduces."""

    name: ClassVar[str] = "kimi-k2.5"
    processor_types: ClassVar[tuple[str, ...]] = ("Kimi_K25ImageProcessor",)
    image_token: ClassVar[str] = MEDIA_PAD
    special_tokens: ClassVar[tuple[str, ...]] = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)
    token_type_ids: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        super().__init__(config, min_pixels, max_pixels)
        cfg = {**DEFAULTS, **{k: v for k, v in self.config.items() if v is not None}}
        self.patch_size = _positive_int(cfg, "patch_size")
        self.merge_size = _positive_int(cfg, "merge_size")
        self.max_patches = _positive_int(cfg, "max_patches")
        size = cfg["size"]
        if not isinstance(size, Mapping) or size.get("max_height") != size.get("max_width"):
            raise ValueError(
                f"preprocessor_config.json size: got {size!r}; Kimi K2.5 needs max_height and max_width, "
                "equal (the most patches along each side)"
            )
        self.max_side_patches = _positive_int(size, "max_height", "size.max_height")
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if cfg[key] is not True:
                raise ValueError(
                    f"preprocessor_config.json {key}: got {cfg[key]!r}; mm's Kimi K2.5 format supports only "
                    "the model's own preprocessing (true)"
                )
        if cfg["resample"] != BICUBIC:
            raise ValueError(
                f"preprocessor_config.json resample: got {cfg['resample']!r}; Kimi K2.5 resizes bicubic "
                f"({BICUBIC})"
            )
        mean, std = (_triple(cfg, k) for k in ("image_mean", "image_std"))
        rescale = float(cfg["rescale_factor"])
        # transformers fuses rescale into normalisation: (x - mean / rescale) / (std / rescale), float32
        self._mean = (torch.tensor(mean) * (1.0 / rescale)).view(3, 1, 1)
        self._std = (torch.tensor(std) * (1.0 / rescale)).view(3, 1, 1)
        if min_pixels:
            raise ValueError(
                f"data.dataset_param.preprocess_parameters.image_min_pixels: got {min_pixels}; Kimi K2.5 "
                "never upscales an image (small images are padded to the merge grid), so it has no minimum; "
                "remove it"
            )
        if max_pixels:
            patches = max_pixels // self.patch_size**2
            if patches < 1:
                raise ValueError(
                    f"data.dataset_param.preprocess_parameters.image_max_pixels: got {max_pixels}; Kimi K2.5 "
                    f"budgets images in patches of {self.patch_size}x{self.patch_size} = "
                    f"{self.patch_size**2} pixels (max_patches = image_max_pixels // {self.patch_size**2}), "
                    f"so it must be at least {self.patch_size**2}"
                )
            self.max_patches = patches

    @property
    def target_pixels(self) -> int | None:
        side = self.max_side_patches * self.patch_size
        return min(self.max_patches * self.patch_size**2, side * side)

    def _grid(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        if width < 1 or height < 1:
            raise EncodeError(f"the image is {width}x{height} pixels; Kimi K2.5 needs at least one pixel")
        return navit_size(
            height, width, self.patch_size, self.merge_size, self.max_patches, self.max_side_patches
        )

    def _one(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        if image.mode != "RGB":
            image = image.convert("RGB")
        width, height = image.size
        (new_h, new_w), (pad_h, pad_w) = self._grid(width, height)
        x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()[None]
        if (new_h, new_w) != (height, width):
            # torch's native uint8 antialiased bicubic: what torchvision runs for Kimi's processor on the CPU
            x = F.interpolate(x, size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=True)
        if (pad_h, pad_w) != (new_h, new_w):
            x = F.pad(x, (0, pad_w - new_w, 0, pad_h - new_h), value=0)
        pixels = (x[0].to(torch.float32) - self._mean) / self._std
        p = self.patch_size
        gh, gw = pad_h // p, pad_w // p
        patches = pixels.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        return patches, (gh, gw)

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        if not images:
            return {
                "pixel_values": torch.zeros(0, 3, self.patch_size, self.patch_size),
                "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
            }
        done = [self._one(image) for image in images]
        grid = torch.tensor([[1, gh, gw] for _, (gh, gw) in done], dtype=torch.long)
        return {"pixel_values": torch.cat([p for p, _ in done]), "image_grid_thw": grid}

    def placeholder(self, width: int, height: int) -> str:
        _, (pad_h, pad_w) = self._grid(width, height)
        rows = (pad_h // self.patch_size) * (pad_w // self.patch_size) // self.merge_size**2
        return IMAGE_PREFIX + MEDIA_PAD * rows + MEDIA_END

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        grid = pixels.get("image_grid_thw")
        return 0 if grid is None else sum(int(g.prod()) // self.merge_size**2 for g in grid)

    def describe(self) -> str:
        return (
            f"{self.name} images (at most {self.max_patches:,} patches of {self.patch_size}px and "
            f"{self.max_side_patches} per side, never upscaled, padded to the "
            f"{self.merge_size}x{self.merge_size} merge grid)"
        )


def _positive_int(cfg: Mapping[str, Any], key: str, name: str | None = None) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"preprocessor_config.json {name or key}: got {value!r}; expected a positive integer"
        )
    return value


def _triple(cfg: Mapping[str, Any], key: str) -> tuple[float, float, float]:
    value = cfg[key]
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ValueError(f"preprocessor_config.json {key}: got {value!r}; expected 3 values (R, G, B)")
    return (float(values[0]), float(values[1]), float(values[2]))
