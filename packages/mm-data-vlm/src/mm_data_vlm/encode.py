"""Turn one conversation with images into model inputs, for any family mm-data-vlm knows.

Each ``<image>`` placeholder becomes the text of the family's image format
(:meth:`~mm_data_vlm.formats.ImageFormat.placeholder`: Qwen-VL's ``<|vision_start|>`` + N × ``<|image_pad|>``
+ ``<|vision_end|>``, Kimi K2.5's media tokens, Step 3.7's crops, ...), computed from the size at which the
image reaches the image processor. The conversation is then rendered with the tokenizer's chat template, and
only assistant turns carry labels (the reply and its end-of-turn token); image tokens never do
(:mod:`mm_core.data.chat`, shared with the text and audio datasets).

Each ``<video>`` placeholder (Qwen3-VL, Qwen3-VL-MoE and Qwen3.5, whose processor folder has a
``video_preprocessor_config.json``) becomes the per-frame text of
:class:`~mm_data_vlm.qwen_vl_videos.QwenVLVideos` (timestamps, ``<|vision_start|>`` + N ×
``<|video_pad|>`` + ``<|vision_end|>``), which follows from the container header alone.

Since the placeholder follows from the size alone, preparation counts every sample's tokens from the image
and video headers, without decoding a pixel, through the same :meth:`VisionProcessor.encode_sizes`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mm_core.data.chat import encode_chat
from mm_core.data.processor import chat_tokenizer, processor_config
from mm_core.errors import ConfigError

from .errors import EncodeError
from .formats import ImageFormat, format_for
from .qwen_vl_videos import VIDEO_PAD, QwenVLVideos, VideoPlan
from .records import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

__all__ = ["EncodeError", "VideoOptions", "VisionProcessor"]

VIDEO_CONFIG = "video_preprocessor_config.json"


@dataclass(frozen=True)
class VideoOptions:
    """The YAML's video settings (None: the processor folder's own)."""

    fps: float | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


def _load_videos(path: str, fmt: ImageFormat, options: VideoOptions, where: str) -> tuple[Any, str]:
    """The folder's video processor (or None) and, when None, why videos cannot be read."""
    config_file = Path(path) / VIDEO_CONFIG
    if not config_file.is_file():
        return None, f"the processor folder {path} has no {VIDEO_CONFIG}, so videos cannot be encoded"
    if fmt.name != "qwen-vl":
        return None, f"mm-data-vlm reads videos for Qwen3-VL / Qwen3.5 only, not for {fmt.name}"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("it must hold a JSON object")
        videos = QwenVLVideos(
            config,
            fps=options.fps,
            max_frames=options.max_frames,
            min_pixels=options.min_pixels,
            max_pixels=options.max_pixels,
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
    return videos, ""


@dataclass
class VisionProcessor:
    """The model's Hugging Face tokenizer and mm's image format for its family, from one local folder."""

    tokenizer: Any
    format: ImageFormat
    image_token_id: int
    #: the Qwen3-VL video processor when the folder has one (else None, and :attr:`no_videos` says why)
    videos: QwenVLVideos | None = None
    video_token_id: int | None = None
    no_videos: str = ""

    @property
    def target_pixels(self) -> int | None:
        """The most pixels an image is resized to, or None when the family's format has no such bound."""
        return self.format.target_pixels

    @classmethod
    def load(
        cls,
        path: str,
        min_pixels: int | None,
        max_pixels: int | None,
        key: str,
        video: VideoOptions | None = None,
    ) -> VisionProcessor:
        """Load from a local folder only (never the network); a failure is a ConfigError naming the key."""
        where = f"{key}.model_name_or_path"
        config_file, config = processor_config(path, where)
        try:
            fmt = format_for(config)(config, min_pixels, max_pixels)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
        videos, no_videos = _load_videos(path, fmt, video or VideoOptions(), where)
        tokens = (*fmt.special_tokens, VIDEO_PAD) if videos is not None else fmt.special_tokens
        what = f"{fmt.name} image and video tokens" if videos is not None else f"{fmt.name} image tokens"
        tokenizer, ids = chat_tokenizer(path, where, tokens, what)
        video_id = ids[VIDEO_PAD] if videos is not None else None
        return cls(tokenizer, fmt, ids[fmt.image_token], videos, video_id, no_videos)

    def video_plans(self, headers: Sequence[Any]) -> list[VideoPlan]:
        """The plan of each video (:meth:`QwenVLVideos.plan`); EncodeError when videos cannot be read."""
        if not headers:
            return []
        if self.videos is None:
            raise EncodeError(self.no_videos)
        return [self.videos.plan(h) for h in headers]

    def images(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The forward's pixel inputs for one sample's images (see :meth:`ImageFormat.pixels`)."""
        return self.format.pixels(images)

    def encode_sizes(
        self,
        messages: Sequence[dict[str, str]],
        sizes: Sequence[tuple[int, int]],
        videos: Sequence[VideoPlan] = (),
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels (-100 outside assistant turns and at image and video tokens) for a
        conversation whose images reach the image processor at ``sizes`` ((width, height), in placeholder
        order) and whose videos are ``videos`` (:meth:`video_plans`, in placeholder order)."""
        for mark, count, what in (
            (IMAGE_PLACEHOLDER, len(sizes), "images"),
            (VIDEO_PLACEHOLDER, len(videos), "videos"),
        ):
            found = sum(m["content"].count(mark) for m in messages)
            if found != count:
                raise EncodeError(f"the conversation has {found} {mark} placeholders but {count} {what}")
        texts = {
            IMAGE_PLACEHOLDER: iter([self.format.placeholder(w, h) for w, h in sizes]),
            VIDEO_PLACEHOLDER: iter([v.text for v in videos]),
        }
        pattern = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
        expanded = [
            {
                "role": m["role"],
                "content": pattern.sub(lambda found: next(texts[found.group(0)]), m["content"]),
            }
            for m in messages
        ]
        unlabelled = {self.image_token_id}
        if self.video_token_id is not None:
            unlabelled.add(self.video_token_id)
        ids, labels, _ = encode_chat(self.tokenizer, expanded, unlabelled=unlabelled)
        expected = sum(self.format.placeholder(w, h).count(self.format.image_token) for w, h in sizes)
        if sum(t == self.image_token_id for t in ids) != expected:
            raise EncodeError("the tokenizer did not keep every image token whole")
        if videos and self.video_token_count(ids) != sum(v.text.count(VIDEO_PAD) for v in videos):
            raise EncodeError("the tokenizer did not keep every video token whole")
        return ids, labels

    def image_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.image_token_id for t in ids)

    def video_token_count(self, ids: Sequence[int]) -> int:
        return 0 if self.video_token_id is None else sum(int(t) == self.video_token_id for t in ids)
