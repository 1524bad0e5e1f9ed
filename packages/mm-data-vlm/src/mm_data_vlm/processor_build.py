"""Create a small Qwen-VL style processor folder (tokenizer + PIL image processor) without the network.

Used by the digits example and the tests. The folder loads with :func:`mm_data_vlm.processor.load_processor`
(and with ``transformers.AutoProcessor.from_pretrained`` where torchvision is installed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from mm_core.data.bpe import write_bytelevel_bpe

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# ChatML, as Qwen uses it; no default system prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


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
) -> Path:
    """Train a byte-level BPE on ``texts`` (with Qwen's vision special tokens) and write it together with a
    ``Qwen2VLImageProcessorPil`` configuration into ``out_dir``."""
    out = write_bytelevel_bpe(
        texts, vocab_size, out_dir, special_tokens=SPECIAL_TOKENS, chat_template=CHATML_TEMPLATE
    )
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
    (out / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2, sort_keys=True) + "\n")
    return out
