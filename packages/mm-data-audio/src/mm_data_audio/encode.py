"""Turn one conversation with audio (and images) into token ids and labels, for any audio format.

Each ``<audio>`` becomes the text of the family's :meth:`~mm_data_audio.formats.AudioFormat.placeholder` for
the clip's length in samples, each ``<image>`` Qwen-VL's vision placeholder for the image's size; the
conversation is then rendered with the tokenizer's chat template, and only assistant turns carry labels (the
reply and its end-of-turn token); audio and image tokens never do. The placeholder follows from lengths and
sizes alone, so token counts come from file headers, without decoding, through the same :meth:`encode`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from mm_core.errors import ConfigError
from mm_core.train.loss import IGNORE_INDEX

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
        from transformers import AutoTokenizer

        config_file = Path(path) / "preprocessor_config.json"
        where = f"{key}.model_name_or_path"
        if not config_file.is_file():
            raise ConfigError(
                f"{where}: {path!r} is not a local folder with a preprocessor_config.json (the model's "
                "Hugging Face processor files; mm never downloads, so download it first, e.g. with "
                "`hf download`, and give the folder)"
            )
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError("it must hold a JSON object")
            if sampling_rate is not None:
                config["sampling_rate"] = sampling_rate
            fmt = format_for(config)(config)
            images = QwenImages(config, min_pixels, max_pixels) if has_images(config) else None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing or broken
            raise ConfigError(
                f"{where}: cannot load the tokenizer from {path!r}: {' '.join(str(e).split())}"
            ) from None
        tokens = list(dict.fromkeys((*fmt.special_tokens, *(images.special_tokens if images else ()))))
        ids = cast("list[int]", tokenizer.convert_tokens_to_ids(tokens))
        missing = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ConfigError(
                f"{where}: the tokenizer at {path!r} lacks the {fmt.name} special tokens {', '.join(missing)}"
            )
        if not isinstance(tokenizer.chat_template, str) or not tokenizer.chat_template:
            raise ConfigError(f"{where}: the tokenizer at {path!r} has no chat_template")
        by_token = dict(zip(tokens, ids))
        image_id = by_token[images.image_token] if images else None
        return cls(tokenizer, fmt, images, int(by_token[fmt.audio_token]), image_id)

    def _render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja2 errors and raise_exception() in templates
            raise EncodeError(f"chat template failed: {e}") from None

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
        full = self._render(expanded, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(expanded):
            if m["role"] != "assistant":
                continue
            prefix = self._render(expanded[:i], add_generation_prompt=True)
            upto = (
                full
                if i + 1 == len(expanded)
                else self._render(expanded[: i + 1], add_generation_prompt=False)
            )
            if not (upto.startswith(prefix) and full.startswith(upto)):
                raise EncodeError(
                    f"the chat template does not render turn {i} as a continuation of the turns before it, "
                    "so the assistant tokens cannot be located"
                )
            spans.append((len(prefix), len(upto.rstrip())))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = [int(t) for t in enc["input_ids"]]
        media = {self.audio_token_id, self.image_token_id}
        labels = [
            t if t not in media and any(lo <= start < hi for lo, hi in spans) else IGNORE_INDEX
            for t, (start, _end) in zip(ids, enc["offset_mapping"])
        ]
        audio_tokens = sum(self.format.placeholder(n).count(self.format.audio_token) for n in audio_samples)
        if self.audio_token_count(ids) != audio_tokens:
            raise EncodeError("the tokenizer did not keep every audio token whole")
        return ids, labels

    def audio_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.audio_token_id for t in ids)

    def image_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.image_token_id for t in ids) if self.image_token_id is not None else 0
