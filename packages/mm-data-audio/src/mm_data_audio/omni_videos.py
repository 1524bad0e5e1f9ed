"""Qwen3-Omni videos: frames sampled, pixel inputs and placeholder text, with or without the video's sound.

Qwen3-Omni's processor (``Qwen3OmniMoeProcessor``) takes videos through ``Qwen2VLVideoProcessor``, whose rules
are followed here (transformers' own video path needs torchvision, which mm does not install):

- frames: ``video_fps`` frames a second of the clip (default 2, qwen-omni-utils' rate), at least
  ``min_frames`` and at most ``video_max_frames`` (the folder's, else 4 and 768), a multiple of
  ``temporal_patch_size``, taken at ``arange(0, total, total / n)`` (``Qwen2VLVideoProcessor.sample_frames``);
- size: every sampled frame resized to ``smart_resize`` of the frame (a multiple of patch × merge on each
  side, ``video_min_pixels`` .. ``video_max_pixels`` pixels *a frame*; default the processor's own bounds,
  ``Qwen3OmniMoeProcessor.videos_kwargs["size"]``, which it passes on every call); PIL bicubic, then the
  processor's rescale and normalisation (mean / std of the folder's ``video_preprocessor_config.json``, else
  of its ``preprocessor_config.json``);
- pixels: ``pixel_values_videos`` [patches, C·T·P²] and ``video_grid_thw`` [videos, 3] (the Qwen-VL patch
  layout, :meth:`mm_data_vlm.qwen_vl_videos.QwenVLVideos.pixels`), and ``video_second_per_grid``
  (``temporal_patch_size / video_fps``: the seconds one temporal group spans, which the model's 3-D positions
  read).

Text: a video is ``<|vision_start|>`` + N × ``<|video_pad|>`` + ``<|vision_end|>`` (N its merged patches).
With its sound (``use_audio_in_video``) it is ``<|vision_start|><|audio_start|>`` + the video and audio
tokens interleaved in time + ``<|audio_end|><|vision_end|>``: every token has a time in position ids — a video
token ``t · second_per_grid · position_id_per_seconds`` for its temporal group ``t``, the ``k``-th audio token
``k`` — and they are merged in time order, a video token first on a tie
(``Qwen3OmniMoeProcessor.replace_video_with_audio_token``; the model's ``get_rope_index`` merges its 3-D
positions by the same rule, so ``position_id_per_seconds`` must be the model's own). Everything follows from
the container header (frame count, rate, size; the audio track's length), so preparation counts tokens
without decoding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mm_core.data.chat import EncodeError
from mm_data_vlm.qwen_vl_images import VISION_END, VISION_START
from mm_data_vlm.qwen_vl_videos import VIDEO_PAD, QwenVLVideos, VideoPlan
from mm_data_vlm.videos import VideoHeader

from .formats.qwen_audio import AUDIO_END, AUDIO_PAD, AUDIO_START

#: frames a second sampled by default (qwen-omni-utils' ``FPS``)
DEFAULT_FPS = 2.0
#: ``Qwen2VLVideoProcessor.min_frames`` / ``max_frames``
DEFAULT_MIN_FRAMES, DEFAULT_MAX_FRAMES = 4, 768
#: the values read from the folder's configuration (the rest are the processor's)
_KEYS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
)


@dataclass(frozen=True)
class OmniVideoOptions:
    """The YAML's video settings (None: the folder's or the processor's own)."""

    fps: float | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    use_audio: bool = False
    position_id_per_seconds: float | None = None

    @classmethod
    def from_params(cls, pre: Mapping[str, Any]) -> OmniVideoOptions:
        """From the preprocess parameters (``video_fps``, ``video_max_frames``, ``video_min_pixels``,
        ``video_max_pixels``, ``use_audio_in_video``, ``position_id_per_seconds``; absent: None)."""
        return cls(
            fps=pre.get("video_fps"),
            max_frames=pre.get("video_max_frames"),
            min_pixels=pre.get("video_min_pixels"),
            max_pixels=pre.get("video_max_pixels"),
            use_audio=bool(pre.get("use_audio_in_video")),
            position_id_per_seconds=pre.get("position_id_per_seconds"),
        )


def processor_defaults() -> tuple[int, int, float]:
    """``Qwen3OmniMoeProcessor``'s per-frame pixel bounds (its ``videos_kwargs["size"]``) and its
    ``position_id_per_seconds``, read from transformers' class."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    size = Qwen3OmniMoeProcessor.videos_kwargs["size"]
    return (
        int(size["shortest_edge"]),
        int(size["longest_edge"]),
        float(Qwen3OmniMoeProcessor.position_id_per_seconds),
    )


def interleave(
    grid: tuple[int, int, int], merge: int, second_per_grid: float, position_id_per_seconds: float, audio: int
) -> str:
    """The video tokens of a video of ``grid`` and the ``audio`` tokens of its sound, in time order (see the
    module docstring)."""
    t, h, w = grid
    per_group = (h // merge) * (w // merge)
    parts, emitted = [], 0
    for k in range(t):
        # audio tokens strictly before this group's time go first (a video token wins a tie); the processor
        # computes the time as float(k) * second_per_grid * position_id_per_seconds, in that order
        before = min(audio, max(0, math.ceil(float(k) * second_per_grid * position_id_per_seconds)))
        parts.append(AUDIO_PAD * (before - emitted) + VIDEO_PAD * per_group)
        emitted = max(emitted, before)
    parts.append(AUDIO_PAD * (audio - emitted))
    return "".join(parts)


class OmniVideos(QwenVLVideos):
    """Qwen3-Omni video inputs (see the module docstring) from the folder's video configuration ``config``
    (``video_preprocessor_config.json``, else ``preprocessor_config.json``) and the YAML's ``options``. A
    ``ValueError`` names an unusable value. :meth:`pixels` and :meth:`feature_rows` are Qwen3-VL's (the same
    patch layout); the frames, sizes and text are Qwen2-VL's video rules with Qwen3-Omni's layout."""

    def __init__(self, config: Mapping[str, Any], options: OmniVideoOptions) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        # Qwen2VLVideoProcessor's defaults are its image processor's (patch 14, merge 2, 2 frames, CLIP mean)
        values = {k: config[k] for k in _KEYS if config.get(k) is not None}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            values.setdefault(key, getattr(Qwen2VLImageProcessorPil, key))
        # holds the values and the patch layout; no QwenVLVideos.__init__: its frame and size rules are
        # Qwen3-VL's, replaced here by Qwen2-VL's
        self.processor: Any = Qwen3VLVideoProcessor(**values)
        min_pixels, max_pixels, pps = processor_defaults()
        self.fps = float(options.fps if options.fps is not None else config.get("fps") or DEFAULT_FPS)
        self.min_frames = int(config.get("min_frames") or DEFAULT_MIN_FRAMES)
        self.max_frames = int(options.max_frames or config.get("max_frames") or DEFAULT_MAX_FRAMES)
        self.min_pixels = int(options.min_pixels or min_pixels)
        self.max_pixels = int(options.max_pixels or max_pixels)
        self.use_audio = options.use_audio
        self.position_id_per_seconds = float(options.position_id_per_seconds or pps)
        self.merge_size = int(self.processor.merge_size)
        self.temporal = int(self.processor.temporal_patch_size)
        self.factor = int(self.processor.patch_size) * self.merge_size
        if self.fps <= 0 or self.position_id_per_seconds <= 0:
            raise ValueError(f"video fps {self.fps} and position_id_per_seconds must be positive")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"video min pixels {self.min_pixels} over max pixels {self.max_pixels}")
        #: seconds one temporal group spans (``Qwen3OmniMoeProcessor``'s ``video_second_per_grid``)
        self.second_per_grid = self.temporal / self.fps

    def describe(self) -> str:
        sound = (
            f", with their sound (position_id_per_seconds {self.position_id_per_seconds:g})"
            if self.use_audio
            else ""
        )
        return (
            f"qwen3-omni videos ({self.fps:g} frames a second, at most {self.max_frames}, "
            f"{self.min_pixels:,} to {self.max_pixels:,} pixels a frame{sound})"
        )

    def _indices(self, header: VideoHeader) -> list[int]:
        """The sampled frames (``Qwen2VLVideoProcessor.sample_frames`` with ``fps``)."""
        total, t = header.frames, self.temporal
        cap = min(self.max_frames, total) // t * t
        wanted = min(max(total / header.fps * self.fps, self.min_frames), cap, total)
        n = math.floor(wanted / t) * t
        if n <= 0:
            raise EncodeError(f"the video has {total} frame(s); Qwen3-Omni takes videos of at least {t}")
        return [int(i) for i in torch.arange(0, total, total / n).int()]

    def plan(self, header: VideoHeader, audio_tokens: int | None = None) -> VideoPlan:
        """The frames, size, grid and text of a video with this header; with ``audio_tokens`` (its sound's
        tokens) the text interleaves them (nothing decoded)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        indices = self._indices(header)
        try:
            height, width = smart_resize(
                header.height, header.width, self.factor, self.min_pixels, self.max_pixels
            )
        except ValueError as e:  # an aspect ratio over 200
            raise EncodeError(f"the video processor refused the video: {e}") from None
        patch = int(self.processor.patch_size)
        grid = (math.ceil(len(indices) / self.temporal), height // patch, width // patch)
        if audio_tokens is None:
            body = VIDEO_PAD * (grid[0] * grid[1] * grid[2] // self.merge_size**2)
        else:
            pps = self.position_id_per_seconds
            tokens = interleave(grid, self.merge_size, self.second_per_grid, pps, audio_tokens)
            body = AUDIO_START + tokens + AUDIO_END
        return VideoPlan(tuple(indices), int(height), int(width), grid, VISION_START + body + VISION_END)
