"""Build the digits example's assets from scikit-learn's bundled handwritten digits (no network).

Writes, under ``--out`` (default: ``examples/qwen3vl_digits/build``):
- ``data/images/<i>.png``: each 8×8 digit upscaled to 56×56 RGB; with ``--mixed-sizes``, to 28, 56, 84 or
  112 pixels square (by turns: image ``i`` gets ``MIXED_SIZES[i % 4]``), so that under the variant's pixel
  settings (README: ``image_min_pixels: 784``, ``image_max_pixels: 12544``) images make 1, 4, 9 or 16 vision
  tokens and samples differ in length (for token-budget batching);
- ``data/train.json`` / ``data/test.json``: LLaMA-Factory style records
  ``{"messages": [{"role": "user", "content": "<image>Which digit is this?"},
  {"role": "assistant", "content": "7"}], "images": ["images/12.png"]}`` (a seeded 80/20 split);
- ``processor/``: a byte-level BPE tokenizer with Qwen's vision tokens and a PIL Qwen2-VL image processor
  (patch 14, merge 2, exactly 56×56 pixels, so every image is 4 vision tokens);
- ``model/config.json``: a tiny Qwen3-VL (vision depth 2, hidden 64; language 2 layers, hidden 64), or with
  ``--family`` the same size in another family (:data:`FAMILIES`; MoE ones: 4 experts, 2 active).

Needs ``pip install scikit-learn pillow``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QUESTION = "<image>Which digit is this?"
SIZE = 56
#: image sides with --mixed-sizes: multiples of 28 (patch 14 x merge 2), so each is its own grid when
#: image_min_pixels <= 28 * 28 and image_max_pixels >= 112 * 112
MIXED_SIZES = (28, 56, 84, 112)


def build(
    out: Path, seed: int = 0, test_fraction: float = 0.2, mixed_sizes: bool = False, family: str = "qwen3_vl"
) -> Path:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from transformers import AutoTokenizer

    from mm_data_vlm.processor_build import build_qwen_vl_processor, build_vl_processor

    digits = load_digits()
    images_dir = out / "data" / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (pixels, target) in enumerate(zip(digits.images, digits.target)):
        gray = (pixels / 16.0 * 255.0).clip(0, 255).astype(np.uint8)
        side = MIXED_SIZES[i % len(MIXED_SIZES)] if mixed_sizes else SIZE
        Image.fromarray(gray, mode="L").resize((side, side), Image.NEAREST).convert("RGB").save(
            images_dir / f"{i}.png"
        )
        records.append(
            {
                "messages": [
                    {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": str(int(target))},
                ],
                "images": [f"images/{i}.png"],
            }
        )
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_test = int(len(records) * test_fraction)
    test, train = [records[i] for i in order[:n_test]], [records[i] for i in order[n_test:]]
    (out / "data" / "train.json").write_text(json.dumps(train), encoding="utf-8")
    (out / "data" / "test.json").write_text(json.dumps(test), encoding="utf-8")

    texts = ["Which digit is this?", "user", "assistant", "\n"] * 50 + [str(d) for d in range(10)] * 50
    image_config, tokens, make_config = FAMILIES[family]
    if image_config is None:  # Qwen-VL's processor
        proc = build_qwen_vl_processor(texts, out / "processor", vocab_size=300)
    else:
        proc = build_vl_processor(texts, out / "processor", image_config, tokens, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(proc)
    ids = {t: tok.convert_tokens_to_ids(t) for t in tokens}
    config = make_config(len(tok), ids)
    (out / "model").mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out / "model")
    return out


#: the tiny vision tower of every Qwen family here: 56 x 56 images make 4 x 4 patches of 14, merged 2 x 2
QWEN_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
}
QWEN_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
}
#: 4 routed experts of width 64 per layer, 2 active per token: the MoE variants' active MLP width is the
#: dense one's
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def _token_ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def qwen3_vl(vocab: int, ids: dict[str, int]) -> Any:
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={"vocab_size": vocab, **QWEN_TEXT},
        vision_config={**QWEN_VISION, "deepstack_visual_indexes": [0]},
        tie_word_embeddings=True,
        **_token_ids(ids),
    )


def qwen3_vl_moe(vocab: int, ids: dict[str, int]) -> Any:
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(
        text_config={"vocab_size": vocab, **QWEN_TEXT, **MOE},
        vision_config={**QWEN_VISION, "deepstack_visual_indexes": [0]},
        tie_word_embeddings=True,
        **_token_ids(ids),
    )


#: Qwen3.5's linear-attention (Gated DeltaNet) layers: 2 key heads and 4 value heads of 16
QWEN3_5_LINEAR = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


def qwen3_5(vocab: int, ids: dict[str, int]) -> Any:
    """Qwen3.5 (dense): a linear-attention (Gated DeltaNet) layer, then a full-attention one, each with a
    dense MLP of the Qwen3-VL width."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config={"vocab_size": vocab, **QWEN_TEXT, **QWEN3_5_LINEAR},
        vision_config=QWEN_VISION,
        tie_word_embeddings=True,
        **_token_ids(ids),
    )


def qwen3_5_moe(vocab: int, ids: dict[str, int]) -> Any:
    """Qwen3.5-MoE: a linear-attention (Gated DeltaNet) layer, then a full-attention one; routed experts and a
    gated shared expert in each."""
    from transformers import Qwen3_5MoeConfig

    text = {k: v for k, v in QWEN_TEXT.items() if k != "intermediate_size"}
    return Qwen3_5MoeConfig(
        text_config={
            "vocab_size": vocab,
            **text,
            **MOE,
            **QWEN3_5_LINEAR,
            "shared_expert_intermediate_size": 64,
        },
        vision_config=QWEN_VISION,
        tie_word_embeddings=True,
        **_token_ids(ids),
    )


def kimi_k25(vocab: int, ids: dict[str, int]) -> Any:
    """Kimi K2.5: a DeepSeek-V3 language model (multi-head latent attention; layer 0 dense, layer 1 4 routed
    experts top-2 and a shared expert) behind a MoonViT-style tower."""
    from transformers.models.kimi_k25 import Kimi_K25Config

    return Kimi_K25Config(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "head_dim": 8,
            "v_head_dim": 16,
            "max_position_embeddings": 512,
        },
        vision_config={
            "patch_size": 14,
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "pos_emb_height": 8,
            "pos_emb_width": 8,
        },
        projection_hidden_size=64,
        image_token_id=ids["<|media_pad|>"],
        tie_word_embeddings=True,
    )


def minimax_m3_vl(vocab: int, ids: dict[str, int]) -> Any:
    """MiniMax-M3-VL: a full-attention layer, then a block-sparse one (its indexer frozen by mm's policy);
    layer 0 dense, layer 1 4 routed experts top-2 and a shared expert."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    return MiniMaxM3VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 64,
            "dense_intermediate_size": 128,
            "shared_intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "index_n_heads": 2,
            "index_head_dim": 8,
            "index_block_size": 4,
            "index_topk_blocks": 2,
            "index_local_blocks": 1,
            "layer_types": ["full_attention", "minimax_m3_sparse"],
            "mlp_layer_types": ["dense", "sparse"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        image_token_index=ids["]<]image[>["],
        video_token_index=ids["]<]video[>["],
        projector_hidden_size=64,
    )


def step3p7(vocab: int, ids: dict[str, int]) -> Any:
    """Step 3.7: layer 0 dense, layer 1 4 routed experts top-2 (clamped SwiGLU) and a shared expert; the
    56 × 56 global view over ViT patches of 7, downsampled 4× into 2 × 2 image tokens."""
    from transformers.models.step3p7 import Step3p7Config

    return Step3p7Config(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "mlp_layer_types": ["dense", "sparse"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "share_expert_dim": 64,
            "swiglu_limits": [0, 7.0],
            "sliding_window": 512,
        },
        vision_config={
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "mlp_ratio": 2.0,
            "image_size": 56,
            "patch_size": 7,
        },
        image_token_id=ids["<im_patch>"],
    )


QWEN_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
#: ``--family``: (image processor configuration, or None for Qwen-VL's; the image tokens of its tokenizer;
#: the model config). Each family's recipe is ``examples/<family>_digits/config.yaml``.
FAMILIES: dict[str, tuple[dict[str, Any] | None, tuple[str, ...], Callable[[int, dict[str, int]], Any]]] = {
    "qwen3_vl": (None, QWEN_TOKENS, qwen3_vl),
    "qwen3_vl_moe": (None, QWEN_TOKENS, qwen3_vl_moe),
    "qwen3_5": (None, QWEN_TOKENS, qwen3_5),
    "qwen3_5_moe": (None, QWEN_TOKENS, qwen3_5_moe),
    "kimi_k25": (
        {
            "image_processor_type": "Kimi_K25ImageProcessor",
            "patch_size": 14,
            "merge_size": 2,
            "size": {"max_height": 8, "max_width": 8},
            "max_patches": 64,
        },
        ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"),
        kimi_k25,
    ),
    "minimax_m3_vl": (
        {
            "image_processor_type": "MiniMaxM3VLImageProcessor",
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "size": {"shortest_edge": SIZE * SIZE, "longest_edge": SIZE * SIZE},
        },
        ("]<]start of image[>[", "]<]end of image[>[", "]<]image[>[", "]<]video[>["),
        minimax_m3_vl,
    ),
    "step3p7": (
        {
            "image_processor_type": "Step3p7ImageProcessor",
            "size": {"height": SIZE, "width": SIZE},
            "patch_size": SIZE,
            "max_image_size": SIZE,
            "vision_patch_size": 7,
        },
        ("<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>", "<im_patch>"),
        step3p7,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "build")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mixed-sizes",
        action="store_true",
        help=f"write images at {', '.join(map(str, MIXED_SIZES))} pixels square by turns instead of all at "
        f"{SIZE} (see the README for the pixel settings that make them different lengths)",
    )
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="qwen3_vl",
        help="the model family whose tiny config model/config.json holds (default: qwen3_vl; each other "
        "family has its recipe under examples/<family>_digits/)",
    )
    args = parser.parse_args()
    out = build(args.out, args.seed, mixed_sizes=args.mixed_sizes, family=args.family)
    print(f"wrote {out}/data (train.json, test.json, images/), {out}/processor, {out}/model/config.json")


if __name__ == "__main__":
    main()
