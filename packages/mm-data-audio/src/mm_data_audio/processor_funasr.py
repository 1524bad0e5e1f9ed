"""Small processor folders for the FunASR families (Fun-ASR-Nano, Paraformer) without the network: a
byte-level BPE tokenizer with the tokens their templates need and a ``FunAsrNanoFeatureExtractor``
configuration, served by mm-data-audio's ``fun-asr-nano`` format (:mod:`mm_data_audio.formats.fun_asr`).

Used by the tests and tiny recipes; the folders load with ``mm_data_audio.encode.AudioProcessor.load``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .formats.fun_asr import AUDIO_TOKEN
from .processor_build import CHATML, build_audio_processor

#: ``FunAsrNanoFeatureExtractor``'s constructor defaults (transformers 5.x), as its
#: ``preprocessor_config.json`` holds them. (The class cannot be instantiated here: it requires torchaudio.)
FUN_ASR_NANO_FEATURES: dict[str, Any] = {
    "feature_size": 80,
    "sampling_rate": 16000,
    "frame_length": 25,
    "frame_shift": 10,
    "num_frames_lfr": 7,
    "stride_lfr": 6,
    "window": "hamming",
    "padding_value": 0.0,
    "return_attention_mask": True,
}

#: Every turn's content as it is, nothing around it: the assistant turn (the labelled part) is the bare
#: transcript, as Paraformer predicts it (it appends its own end token).
TRANSCRIPT_TEMPLATE = "{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"


def fun_asr_nano_feature_config(**overrides: Any) -> dict[str, Any]:
    """``FunAsrNanoFeatureExtractor``'s configuration (:data:`FUN_ASR_NANO_FEATURES`) with ``overrides``."""
    unknown = sorted(set(overrides) - set(FUN_ASR_NANO_FEATURES))
    if unknown:
        raise TypeError(f"FunAsrNanoFeatureExtractor has no parameter {', '.join(unknown)}")
    return {
        "feature_extractor_type": "FunAsrNanoFeatureExtractor",
        "processor_class": "FunAsrNanoProcessor",
        "padding_side": "right",
        **FUN_ASR_NANO_FEATURES,
        **overrides,
    }


def build_fun_asr_nano_processor(
    texts: Iterable[str],
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    chat_template: str = CHATML,
    **feature_overrides: Any,
) -> Path:
    """:func:`~mm_data_audio.processor_build.build_audio_processor` for Fun-ASR-Nano: ChatML (Qwen3's turns)
    with its audio token ``<|object_ref_start|>`` and a ``FunAsrNanoFeatureExtractor`` configuration
    (:func:`fun_asr_nano_feature_config` with ``feature_overrides``). Special-token ids: ``<|endoftext|>`` 0,
    ``<|im_start|>`` 1, ``<|im_end|>`` 2, ``<|object_ref_start|>`` 3."""
    return build_audio_processor(
        texts,
        out_dir,
        fun_asr_nano_feature_config(**feature_overrides),
        (AUDIO_TOKEN,),
        vocab_size=vocab_size,
        chat_template=chat_template,
    )


def build_paraformer_processor(
    texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 512, **feature_overrides: Any
) -> Path:
    """:func:`build_fun_asr_nano_processor` with :data:`TRANSCRIPT_TEMPLATE`, for ``model_id: paraformer``:
    the labels are the transcript's tokens only. Its ids fit Paraformer's defaults: ``<|endoftext|>`` 0 (the
    CTC blank and padding), ``<|im_start|>`` 1 (``sos``), ``<|im_end|>`` 2 (``eos``); ``vocab_size`` of the
    model is the tokenizer's length."""
    return build_fun_asr_nano_processor(
        texts, out_dir, vocab_size=vocab_size, chat_template=TRANSCRIPT_TEMPLATE, **feature_overrides
    )
