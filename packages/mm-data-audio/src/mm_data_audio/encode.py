"""Turn one conversation with audio (and images, videos) into token ids and labels, for any audio format.

Each ``<audio>`` becomes the text of the family's :meth:`~mm_data_audio.formats.AudioFormat.placeholder` for
the clip's length in samples, each ``<image>`` Qwen-VL's vision placeholder for the image's size, each
``<video>`` (Qwen3-Omni) the text of its :class:`~mm_data_audio.omni_videos.VideoPlan`; the
conversation is then rendered with the tokenizer's chat template, and only assistant turns carry labels (the
reply and its end-of-turn token); audio and image tokens never do (:mod:`mm_core.data.chat`, shared with the
text and image datasets). The placeholder follows from lengths and sizes alone, so token counts come from file
headers, without decoding, through the same :meth:`encode`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mm_core.data.chat import encode_chat
from mm_core.data.processor import chat_tokenizer, processor_config
from mm_core.errors import ConfigError

from .errors import EncodeError
from .formats import AudioFormat, format_for
from .images import QwenImages, has_images
from .omni_videos import VIDEO_PAD, OmniVideoOptions, OmniVideos
from .records import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

_PLACEHOLDERS = re.compile(
    "(" + "|".join(re.escape(p) for p in (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)) + ")"
)
#: the folder's video processor configuration, when it has one (else its preprocessor_config.json's keys)
VIDEO_CONFIG = "video_preprocessor_config.json"
#: the only audio format whose model also takes videos
VIDEO_FORMAT = "qwen3-omni"


def placeholders(messages: Sequence[dict[str, str]]) -> list[str]:
    """The ``<audio>`` / ``<image>`` / ``<video>`` placeholders of a conversation, in text order."""
    return [p for m in messages for p in _PLACEHOLDERS.findall(m["content"])]


def _video_config(path: str, config: dict[str, Any]) -> dict[str, Any]:
    file = Path(path) / VIDEO_CONFIG
    if not file.is_file():
        return config
    values = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(values, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return values


@dataclass
class AudioProcessor:
    """The model's tokenizer, mm's audio format for its family and, when the folder has one, its Qwen-VL image
    processor (and, for Qwen3-Omni, its videos): everything read from one local processor folder."""

    tokenizer: Any
    format: AudioFormat
    images: QwenImages | None
    audio_token_id: int
    image_token_id: int | None
    videos: OmniVideos | None = None
    video_token_id: int | None = None

    @classmethod
    def load(
        cls,
        path: str,
        key: str,
        *,
        sampling_rate: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video: OmniVideoOptions | None = None,
    ) -> AudioProcessor:
        """Load from a local folder only (never the network); a failure is a ConfigError naming ``key``
        (``...preprocess_parameters``). ``sampling_rate`` replaces the folder's own. Videos are read for
        Qwen3-Omni (its audio format with an image processor), with ``video``'s settings."""
        where = f"{key}.model_name_or_path"
        config_file, config = processor_config(path, where)
        if sampling_rate is not None:
            config["sampling_rate"] = sampling_rate
        try:
            fmt = format_for(config)(config)
            images = QwenImages(config, min_pixels, max_pixels) if has_images(config) else None
            videos = None
            if images is not None and fmt.name == VIDEO_FORMAT:
                videos = OmniVideos(_video_config(path, config), video or OmniVideoOptions())
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
        tokens = list(dict.fromkeys((*fmt.special_tokens, *(images.special_tokens if images else ()))))
        tokens += [VIDEO_PAD] if videos else []
        tokenizer, ids = chat_tokenizer(path, where, tokens, f"{fmt.name} special tokens")
        image_id = ids[images.image_token] if images else None
        video_id = ids[VIDEO_PAD] if videos else None
        return cls(tokenizer, fmt, images, ids[fmt.audio_token], image_id, videos, video_id)

    def expand(
        self,
        messages: Sequence[dict[str, str]],
        audio_samples: Sequence[int],
        image_sizes: Sequence[tuple[int, int]],
        video_texts: Sequence[str] = (),
    ) -> list[dict[str, str]]:
        """The turns with every ``<audio>`` / ``<image>`` / ``<video>`` replaced by the family's placeholder
        text, for clips of ``audio_samples`` samples, images of ``image_sizes`` (width, height) and videos of
        ``video_texts`` (their planned text), in placeholder order."""
        audios, images, videos = iter(audio_samples), iter(image_sizes), iter(video_texts)
        out = []
        for m in messages:
            parts = _PLACEHOLDERS.split(m["content"])
            for i in range(1, len(parts), 2):
                if parts[i] == AUDIO_PLACEHOLDER:
                    parts[i] = self.format.placeholder(next(audios))
                elif parts[i] == VIDEO_PLACEHOLDER:
                    parts[i] = next(videos)
                elif self.images is None:
                    raise EncodeError(
                        f"the conversation has an {IMAGE_PLACEHOLDER} but the processor has no image "
                        "processor (its preprocessor_config.json has no image_processor_type)"
                    )
                else:
                    parts[i] = self.images.placeholder(*next(images))
            out.append({"role": m["role"], "content": "".join(parts)})
        return out

    def encode(
        self,
        messages: Sequence[dict[str, str]],
        audio_samples: Sequence[int],
        image_sizes: Sequence[tuple[int, int]] = (),
        video_texts: Sequence[str] = (),
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels (-100 outside assistant turns and at audio/image/video tokens)."""
        found = placeholders(messages)
        for placeholder, given, what in (
            (AUDIO_PLACEHOLDER, len(audio_samples), "audios"),
            (IMAGE_PLACEHOLDER, len(image_sizes), "images"),
            (VIDEO_PLACEHOLDER, len(video_texts), "videos"),
        ):
            if found.count(placeholder) != given:
                raise EncodeError(
                    f"the conversation has {found.count(placeholder)} {placeholder} but {given} {what}"
                )
        if video_texts and self.videos is None:
            raise EncodeError(
                f"the conversation has a {VIDEO_PLACEHOLDER} but the processor reads no videos (only "
                "Qwen3-Omni's, whose folder also has an image processor)"
            )
        expanded = self.expand(messages, audio_samples, image_sizes, video_texts)
        media = {t for t in (self.audio_token_id, self.image_token_id, self.video_token_id) if t is not None}
        ids, labels, _ = encode_chat(self.tokenizer, expanded, unlabelled=media)
        audio = self.format.audio_token
        audio_tokens = sum(self.format.placeholder(n).count(audio) for n in audio_samples)
        audio_tokens += sum(text.count(audio) for text in video_texts)
        if self.audio_token_count(ids) != audio_tokens:
            raise EncodeError("the tokenizer did not keep every audio token whole")
        return ids, labels

    def audio_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.audio_token_id for t in ids)

    def image_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.image_token_id for t in ids) if self.image_token_id is not None else 0

    def video_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.video_token_id for t in ids) if self.video_token_id is not None else 0
