"""Image formats: how one model family turns images into its forward's pixel inputs and placeholder text.

``vlm_sft`` is one dataset for every vision-language family; what differs between families is fixed here, in
one small class per family (:class:`ImageFormat`):

- the pixel inputs of its forward (Qwen-VL: ``pixel_values`` [patches, C·T·P²] + ``image_grid_thw``;
  Kimi K2.5: ``pixel_values`` [patches, C, P, P] + ``image_grid_thw``; ...), computed without torchvision
  (PIL and numpy), from the values of the model's ``preprocessor_config.json``;
- the text an ``<image>`` placeholder becomes (special tokens around N image tokens), from the size of the
  image as it reaches the processor, so the prepared index counts tokens without decoding a pixel;
- the special tokens its tokenizer must hold, and whether its forward takes ``mm_token_type_ids``.

The format of a processor folder is chosen by its ``preprocessor_config.json``'s ``image_processor_type``
(:func:`format_for`); :data:`FORMATS` lists them. A format module is imported only when a folder needs it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..errors import EncodeError


class ImageFormat(ABC):
    """One family's image inputs. Subclasses set the class attributes and implement the three methods.

    Contract, checked on every sample by the dataset: for images of sizes ``sizes`` (width, height as they
    reach :meth:`pixels`), the text of :meth:`placeholder` holds exactly as many :attr:`image_token` as the
    model's vision tower produces rows for them (:meth:`feature_rows` of the pixel inputs)."""

    #: the name ``mm check`` and messages use
    name: ClassVar[str] = ""
    #: ``image_processor_type`` values of a ``preprocessor_config.json`` this format serves ("Pil"/"Fast"
    #: suffixes are ignored)
    processor_types: ClassVar[tuple[str, ...]] = ()
    #: the token whose rows take image features (never labelled)
    image_token: ClassVar[str] = ""
    #: every special token :meth:`placeholder` writes (the tokenizer must know each as one token)
    special_tokens: ClassVar[tuple[str, ...]] = ()
    #: the forward takes ``mm_token_type_ids`` (1 at image tokens)
    token_type_ids: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any], min_pixels: int | None, max_pixels: int | None) -> None:
        """``config``: the folder's ``preprocessor_config.json``; ``min_pixels``/``max_pixels``: the YAML's
        ``image_min_pixels``/``image_max_pixels`` (None: the processor's own). Raise ``ValueError`` naming
        the value when one is unusable for this family."""
        self.config = dict(config)

    @property
    def target_pixels(self) -> int | None:
        """The most pixels an image is resized to (lets the loader decode large images at a reduced size),
        or None when there is no such bound."""
        return None

    @abstractmethod
    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The forward's pixel inputs for one sample's RGB PIL images, in placeholder order. Every tensor is
        concatenated along dim 0 with the other samples' by the collator. Raises :class:`EncodeError` when
        an image cannot be processed (e.g. an unusable aspect ratio)."""

    @abstractmethod
    def placeholder(self, width: int, height: int) -> str:
        """The text that replaces one ``<image>`` for an image that reaches :meth:`pixels` at this size."""

    @abstractmethod
    def feature_rows(self, pixels: Mapping[str, torch.Tensor]) -> int:
        """How many image-token rows the vision tower produces for these pixel inputs."""

    def describe(self) -> str:
        """One line for ``mm check``."""
        target = f"at most {self.target_pixels:,} pixels" if self.target_pixels else "its own size rule"
        return f"{self.name} images ({target})"


def _base_type(name: str) -> str:
    for suffix in ("Pil", "Fast"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


#: ``image_processor_type`` (without a Pil/Fast suffix) -> ``module:class`` of its format in this package
FORMATS: dict[str, str] = {
    "Qwen2VLImageProcessor": "qwen:QwenVLFormat",
    "Kimi_K25ImageProcessor": "kimi:KimiK25Format",
    "MiniMaxM3VLImageProcessor": "minimax:MiniMaxM3VLFormat",
    "Step3p7ImageProcessor": "step:Step3p7Format",
}


def format_for(config: Mapping[str, Any]) -> type[ImageFormat]:
    """The format serving a ``preprocessor_config.json``; ``ValueError`` naming the known ones otherwise."""
    kind = str(config.get("image_processor_type") or "")
    target = FORMATS.get(_base_type(kind))
    if target is None:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(
            f"image_processor_type {kind or '(missing)'!r} is not one mm-data-vlm knows ({known})"
        )
    module, name = target.split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if kind and _base_type(kind) not in {_base_type(t) for t in cls.processor_types}:
        raise TypeError(f"{cls.__name__} does not list {kind!r} in processor_types")
    return cls


__all__ = ["FORMATS", "EncodeError", "ImageFormat", "format_for"]
