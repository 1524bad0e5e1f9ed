"""Turn one conversation with audio (and images) into token ids and labels, for any audio format.

Each ``<audio>`` becomes the text of the family's :meth:`~mm_data_audio.formats.AudioFormat.placeholder` for
the clip's length in samples, each ``<image>`` Qwen-VL's vision placeholder for the image's size; the
conversation is then rendered with the tokenizer's chat template, and only assistant turns carry labels (the
reply and its end-of-turn token); audio and image tokens never do (:mod:`mm_core.data.chat`, shared with the
text and image datasets). The placeholder follows from lengths and sizes alone, so token counts come from file
headers, without decoding, through the same :meth:`encode`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mm_core.data.chat import encode_chat
from mm_core.data.processor import chat_tokenizer, processor_config
from mm_core.errors import ConfigError

from .errors import EncodeError
from .formats import AudioFormat, format_for
from .images import QwenImages, has_images
from .records import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER

_PLACEHOLDERS = re.compile(f"({re.escape(AUDIO_PLACEHOLDER)}|{re.escape(IMAGE_PLACEHOLDER)})")


@dataclass
class AudioProcessor:
    """The model's tokenizer, mm's audio format for its family and, when the folder has one, its Qwen-VL image
    processor: everything read from one local processor folder."""

    tokenizer: Any
    format: AudioFormat
    images: QwenImages | None
    audio_token_id: int
    image_token_id: int | None

    @classmethod
    def load(
        cls,
        path: str,
        key: str,
        *,
        sampling_rate: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> AudioProcessor:
        """Load from a local folder only (never the network); a failure is a ConfigError naming ``key``
        (``...preprocess_parameters``). ``sampling_rate`` replaces the folder's own."""
        where = f"{key}.model_name_or_path"
        config_file, config = processor_config(path, where)
        if sampling_rate is not None:
            config["sampling_rate"] = sampling_rate
        try:
            fmt = format_for(config)(config)
            images = QwenImages(config, min_pixels, max_pixels) if has_images(config) else None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
        tokens = list(dict.fromkeys((*fmt.special_tokens, *(images.special_tokens if images else ()))))
        tokenizer, ids = chat_tokenizer(path, where, tokens, f"{fmt.name} special tokens")
        image_id = ids[images.image_token] if images else None
        return cls(tokenizer, fmt, images, ids[fmt.audio_token], image_id)

    def expand(
        self,
        messages: Sequence[dict[str, str]],
        audio_samples: Sequence[int],
        image_sizes: Sequence[tuple[int, int]],
    ) -> list[dict[str, str]]:
        """The turns with every ``<audio>`` / ``<image>`` replaced by the family's placeholder text, for clips
        of ``audio_samples`` samples and images of ``image_sizes`` (width, height), in placeholder order."""
        audios, images = iter(audio_samples), iter(image_sizes)
        out = []
        for m in messages:
            parts = _PLACEHOLDERS.split(m["content"])
            for i in range(1, len(parts), 2):
                if parts[i] == AUDIO_PLACEHOLDER:
                    parts[i] = self.format.placeholder(next(audios))
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
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels (-100 outside assistant turns and at audio/image tokens)."""
        found = sum(m["content"].count(AUDIO_PLACEHOLDER) for m in messages)
        if found != len(audio_samples):
            raise EncodeError(
                f"the conversation has {found} {AUDIO_PLACEHOLDER} but {len(audio_samples)} audios"
            )
        found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if found != len(image_sizes):
            raise EncodeError(
                f"the conversation has {found} {IMAGE_PLACEHOLDER} but {len(image_sizes)} images"
            )
        expanded = self.expand(messages, audio_samples, image_sizes)
        media = {t for t in (self.audio_token_id, self.image_token_id) if t is not None}
        ids, labels, _ = encode_chat(self.tokenizer, expanded, unlabelled=media)
        audio_tokens = sum(self.format.placeholder(n).count(self.format.audio_token) for n in audio_samples)
        if self.audio_token_count(ids) != audio_tokens:
            raise EncodeError("the tokenizer did not keep every audio token whole")
        return ids, labels

    def audio_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.audio_token_id for t in ids)

    def image_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.image_token_id for t in ids) if self.image_token_id is not None else 0
