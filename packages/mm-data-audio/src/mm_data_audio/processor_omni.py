"""Create a small Qwen3-Omni processor folder (tokenizer + ``preprocessor_config.json`` holding the
``WhisperFeatureExtractor``'s and the Qwen-VL image processor's keys, as Qwen3-Omni's published folder does)
without the network, for the tests and tiny recipes of the ``qwen3_omni_moe`` thinker.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .formats.qwen3_omni import DEFAULT_N_WINDOW
from .formats.qwen_audio import AUDIO_END, AUDIO_PAD, AUDIO_START
from .processor_build import CHATML, build_audio_processor, qwen_vl_image_config


def qwen3_omni_feature_config(**overrides: Any) -> dict[str, Any]:
    """Qwen3-Omni's ``WhisperFeatureExtractor`` configuration: the constructor's defaults with 128 mel bins
    (16 kHz, hop 160, n_fft 400) and the processor's ``n_window``, with ``overrides``."""
    from transformers.models.whisper import WhisperFeatureExtractor

    params = inspect.signature(WhisperFeatureExtractor.__init__).parameters
    defaults = {
        name: p.default
        for name, p in params.items()
        if name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty
    }
    defaults.update(feature_size=128, n_window=DEFAULT_N_WINDOW)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise TypeError(f"WhisperFeatureExtractor (Qwen3-Omni) has no parameter {', '.join(unknown)}")
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "Qwen3OmniMoeProcessor",
        "padding_side": "right",
        **defaults,
        **overrides,
    }


def build_qwen3_omni_processor(
    texts: Iterable[str],
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    min_pixels: int = 56 * 56,
    max_pixels: int = 56 * 56,
    chat_template: str = CHATML,
    **feature_overrides: Any,
) -> Path:
    """:func:`~mm_data_audio.processor_build.build_audio_processor` for Qwen3-Omni's thinker: its audio tokens
    (``<|audio_start|>``, ``<|audio_pad|>``, ``<|audio_end|>``), Qwen's vision tokens, a
    ``WhisperFeatureExtractor`` configuration (:func:`qwen3_omni_feature_config` with ``feature_overrides``)
    and a Qwen-VL image processor (patch 14, merge 2, images resized to ``min_pixels``..``max_pixels``)."""
    return build_audio_processor(
        texts,
        out_dir,
        qwen3_omni_feature_config(**feature_overrides),
        (AUDIO_START, AUDIO_PAD, AUDIO_END),
        image_config=qwen_vl_image_config(min_pixels=min_pixels, max_pixels=max_pixels),
        vocab_size=vocab_size,
        chat_template=chat_template,
    )
