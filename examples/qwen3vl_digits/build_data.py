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
- ``model/config.json``: a tiny Qwen3-VL (vision depth 2, hidden 64; language 2 layers, hidden 64).

Needs ``pip install scikit-learn pillow``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTION = "<image>Which digit is this?"
SIZE = 56
#: image sides with --mixed-sizes: multiples of 28 (patch 14 x merge 2), so each is its own grid when
#: image_min_pixels <= 28 * 28 and image_max_pixels >= 112 * 112
MIXED_SIZES = (28, 56, 84, 112)


def build(out: Path, seed: int = 0, test_fraction: float = 0.2, mixed_sizes: bool = False) -> Path:
    import numpy as np
    from mm_data_vlm.processor_build import build_qwen_vl_processor
    from PIL import Image
    from sklearn.datasets import load_digits
    from transformers import AutoTokenizer, Qwen3VLConfig

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
    proc = build_qwen_vl_processor(texts, out / "processor", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(proc)
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok),
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
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    (out / "model").mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out / "model")
    return out


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
    args = parser.parse_args()
    out = build(args.out, args.seed, mixed_sizes=args.mixed_sizes)
    print(f"wrote {out}/data (train.json, test.json, images/), {out}/processor, {out}/model/config.json")


if __name__ == "__main__":
    main()
