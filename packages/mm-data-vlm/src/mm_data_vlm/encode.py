"""Turn one conversation with images into model inputs, for any family mm-data-vlm knows.

Each ``<image>`` placeholder becomes the text of the family's image format
(:meth:`~mm_data_vlm.formats.ImageFormat.placeholder`: Qwen-VL's ``<|vision_start|>`` + N × ``<|image_pad|>``
+ ``<|vision_end|>``, Kimi K2.5's media tokens, Step 3.7's crops, ...), computed from the size at which the
image reaches the image processor. The conversation is then rendered with the tokenizer's chat template, and
only assistant turns carry labels (the reply and its end-of-turn token); image tokens never do
(:mod:`mm_core.data.chat`, shared with the text and audio datasets).

Since the placeholder follows from the size alone, preparation counts every sample's tokens from the image
headers, without decoding a pixel, through the same :meth:`VisionProcessor.encode_sizes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mm_core.data.chat import encode_chat
from mm_core.data.processor import chat_tokenizer, processor_config
from mm_core.errors import ConfigError

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
        where = f"{key}.model_name_or_path"
        config_file, config = processor_config(path, where)
        try:
            fmt = format_for(config)(config, min_pixels, max_pixels)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
        tokenizer, ids = chat_tokenizer(path, where, fmt.special_tokens, f"{fmt.name} image tokens")
        return cls(tokenizer, fmt, ids[fmt.image_token])

    def images(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The forward's pixel inputs for one sample's images (see :meth:`ImageFormat.pixels`)."""
        return self.format.pixels(images)

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
        ids, labels, _ = encode_chat(self.tokenizer, expanded, unlabelled={self.image_token_id})
        expected = sum(t.count(self.format.image_token) for t in texts)
        if sum(t == self.image_token_id for t in ids) != expected:
            raise EncodeError("the tokenizer did not keep every image token whole")
        return ids, labels

    def image_token_count(self, ids: Sequence[int]) -> int:
        return sum(int(t) == self.image_token_id for t in ids)
