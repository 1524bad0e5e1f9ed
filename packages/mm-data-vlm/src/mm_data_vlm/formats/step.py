"""Step 3.7 images (``Step3p7ImageProcessor``): a fixed-size global view plus zero or more local crops.

What transformers' ``Step3p7ImageProcessor`` and ``Step3p7Processor.replace_image_token`` do, reproduced
without torchvision:

- An image of ``width × height`` is planned from its size alone: an extreme one (shorter side < 32 px and
  aspect ratio > 4) is zero-padded to a square (bottom and right); one whose longer side exceeds
  ``max_image_size`` is scaled down to it. Then a window (the crop side) is chosen: none when the image
  fits the global view and is not elongated (ratio ≤ 1.5), else the shorter side (fits, elongated), at most
  ``patch_size`` (ratio > 4), or ``patch_size``. Each side is snapped to a multiple of the window (up when
  the remainder exceeds 20 % of it); a side shorter than the window stays as it is (one partial crop).
- Global view: the (padded) image resized to the planned size, then to ``size × size``. Crops: the image
  resized to the snapped size and cut row by row into windows, each resized to ``patch_size ×
  patch_size``. Every resize is torchvision's: bilinear with antialiasing on ``uint8`` pixels, run here by
  the same ATen kernel (``torch.nn.functional.interpolate``, native ``uint8`` where torchvision uses it).
  Then ``(x / 255 - mean) / std``.
- Text: per crop ``<patch_start>`` + ``(patch_size / 56)²`` ``<im_patch>`` + ``<patch_end>``, and
  ``<patch_newline>`` after the last crop of every row but the last; then ``<im_start>`` + ``(size / 56)²``
  ``<im_patch>`` + ``<im_end>`` (56 = ViT patch 14 × the two stride-2 downsamplers).

Tensors (every one concatenates along dim 0 across samples): ``pixel_values [images, 3, S, S]``,
``pixel_values_local [crops, 3, P, P]`` (zero rows when no image of the sample has crops) and
``num_local_patches [images]`` (the forward's per-image crop counts, which split ``pixel_values_local``).
The processor's ``patch_newline_masks`` only shapes the text and is not a forward input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import EncodeError
from . import ImageFormat

PATCH_START, PATCH_END, PATCH_NEWLINE = "<patch_start>", "<patch_end>", "<patch_newline>"
IM_START, IM_END, IM_PATCH = "<im_start>", "<im_end>", "<im_patch>"

#: ``Step3p7ImageProcessor`` defaults (its class attributes), used where the config leaves a key out
DEFAULTS: dict[str, Any] = {
    "size": {"height": 728, "width": 728},
    "patch_size": 504,
    "max_image_size": 3024,
    "vision_patch_size": 14,
    "downsampler_stride": 4,
    "resample": 2,  # PIL.Image.BILINEAR
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN
    "image_std": [0.26862954, 0.26130258, 0.27577711],  # OPENAI_CLIP_STD
}
BILINEAR = 2


@dataclass(frozen=True)
class CropPlan:
    """The layout of one image: global-view size before squaring, crop-image size, window and crop grid."""

    global_size: tuple[int, int]  # (width, height)
    crop_size: tuple[int, int]  # (width, height)
    window: int  # crop side before the final resize; 0: no crops
    columns: int
    rows: int
    square_pad: bool

    @property
    def crops(self) -> int:
        return self.columns * self.rows if self.window else 0


def plan_crops(width: int, height: int, image_size: int, patch_size: int, max_image_size: int) -> CropPlan:
    """``Step3p7ImageProcessor``'s layout for an image of ``width × height`` pixels."""
    square_pad = min(width, height) < 32 and max(width / height, height / width) > 4
    if square_pad:
        width = height = max(width, height)
    if max(width, height) > max_image_size:
        scale = max_image_size / max(width, height)
        width, height = int(width * scale), int(height * scale)
    short, long = min(width, height), max(width, height)
    if long <= image_size:
        window = short if long / short > 1.5 else 0
    elif long / short > 4:
        window = min(short, patch_size)
    else:
        window = patch_size
    if window == 0:
        return CropPlan((width, height), (width, height), 0, 0, 0, square_pad)

    def snap(side: int) -> int:
        if side < window:
            return side
        return window * (side // window + (side % window > 0.2 * window))

    crop_w, crop_h = snap(width), snap(height)
    columns, rows = max(1, crop_w // window), max(1, crop_h // window)
    return CropPlan((width, height), (crop_w, crop_h), window, columns, rows, square_pad)


def _native_uint8() -> bool:
    """Whether torchvision resizes ``uint8`` images natively here (bilinear on CPUs with AVX2/AVX-512 or
    ARM); elsewhere it resizes in float32 and rounds back to ``uint8``."""
    import platform

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
        "aarch64",
        "arm64",
    )


def resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``uint8 [n, 3, h, w]`` resized to ``height × width`` as torchvision's ``resize`` does it (bilinear,
    antialiased, ``uint8`` out; the same size is returned unchanged)."""
    if tuple(images.shape[-2:]) == (height, width):
        return images
    if _native_uint8():
        return F.interpolate(
            images, size=(height, width), mode="bilinear", align_corners=False, antialias=True
        )
    out = F.interpolate(
        images.float(), size=(height, width), mode="bilinear", align_corners=False, antialias=True
    )
    return out.round_().to(torch.uint8)


class Step3p7Format(ImageFormat):
    name: ClassVar[str] = "step3p7"
    processor_types: ClassVar[tuple[str, ...]] = ("Step3p7ImageProcessor",)
    image_token: ClassVar[str] = IM_PATCH
    special_tokens: ClassVar[tuple[str, ...]] = (
        PATCH_START,
        PATCH_END,
        PATCH_NEWLINE,
        IM_START,
        IM_END,
        IM_PATCH,
    )

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        super().__init__(config, min_pixels, max_pixels)
        if min_pixels is not None or max_pixels is not None:
            raise ValueError(
                f"image_min_pixels/image_max_pixels: got {min_pixels}/{max_pixels}; Step 3.7 images have a "
                "fixed global view and crop size and no pixel budget; leave both unset (the largest side an "
                "image keeps is max_image_size in preprocessor_config.json)"
            )
        cfg = {**DEFAULTS, **{k: v for k, v in self.config.items() if v is not None}}
        size = cfg["size"]
        if int(size.get("height", 0)) != int(size.get("width", -1)):
            raise ValueError(f"size: got {size}; Step 3.7's global view is square (height == width)")
        self.image_size = int(size["height"])
        self.patch_size = int(cfg["patch_size"])
        self.max_image_size = int(cfg["max_image_size"])
        self.vision_patch_size = int(cfg["vision_patch_size"])
        if int(cfg["downsampler_stride"]) != 4:
            raise ValueError(
                f"downsampler_stride: got {cfg['downsampler_stride']}; the Step 3.7 vision tower has two "
                "stride-2 downsamplers (4)"
            )
        if int(cfg["resample"]) != BILINEAR:
            raise ValueError(f"resample: got {cfg['resample']}; Step 3.7 images are resized bilinearly (2)")
        stride = self.vision_patch_size * 4
        for key, side in (("size", self.image_size), ("patch_size", self.patch_size)):
            if side <= 0 or side % stride:
                raise ValueError(
                    f"{key}: got {side}; it must be a positive multiple of vision_patch_size × 4 = {stride} "
                    "(the processor counts side // stride image tokens per row)"
                )
        self.image_tokens = (self.image_size // stride) ** 2
        self.crop_tokens = (self.patch_size // stride) ** 2
        self.do_rescale, self.do_normalize = bool(cfg["do_rescale"]), bool(cfg["do_normalize"])
        self.rescale_factor = float(cfg["rescale_factor"])
        mean, std = (
            torch.tensor(cfg["image_mean"]),
            torch.tensor(cfg["image_std"]),
        )  # float32, as the processor
        if self.do_rescale and self.do_normalize:  # its fused rescale-and-normalize
            mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
        self._mean, self._std = mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)

    @property
    def target_pixels(self) -> int | None:
        return self.max_image_size**2

    def plan(self, width: int, height: int) -> CropPlan:
        """The crop layout of an image of this size."""
        if width <= 0 or height <= 0:
            raise EncodeError(f"the image is {width}x{height} pixels")
        return plan_crops(width, height, self.image_size, self.patch_size, self.max_image_size)

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8`` pixels to the forward's float32 values, as the processor's ``rescale_and_normalize``."""
        if self.do_normalize:
            return (images.to(torch.float32) - self._mean) / self._std
        if self.do_rescale:
            return images * self.rescale_factor
        return images.to(torch.float32)

    def _views(self, image: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The ``uint8`` global view ``[1, 3, S, S]`` and crops ``[1, 3, P, P]`` of one RGB image."""
        width, height = image.size
        layout = self.plan(width, height)
        pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy())
        pixels = pixels.permute(2, 0, 1).unsqueeze(0).contiguous()  # [1, 3, h, w]
        if layout.square_pad:  # the image at the top left of a black square
            side = max(width, height)
            pixels = F.pad(pixels, (0, side - width, 0, side - height))
        global_w, global_h = layout.global_size
        view = resize(resize(pixels, global_h, global_w), self.image_size, self.image_size)
        if not layout.window:
            return view, []
        crop_w, crop_h = layout.crop_size
        resized = resize(pixels, crop_h, crop_w)
        w = layout.window
        tiles = [resized[..., i : i + w, j : j + w] for i in range(0, crop_h, w) for j in range(0, crop_w, w)]
        return view, [resize(t, self.patch_size, self.patch_size) for t in tiles]

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        views, crops, counts = [], [], []
        for image in images:
            view, tiles = self._views(image)
            views.append(view)
            crops.extend(tiles)
            counts.append(len(tiles))
        p = self.patch_size
        local = torch.cat(crops) if crops else torch.zeros((0, 3, p, p), dtype=torch.uint8)
        return {
            "pixel_values": self._normalize(torch.cat(views)),
            "pixel_values_local": self._normalize(local),
            "num_local_patches": torch.tensor(counts, dtype=torch.long),
        }

    def placeholder(self, width: int, height: int) -> str:
        layout = self.plan(width, height)
        crop = PATCH_START + IM_PATCH * self.crop_tokens + PATCH_END
        text = []
        for row in range(layout.rows if layout.window else 0):
            text.append(crop * layout.columns)
            if row < layout.rows - 1:
                text.append(PATCH_NEWLINE)
        text.append(IM_START + IM_PATCH * self.image_tokens + IM_END)
        return "".join(text)

    def _rows(self, height: int, width: int) -> int:
        """Image rows the vision tower gives for one ``height × width`` input: ViT patches, then two
        3×3 stride-2 convolutions with padding 1."""

        def side(pixels: int) -> int:
            n = pixels // self.vision_patch_size
            for _ in range(2):
                n = (n - 1) // 2 + 1
            return n

        return side(height) * side(width)

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        rows = 0
        for key in ("pixel_values", "pixel_values_local"):
            value = pixels.get(key)
            if value is not None and value.shape[0]:
                rows += int(value.shape[0]) * self._rows(int(value.shape[-2]), int(value.shape[-1]))
        return rows

    def describe(self) -> str:
        return (
            f"{self.name} images (global view {self.image_size}², crops {self.patch_size}², longest side at "
            f"most {self.max_image_size})"
        )
