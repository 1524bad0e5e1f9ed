"""Turn one conversation with images into model inputs, for any family mm-data-vlm knows.

Each ``<image>`` placeholder becomes the text of the family's image format
(:meth:`~mm_data_vlm.formats.ImageFormat.placeholder`: Qwen-VL's ``<|vision_start|>`` + N × ``<|image_pad|>``
+ ``<|vision_end|>``, Kimi K2.5's media tokens, Step 3.7's crops, ...), computed from the size at which the
image reaches the image processor. The conversation is then rendered with the tokenizer's chat template, and
only assistant turns carry labels (the reply and its end-of-turn token); image tokens never do.

Since the placeholder follows from the size alone, preparation counts every sample's tokens from the image
headers, without decoding a pixel, through the same :meth:`VisionProcessor.encode_sizes`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from mm_core.errors import ConfigError
from mm_core.train.loss import IGNORE_INDEX

from .errors import EncodeError
from .formats import ImageFormat, format_for
from .records import IMAGE_PLACEHOLDER

__all__ = ["EncodeError", "VisionProcessor"]


@dataclass
class VisionProcessor:
    """The model's Hugging Face tokenizer and mm's image format for its family, from one local folder."""

    tokenizer: Any
    format: ImageFormat
    image_token_id: int

    @property
    def target_pixels(self) -> int | None:
        """The most pixels an image is resized to, or None when the family's format has no such bound."""
        return self.format.target_pixels

    @classmethod
    def load(cls, path: str, min_pixels: int | None, max_pixels: int | None, key: str) -> VisionProcessor:
        """Load from a local folder only (never the network); a failure is a ConfigError naming the key."""
        from transformers import AutoTokenizer

        config_file = Path(path) / "preprocessor_config.json"
        if not config_file.is_file():
            raise ConfigError(
                f"{key}.model_name_or_path: {path!r} is not a local folder with a preprocessor_config.json "
                "(the model's Hugging Face processor files; mm never downloads, so download it first, "
                "e.g. with `hf download`, and give the folder)"
            )
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
            fmt = format_for(config)(config, min_pixels, max_pixels)
        except (ValueError, TypeError) as e:
            reason = " ".join(str(e).split())
            raise ConfigError(f"{key}.model_name_or_path: {config_file}: {reason}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing or broken
            raise ConfigError(
                f"{key}.model_name_or_path: cannot load the tokenizer from {path!r}: "
                + " ".join(str(e).split())
            ) from None
        tokens = list(fmt.special_tokens)
        # a list of tokens gives a list of ids (the stub's result is int | list[int])
        ids = cast("list[int]", tokenizer.convert_tokens_to_ids(tokens))
        missing = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ConfigError(
                f"{key}.model_name_or_path: the tokenizer at {path!r} lacks the {fmt.name} image tokens "
                + ", ".join(missing)
            )
        if not isinstance(tokenizer.chat_template, str) or not tokenizer.chat_template:
            raise ConfigError(f"{key}.model_name_or_path: the tokenizer at {path!r} has no chat_template")
        return cls(tokenizer, fmt, int(ids[tokens.index(fmt.image_token)]))

    def images(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The forward's pixel inputs for one sample's images (see :meth:`ImageFormat.pixels`)."""
        return self.format.pixels(images)

    def _render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja2 errors and raise_exception() in templates
            raise EncodeError(f"chat template failed: {e}") from None

    def encode_sizes(
        self, messages: Sequence[dict[str, str]], sizes: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels (-100 outside assistant turns and at image tokens) for a conversation whose
        images reach the image processor at ``sizes`` ((width, height), in placeholder order)."""
        found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if found != len(sizes):
            raise EncodeError(
                f"the conversation has {found} {IMAGE_PLACEHOLDER} placeholders but {len(sizes)} images"
            )
        texts = [self.format.placeholder(w, h) for w, h in sizes]
        expanded, k = [], 0
        for m in messages:
            parts = m["content"].split(IMAGE_PLACEHOLDER)
            text = parts[0]
            for part in parts[1:]:
                text += texts[k] + part
                k += 1
            expanded.append({"role": m["role"], "content": text})
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
        labels = [
            t if any(lo <= start < hi for lo, hi in spans) and t != self.image_token_id else IGNORE_INDEX
            for t, (start, _end) in zip(ids, enc["offset_mapping"])
        ]
        expected = sum(t.count(self.format.image_token) for t in texts)
        if sum(t == self.image_token_id for t in ids) != expected:
            raise EncodeError("the tokenizer did not keep every image token whole")
        return ids, labels

    def image_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.image_token_id for t in ids)
