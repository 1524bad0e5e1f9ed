"""Create a small processor folder (tokenizer + ``preprocessor_config.json``) without the network, for any
family mm-data-audio has an audio format for (Qwen3-ASR's is :func:`build_qwen3_asr_processor`).

Used by the tests and tiny recipes. The folder loads with ``mm_data_audio.encode.AudioProcessor.load`` (what
``audio_sft`` / ``asr_manifest`` use). With ``image_config`` the image processor's keys are merged into the
same ``preprocessor_config.json``, as Qwen-Omni's published folders do, and Qwen's vision tokens are added.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mm_core.data.bpe import write_bytelevel_bpe

from .formats.qwen_audio import AUDIO_END, AUDIO_PAD, AUDIO_START
from .images import IMAGE_PAD, VISION_END, VISION_START

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VIDEO_PAD = "<|video_pad|>"
#: Qwen3-ASR's marker between the detected language and the transcript ("language English<asr_text>...")
ASR_TEXT = "<asr_text>"

# ChatML, as Qwen uses it; no default system prompt.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def qwen_vl_image_config(*, min_pixels: int = 56 * 56, max_pixels: int = 56 * 56) -> dict[str, Any]:
    """A ``Qwen2VLImageProcessor`` configuration (patch 14, merge 2), to merge into a feature config."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }


def build_audio_processor(
    texts: Iterable[str],
    out_dir: str | Path,
    feature_config: Mapping[str, Any],
    audio_tokens: Sequence[str],
    *,
    image_config: Mapping[str, Any] | None = None,
    vocab_size: int = 512,
    chat_template: str = CHATML,
) -> Path:
    """Train a byte-level BPE on ``texts`` with ChatML's tokens and a family's ``audio_tokens`` (each one
    token; plus Qwen's vision tokens with ``image_config``) and write ``feature_config`` (with
    ``image_config``'s keys merged in) as ``preprocessor_config.json`` into ``out_dir``: a processor folder of
    any family mm-data-audio has an audio format for (``feature_config["feature_extractor_type"]``)."""
    vision = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD) if image_config else ()
    specials = tuple(dict.fromkeys((EOS_TOKEN, IM_START, IM_END, *audio_tokens, *vision)))
    out = write_bytelevel_bpe(
        texts, vocab_size, out_dir, special_tokens=specials, chat_template=chat_template
    )
    config = {**dict(feature_config), **dict(image_config or {})}
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def qwen3_asr_feature_config(**overrides: Any) -> dict[str, Any]:
    """``Qwen3ASRFeatureExtractor``'s configuration: the defaults of its constructor (128 mel bins, 16 kHz,
    hop 160, 100-frame chunks, ...), with ``overrides``."""
    from transformers.models.qwen3_asr import Qwen3ASRFeatureExtractor

    params = inspect.signature(Qwen3ASRFeatureExtractor.__init__).parameters
    defaults = {
        name: p.default
        for name, p in params.items()
        if name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty
    }
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise TypeError(f"Qwen3ASRFeatureExtractor has no parameter {', '.join(unknown)}")
    return {
        "feature_extractor_type": "Qwen3ASRFeatureExtractor",
        "processor_class": "Qwen3ASRProcessor",
        "padding_side": "right",
        **defaults,
        **overrides,
    }


def build_qwen3_asr_processor(
    texts: Iterable[str],
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    image_config: Mapping[str, Any] | None = None,
    chat_template: str = CHATML,
    **feature_overrides: Any,
) -> Path:
    """:func:`build_audio_processor` for Qwen3-ASR: its audio tokens (``<|audio_start|>``, ``<|audio_pad|>``,
    ``<|audio_end|>``, ``<asr_text>``) and a ``Qwen3ASRFeatureExtractor`` configuration
    (:func:`qwen3_asr_feature_config` with ``feature_overrides``)."""
    return build_audio_processor(
        texts,
        out_dir,
        qwen3_asr_feature_config(**feature_overrides),
        (AUDIO_START, AUDIO_PAD, AUDIO_END, ASR_TEXT),
        image_config=image_config,
        vocab_size=vocab_size,
        chat_template=chat_template,
    )


#: Qwen3-TTS's text-side special tokens (ids in the model's config.json: tts_pad/bos/eos_token_id)
TTS_TOKENS = ("<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>")


def build_tts_tokenizer(
    texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 512
) -> dict[str, int]:
    """Train a byte-level BPE on ``texts`` with ChatML's and Qwen3-TTS's special tokens into ``out_dir`` (the
    tokenizer of a tiny Qwen3-TTS model folder, for ``tts_codes``); returns the special tokens' ids, which
    the folder's ``config.json`` must name (``im_start_token_id``, ``tts_pad_token_id``, ...)."""
    specials = (EOS_TOKEN, IM_START, IM_END, *TTS_TOKENS)
    out = write_bytelevel_bpe(texts, vocab_size, out_dir, special_tokens=specials, chat_template=CHATML)
    vocab = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    ids = {t["content"]: int(t["id"]) for t in vocab}
    return {name: ids[name] for name in specials}
