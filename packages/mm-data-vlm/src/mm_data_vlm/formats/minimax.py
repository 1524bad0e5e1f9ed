"""MiniMax-M3-VL images: what transformers' ``MiniMaxM3VLImageProcessor`` (torchvision backend) and
``MiniMaxM3VLProcessor.replace_image_token`` produce, computed with PIL, numpy and torch (no torchvision).

- Size: each side becomes a multiple of ``patch_size * merge_size`` (28), rounded to the nearest (ties to
  even, as Python's ``round``), then scaled down to at most ``size.longest_edge`` pixels (``max_pixels``,
  default 451,584 = 576 tokens of 28²) or up to at least ``size.shortest_edge`` (``min_pixels``, default
  3,136), keeping the aspect ratio; aspect ratios over 200 are refused.
- Resampling: bicubic (``resample`` 3), antialiased, on the 8-bit image. On the CPU torchvision runs
  torch's native uint8 kernel for it (``interpolate(..., mode="bicubic", antialias=True)`` on the
  ``[1, C, H, W]`` uint8 image); the same torch call is made here, so the resized pixels are the reference
  processor's. (PIL's own bicubic is the same filter with different fixed-point rounding: it differs by one
  level of 255 on a few percent of resized values; ``tests/test_minimax_format.py`` measures it.) An image
  already at its target size is not resampled.
- Colour: an image with transparency is composited onto white, then RGB (the processor's conversion).
- Values: ``(x - 255 * mean) / (255 * std)`` in float32 (the processor's fused rescale and normalise; CLIP
  mean and std by default).
- Layout: ``pixel_values`` ``[patches, C * T * P * P]`` with patches in merge-window order (each
  ``merge × merge`` window of patches consecutive, windows row by row) and each row the channel-major
  ``[C, T, P, P]`` block, the one frame repeated ``T`` (``temporal_patch_size``) times; ``image_grid_thw``
  ``[[1, H / P, W / P]]`` per image.
- Text: an image becomes ``]<]start of image[>[`` + N × ``]<]image[>[`` + ``]<]end of image[>[`` with N its
  merged patches (``grid.prod() // merge²``).

The forward does not read ``mm_token_type_ids`` (the language model's positions are 1-D; the processor only
inherits the name from Qwen2-VL's), so :attr:`MiniMaxM3VLFormat.token_type_ids` is False.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import EncodeError
from . import ImageFormat

VISION_START, VISION_END, IMAGE_TOKEN = "]<]start of image[>[", "]<]end of image[>[", "]<]image[>["

#: ``MiniMaxM3VLImageProcessor`` defaults (``size`` in pixels: shortest_edge = min, longest_edge = max)
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 4 * 28 * 28, 451584
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` as the processor resizes them: multiples of ``factor``, within
    ``[min_pixels, max_pixels]``, aspect ratio kept. ``ValueError`` for an aspect ratio over 200."""
    if min(height, width) <= 0:
        raise ValueError(f"image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def as_rgb(image: Any) -> Any:
    """A PIL image as RGB the way the processor converts it: transparency composited onto white."""
    if image.mode == "RGB":
        return image
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def resize_uint8(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A ``[C, H, W]`` uint8 image resized as torchvision resizes it on the CPU for bicubic: torch's native
    antialiased uint8 kernel, no float round trip."""
    out = torch.nn.functional.interpolate(
        image.unsqueeze(0), size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return out.squeeze(0)


def _pixel_limits(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(min_pixels, max_pixels)`` of a ``preprocessor_config.json`` as the processor reads them: ``size``
    ``shortest_edge``/``longest_edge`` (no ``size``, or the stale ``[672, 672]`` of old checkpoints: the
    defaults), replaced by top-level ``min_pixels``/``max_pixels``; None where neither gives one."""
    size = config.get("size")
    low: Any
    high: Any
    if size is None or (isinstance(size, Sequence) and list(size) == [672, 672]):
        low, high = DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS
    elif isinstance(size, Mapping):
        low, high = size.get("shortest_edge"), size.get("longest_edge")
    else:
        raise ValueError(
            f"preprocessor_config.json size: got {size!r}; expected shortest_edge and longest_edge"
        )
    if config.get("min_pixels") is not None:
        low = config["min_pixels"]
    if config.get("max_pixels") is not None:
        high = config["max_pixels"]
    return low, high


class MiniMaxM3VLFormat(ImageFormat):
    name: ClassVar[str] = "minimax-m3-vl"
    processor_types: ClassVar[tuple[str, ...]] = ("MiniMaxM3VLImageProcessor",)
    image_token: ClassVar[str] = IMAGE_TOKEN
    special_tokens: ClassVar[tuple[str, ...]] = (VISION_START, VISION_END, IMAGE_TOKEN)
    token_type_ids: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        super().__init__(config, min_pixels, max_pixels)
        from PIL import Image

        cfg = self.config
        low, high = _pixel_limits(cfg)
        low = min_pixels if min_pixels is not None else low
        high = max_pixels if max_pixels is not None else high
        for key, edge, value in (
            ("image_min_pixels", "shortest", low),
            ("image_max_pixels", "longest", high),
        ):
            if value is None:
                raise ValueError(
                    f"preprocessor_config.json size: {config.get('size')!r} has no {edge}_edge (and there "
                    f"is no {key.removeprefix('image_')}); the processor needs both pixel bounds"
                )
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key}: got {value!r}; expected a positive number of pixels")
        if low > high:
            raise ValueError(f"image_min_pixels: got {low:,}, more than image_max_pixels {high:,}")
        self.min_pixels, self.max_pixels = low, high
        self.patch_size = int(cfg.get("patch_size") or 14)
        self.temporal_patch_size = int(cfg.get("temporal_patch_size") or 2)
        self.merge_size = int(cfg.get("merge_size") or 2)
        self.factor = self.patch_size * self.merge_size
        self.do_resize = bool(cfg.get("do_resize", True))
        resample = cfg.get("resample", Image.Resampling.BICUBIC)
        if self.do_resize and resample != Image.Resampling.BICUBIC:
            raise ValueError(
                f"preprocessor_config.json resample: got {resample!r}; the MiniMax-M3-VL format reproduces "
                f"the processor's bicubic resize ({int(Image.Resampling.BICUBIC)}) only"
            )
        do_rescale, do_normalize = bool(cfg.get("do_rescale", True)), bool(cfg.get("do_normalize", True))
        rescale = float(cfg.get("rescale_factor", 1 / 255))
        # the processor's arithmetic, in float32: fused (x - mean / rescale) / (std / rescale) when it both
        # rescales and normalises, x * rescale when it only rescales
        self.scale: np.float32 | None = None
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        if do_normalize:
            inverse = np.float32(1.0 / rescale) if do_rescale else np.float32(1.0)
            self.mean = np.asarray(cfg.get("image_mean") or CLIP_MEAN, dtype=np.float32) * inverse
            self.std = np.asarray(cfg.get("image_std") or CLIP_STD, dtype=np.float32) * inverse
        elif do_rescale:
            self.scale = np.float32(rescale)

    @property
    def target_pixels(self) -> int | None:
        return self.max_pixels

    def _size(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` an image of this size is processed at."""
        if not self.do_resize:
            return height, width
        try:
            return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        except ValueError as e:
            raise EncodeError(f"the MiniMax-M3-VL image processor refuses the image: {e}") from None

    def _one(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        image = as_rgb(image)
        width, height = image.size
        h, w = self._size(width, height)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if h % (p * m) or w % (p * m):
            raise EncodeError(
                f"image of {width}x{height} pixels is not a multiple of {p * m} (do_resize false)"
            )
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy())  # [C, H, W]
        if (w, h) != (width, height):
            pixels = resize_uint8(pixels, h, w)
        x = pixels.numpy().astype(np.float32)
        if self.mean is not None and self.std is not None:
            x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        elif self.scale is not None:
            x = x * self.scale
        c, gh, gw = x.shape[0], h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        # [gh/m, gw/m, m, m, C, P, P] -> the frame repeated T times after the channel axis
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p), (1, gh, gw)

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        rows, grids = zip(*(self._one(im) for im in images)) if images else ((), ())
        channels = 3 * self.temporal_patch_size * self.patch_size**2
        values = np.concatenate(rows) if rows else np.zeros((0, channels), dtype=np.float32)
        return {
            "pixel_values": torch.from_numpy(values),
            "image_grid_thw": torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3),
        }

    def placeholder(self, width: int, height: int) -> str:
        h, w = self._size(width, height)
        tokens = (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2
        return VISION_START + IMAGE_TOKEN * tokens + VISION_END

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        grid = pixels.get("image_grid_thw")
        return 0 if grid is None else sum(int(g.prod()) // self.merge_size**2 for g in grid)

    def describe(self) -> str:
        return (
            f"{self.name} images ({self.min_pixels:,} to {self.max_pixels:,} pixels, sides multiples of "
            f"{self.factor}; bicubic)"
        )
