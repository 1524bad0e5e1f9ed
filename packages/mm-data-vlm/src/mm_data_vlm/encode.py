"""Turn one conversation with images into model inputs, Qwen-VL style.

Each ``<image>`` placeholder becomes ``<|vision_start|>`` + N × ``<|image_pad|>`` + ``<|vision_end|>``,
where N is the number of merged patches the image processor produced for that image
(``grid_thw.prod() // merge²``,
the same rule as transformers' ``Qwen3VLProcessor``). The conversation is then rendered with the tokenizer's
chat template, and only assistant turns carry labels (the reply and its end-of-turn token).

N can also be had without pixels (:meth:`VisionProcessor.image_tokens`): from the size the processor will
receive, by the image processor's own ``get_number_of_image_patches`` (the resize rule it applies).
Preparation counts every sample's tokens that way, through the same :meth:`VisionProcessor.encode_counts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from mm_core.errors import ConfigError
from mm_core.train.loss import IGNORE_INDEX

from .records import IMAGE_PLACEHOLDER

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


class EncodeError(ValueError):
    """A conversation cannot be encoded (placeholders and images disagree, template problems, ...)."""


@dataclass
class VisionProcessor:
    """The model's Hugging Face tokenizer and image processor, loaded from one local folder."""

    tokenizer: Any
    image_processor: Any
    image_token_id: int
    merge_size: int

    @property
    def target_pixels(self) -> int | None:
        """The most pixels the image processor resizes an image to (Qwen-VL's ``size.longest_edge``,
        i.e. ``max_pixels``), or None when it does not say."""
        size: Any = getattr(self.image_processor, "size", None)  # a dict or a SizeDict, or None
        value = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
        value = value or getattr(self.image_processor, "max_pixels", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    @classmethod
    def load(cls, path: str, min_pixels: int | None, max_pixels: int | None, key: str) -> VisionProcessor:
        """Load from a local folder only (never the network); a failure is a ConfigError naming the key."""
        from transformers import AutoImageProcessor, AutoTokenizer

        if not (Path(path) / "preprocessor_config.json").is_file():
            raise ConfigError(
                f"{key}.model_name_or_path: {path!r} is not a local folder with a preprocessor_config.json "
                "(the model's Hugging Face processor files; mm never downloads, so download it first, "
                "e.g. with `hf download`, and give the folder)"
            )
        limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, **limits)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing or broken
            raise ConfigError(
                f"{key}.model_name_or_path: cannot load the tokenizer and image processor from {path!r}: "
                + " ".join(str(e).split())
            ) from None
        # a list of tokens gives a list of ids (the stub's result is int | list[int])
        ids = cast("list[int]", tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD]))
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ConfigError(
                f"{key}.model_name_or_path: the tokenizer at {path!r} lacks Qwen's vision tokens "
                f"{VISION_START}, {VISION_END}, {IMAGE_PAD}"
            )
        if not isinstance(tokenizer.chat_template, str) or not tokenizer.chat_template:
            raise ConfigError(f"{key}.model_name_or_path: the tokenizer at {path!r} has no chat_template")
        if not callable(getattr(image_processor, "get_number_of_image_patches", None)):
            raise ConfigError(
                f"{key}.model_name_or_path: the image processor at {path!r} "
                f"({type(image_processor).__name__}) has no get_number_of_image_patches, which vlm_sft needs "
                "to count an image's tokens from its size when it prepares the data"
            )
        return cls(tokenizer, image_processor, int(ids[2]), int(getattr(image_processor, "merge_size", 1)))

    def images(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """``pixel_values`` [patches, channels × temporal × patch²] and ``image_grid_thw`` [images, 3]."""
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def _render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja2 errors and raise_exception() in templates
            raise EncodeError(f"chat template failed: {e}") from None

    def image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of an image that reaches the processor at ``width`` × ``height``, by the
        processor's own resize rule (``get_number_of_image_patches``: Qwen-VL's ``smart_resize`` under the
        configured min/max pixels), without any pixel: what :meth:`images` gives for it, divided by merge²."""
        try:
            patches = int(self.image_processor.get_number_of_image_patches(height, width))
        except ValueError as e:  # e.g. an aspect ratio over 200, which Qwen-VL's resize refuses
            raise EncodeError(f"the image processor refused the image: {e}") from None
        return patches // self.merge_size**2

    def grid_tokens(self, grid_thw: torch.Tensor | None) -> list[int]:
        """Placeholder tokens of each image of ``image_grid_thw`` (merged patches: ``t·h·w // merge²``)."""
        return [] if grid_thw is None else [int(g.prod()) // self.merge_size**2 for g in grid_thw]

    def encode(
        self, messages: Sequence[dict[str, str]], grid_thw: torch.Tensor | None
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels (-100 outside assistant turns) for a conversation whose images have the
        given grids (in placeholder order)."""
        return self.encode_counts(messages, self.grid_tokens(grid_thw))

    def encode_counts(
        self, messages: Sequence[dict[str, str]], counts: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """:meth:`encode` for images of ``counts`` placeholder tokens each (in placeholder order)."""
        found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if found != len(counts):
            raise EncodeError(
                f"the conversation has {found} {IMAGE_PLACEHOLDER} placeholders but {len(counts)} images"
            )
        expanded, k = [], 0
        for m in messages:
            parts = m["content"].split(IMAGE_PLACEHOLDER)
            text = parts[0]
            for part in parts[1:]:
                text += VISION_START + IMAGE_PAD * counts[k] + VISION_END + part
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
        if sum(t == self.image_token_id for t in ids) != sum(counts):
            raise EncodeError("the tokenizer did not keep every image token whole")
        return ids, labels
