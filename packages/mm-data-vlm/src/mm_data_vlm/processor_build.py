"""Create a small Qwen-VL style processor folder (tokenizer + PIL image processor) without the network.

Used by the digits example and the tests. The folder loads with :func:`mm_data_vlm.processor.load_processor`
(and with ``transformers.AutoProcessor.from_pretrained`` where torchvision is installed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
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
