"""Create a small processor folder (tokenizer + image processor configuration) without the network, for any
family mm-data-vlm has an image format for (Qwen-VL's is :func:`build_qwen_vl_processor`).

Used by the digits example and the tests. The folder loads with :func:`mm_data_vlm.processor.load_processor`
(and with ``transformers.AutoProcessor.from_pretrained`` where torchvision is installed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mm_core.data.bpe import write_bytelevel_bpe

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

# ChatML, as Qwen uses it; no default system prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_vl_processor(
    texts: Iterable[str],
    out_dir: str | Path,
    image_config: Mapping[str, Any],
    image_tokens: Sequence[str],
    *,
    vocab_size: int = 512,
) -> Path:
    """Train a byte-level BPE on ``texts`` with ChatML's tokens and a family's ``image_tokens`` (each one
    token), and write it with ``image_config`` as ``preprocessor_config.json`` into ``out_dir``: a processor
    folder of any family mm-data-vlm has an image format for (``image_config["image_processor_type"]``)."""
    specials = tuple(dict.fromkeys((EOS_TOKEN, IM_START, IM_END, *image_tokens)))
    out = write_bytelevel_bpe(
        texts, vocab_size, out_dir, special_tokens=specials, chat_template=CHATML_TEMPLATE
    )
    text = json.dumps(dict(image_config), indent=2, sort_keys=True) + "\n"
    (out / "preprocessor_config.json").write_text(text)
    return out


def build_qwen_vl_processor(
    texts: Iterable[str],
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 56 * 56,
    videos: Mapping[str, Any] | None = None,
) -> Path:
    """:func:`build_vl_processor` for Qwen-VL: Qwen's vision tokens and a ``Qwen2VLImageProcessorPil``
    configuration; with ``videos`` (values over :func:`qwen3_vl_video_config`'s, ``{}`` for its defaults) also
    a ``video_preprocessor_config.json`` of ``Qwen3VLVideoProcessor``, so the folder reads videos."""
    image_config = {
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    tokens = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    out = build_vl_processor(texts, out_dir, image_config, tokens, vocab_size=vocab_size)
    if videos is not None:
        config = qwen3_vl_video_config(
            patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size
        )
        config.update(videos)
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        (out / "video_preprocessor_config.json").write_text(text)
    return out


def qwen3_vl_video_config(
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 16,
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 56 * 56 * 16,
) -> dict[str, Any]:
    """A ``Qwen3VLVideoProcessor`` configuration (``video_preprocessor_config.json``) for small clips:
    ``min_pixels`` / ``max_pixels`` are the fewest / most pixels of a whole clip (all sampled frames)."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_sample_frames": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
        "fps": fps,
        "min_frames": min_frames,
        "max_frames": max_frames,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
