"""Qwen3-VL videos (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5): frames sampled, pixel inputs and placeholder text.

The rules are transformers' ``Qwen3VLVideoProcessor``'s, built from the processor folder's
``video_preprocessor_config.json``: which frames are sampled (``sample_frames``: ``fps`` frames a second,
between ``min_frames`` and ``max_frames``), the size they are resized to (``smart_resize`` of the clip, with
``size.shortest_edge`` / ``size.longest_edge`` the fewest / most pixels of the *whole clip*, all sampled
frames together), and the patch layout (``patchify``: ``pixel_values_videos`` [patches, C·T·P²] and
``video_grid_thw`` [videos, 3], frames grouped by ``temporal_patch_size``). Resizing is PIL's bicubic, as
for images (transformers' own video path needs torchvision, which mm does not install), followed by the
processor's rescale and normalisation.

A video becomes, for each group of ``temporal_patch_size`` frames, ``<{t:.1f} seconds>`` +
``<|vision_start|>`` + N × ``<|video_pad|>`` + ``<|vision_end|>`` (``t`` the group's mean frame time, N its
merged patches): ``Qwen3VLProcessor.replace_video_token``'s layout. It follows from the header (frame count,
frame rate, size) alone, so preparation counts tokens without decoding a frame (:meth:`QwenVLVideos.plan`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mm_core.data.chat import EncodeError

from .qwen_vl_images import VISION_END, VISION_START
from .videos import VideoHeader

VIDEO_PAD = "<|video_pad|>"
#: the fields a sample with videos carries (concatenated along dim 0 by a collator)
VIDEO_FIELDS = ("pixel_values_videos", "video_grid_thw")
#: ``video_processor_type`` values this module serves
VIDEO_PROCESSOR_TYPES = ("Qwen3VLVideoProcessor",)


@dataclass(frozen=True)
class VideoPlan:
    """How one video reaches the vision tower: the frames sampled, their resized size and the text."""

    indices: tuple[int, ...]
    height: int
    width: int
    grid: tuple[int, int, int]
    text: str


class QwenVLVideos:
    """Qwen3-VL video inputs from a ``video_preprocessor_config.json``'s values; ``fps``, ``max_frames``,
    ``min_pixels`` and ``max_pixels`` (pixels of the whole clip) replace the folder's own when given. The
    processor's ``ValueError`` / ``TypeError`` for an unusable configuration propagates."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        fps: float | None = None,
        max_frames: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        kind = str(config.get("video_processor_type") or "")
        if kind not in VIDEO_PROCESSOR_TYPES:
            raise ValueError(
                f"video_processor_type {kind or '(missing)'!r} is not one mm-data-vlm reads videos for "
                f"({', '.join(VIDEO_PROCESSOR_TYPES)})"
            )
        values = dict(config)
        values.setdefault("cap_pixels_per_frame", False)  # the processor's current default, said explicitly
        if fps is not None:
            values["fps"] = fps
        if max_frames is not None:
            values["max_frames"] = max_frames
        size = dict(values.get("size") or {})
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        if size:
            values["size"] = size
        self.processor: Any = Qwen3VLVideoProcessor.from_dict(values)
        p = self.processor
        if not p.size.shortest_edge or not p.size.longest_edge:
            raise ValueError(f"size must give shortest_edge and longest_edge (pixels of a clip): {p.size}")
        if p.min_frames > p.max_frames:
            raise ValueError(f"min_frames {p.min_frames} is over max_frames {p.max_frames}")
        self.merge_size = int(p.merge_size)
        self.temporal = int(p.temporal_patch_size)
        self.factor = int(p.patch_size) * self.merge_size

    def describe(self) -> str:
        p = self.processor
        return (
            f"qwen3-vl videos ({p.fps} frames a second, {p.min_frames} to {p.max_frames} frames, "
            f"{p.size.shortest_edge:,} to {p.size.longest_edge:,} pixels a clip)"
        )

    def _resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The size every sampled frame is resized to (``Qwen3VLVideoProcessor.resize``'s rule)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        p = self.processor
        max_pixels = p.size.longest_edge
        if p.cap_pixels_per_frame:
            frame_cap = p.max_video_tokens * self.factor * self.factor
            per_frame = max(min(frame_cap, max_pixels // frames), int(p.size.shortest_edge * 1.05))
            max_pixels = per_frame * frames
        h, w = smart_resize(
            num_frames=max(frames, self.temporal),
            height=height,
            width=width,
            temporal_factor=self.temporal,
            factor=self.factor,
            min_pixels=p.size.shortest_edge,
            max_pixels=max_pixels,
        )
        return int(h), int(w)

    def plan(self, header: VideoHeader) -> VideoPlan:
        """The frames, size, grid and placeholder text of a video with this header (nothing decoded)."""
        from transformers.video_utils import VideoMetadata

        meta = VideoMetadata(
            total_num_frames=header.frames, fps=header.fps, width=header.width, height=header.height
        )
        try:
            indices = [int(i) for i in self.processor.sample_frames(meta, fps=self.processor.fps)]
            height, width = self._resized(len(indices), header.height, header.width)
        except ValueError as e:  # e.g. an aspect ratio over 200
            raise EncodeError(f"the video processor refused the video: {e}") from None
        t = math.ceil(len(indices) / self.temporal)
        grid = (t, height // int(self.processor.patch_size), width // int(self.processor.patch_size))
        per_frame = grid[1] * grid[2] // self.merge_size**2
        # Qwen3VLProcessor._calculate_timestamps: the last frame repeated up to a whole temporal group, each
        # group's time the mean of its first and last frame's
        padded = indices + [indices[-1]] * (t * self.temporal - len(indices))
        times = [padded[i] / header.fps for i in range(len(padded))]
        text = "".join(
            f"<{(times[k] + times[k + self.temporal - 1]) / 2:.1f} seconds>"
            + VISION_START
            + VIDEO_PAD * per_frame
            + VISION_END
            for k in range(0, len(times), self.temporal)
        )
        return VideoPlan(tuple(indices), height, width, grid, text)

    def pixels(self, clips: Sequence[tuple[np.ndarray, VideoPlan]]) -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` and ``video_grid_thw`` of one sample's videos (decoded frames uint8
        ``[T, H, W, 3]`` with their plans), in placeholder order."""
        from PIL import Image

        p = self.processor
        mean = torch.tensor(p.image_mean, dtype=torch.float32).view(1, 1, 3, 1, 1)
        std = torch.tensor(p.image_std, dtype=torch.float32).view(1, 1, 3, 1, 1)
        parts, grids = [], []
        for frames, plan in clips:
            resized = [
                np.asarray(Image.fromarray(f).resize((plan.width, plan.height), Image.Resampling.BICUBIC))
                for f in frames
            ]
            video = torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2)[None].float()  # [1, T, C, H, W]
            if p.do_rescale:
                video = video * float(p.rescale_factor)
            if p.do_normalize:
                video = (video - mean) / std
            patches, gt, gh, gw = p.patchify(
                video,
                patch_size=int(p.patch_size),
                merge_size=self.merge_size,
                temporal_patch_size=self.temporal,
            )
            if (gt, gh, gw) != plan.grid:  # a defect of the plan, never data
                raise EncodeError(f"the frames make a {gt}x{gh}x{gw} grid but {plan.grid} was planned")
            parts.append(patches[0])
            grids.append([gt, gh, gw])
        grid = torch.tensor(grids, dtype=torch.long)
        return {"pixel_values_videos": torch.cat(parts), "video_grid_thw": grid}

    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        """Video-token rows the vision tower produces for these pixel inputs."""
        grid = pixels.get("video_grid_thw")
        return 0 if grid is None else sum(int(g.prod()) // self.merge_size**2 for g in grid)
