"""Build the moving-digits video example's assets from scikit-learn's bundled handwritten digits (no network).

Writes, under ``--out`` (default: ``examples/qwen3vl_moving_digits/build``):
- ``data/clips/<i>.mp4``: a clip of ``FRAMES`` frames (``FPS`` a second, H.264) of ``CANVAS`` × ``CANVAS``
  pixels: one digit, upscaled ``SCALE`` times, white on black, travelling ``STEP`` pixels a frame left, right,
  up or down (chosen at random) from a random start anywhere on the canvas, wrapping around its edges (what
  leaves on one side comes back on the other), so every frame's picture has the same distribution whatever
  the direction: only the motion tells it;
- ``data/train.json`` / ``data/test.json``: LLaMA-Factory style records
  ``{"messages": [{"role": "user", "content": "<video>Which way does the 3 move?"},
  {"role": "assistant", "content": "left"}], "videos": ["clips/12.mp4"]}``; the digit images are split
  80/20 (seeded), so every test clip shows a handwritten digit never seen in training;
- ``processor/``: a byte-level BPE tokenizer with Qwen's vision tokens, a PIL Qwen2-VL image processor and a
  Qwen3-VL video processor (``video_preprocessor_config.json``: patch 14, merge 2, ``FPS`` frames a second,
  so all 8 frames are sampled, each 56 × 56: 4 groups of 2 frames, 4 video tokens each);
- ``model/config.json``: a tiny Qwen3-VL (vision depth 2, hidden 64; language 2 layers, hidden 64).

Needs ``pip install scikit-learn``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CANVAS = 56
FRAMES = 8
FPS = 8.0
SCALE = 2
DIGIT = 8 * SCALE
STEP = 5  # pixels a frame: 35 across the clip, 5 within each 2-frame group the patch embedding sees
DIRECTIONS = ("left", "right", "up", "down")
#: (rows, columns) a frame for each direction
MOVES = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
QUESTION = "<video>Which way does the {digit} move?"

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
    "deepstack_visual_indexes": [0],
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


def render(image: Any, direction: str, start: tuple[int, int]) -> Any:
    """uint8 [FRAMES, CANVAS, CANVAS, 3]: the 8×8 ``image`` (0..16) scaled, its top-left corner at ``start``
    (row, column) in the first frame, moved ``STEP`` pixels a frame in ``direction``, wrapping around."""
    import numpy as np

    digit = np.kron(image / 16.0 * 255.0, np.ones((SCALE, SCALE))).clip(0, 255).astype(np.uint8)
    canvas = np.zeros((CANVAS, CANVAS), np.uint8)
    canvas[:DIGIT, :DIGIT] = digit
    dy, dx = MOVES[direction]
    frames = np.stack(
        [
            np.roll(canvas, (start[0] + dy * STEP * t, start[1] + dx * STEP * t), axis=(0, 1))
            for t in range(FRAMES)
        ]
    )
    return np.repeat(frames[..., None], 3, axis=-1)


def build(out: Path, seed: int = 0, test_fraction: float = 0.2, limit: int | None = None) -> Path:
    """Write the assets under ``out`` (``limit``: only the first N digit images, for a quick check)."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    from transformers import AutoTokenizer, Qwen3VLConfig

    from mm_data_vlm.processor_build import build_qwen_vl_processor
    from mm_data_vlm.videos import write_video

    digits = load_digits()
    clips = out / "data" / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    count = len(digits.images) if limit is None else min(limit, len(digits.images))
    order = list(range(count))
    rng.shuffle(order)
    n_test = int(len(order) * test_fraction)
    held_out = set(order[:n_test])
    train: list[dict[str, Any]] = []
    test: list[dict[str, Any]] = []
    for i, (image, target) in enumerate(zip(digits.images[:count], digits.target[:count])):
        direction = rng.choice(DIRECTIONS)
        start = (rng.randrange(CANVAS), rng.randrange(CANVAS))
        write_video(clips / f"{i}.mp4", render(image, direction, start), FPS)
        record = {
            "messages": [
                {"role": "user", "content": QUESTION.format(digit=int(target))},
                {"role": "assistant", "content": direction},
            ],
            "videos": [f"clips/{i}.mp4"],
        }
        (test if i in held_out else train).append(record)
    (out / "data" / "train.json").write_text(json.dumps(train, indent=0))
    (out / "data" / "test.json").write_text(json.dumps(test, indent=0))
    texts = [QUESTION.format(digit=d) + " " + w for d in range(10) for w in DIRECTIONS] * 20
    texts += [f"<{t / 10:.1f} seconds>" for t in range(100)] * 5
    video = {
        "fps": FPS,
        "min_frames": 4,
        "max_frames": FRAMES,
        "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": CANVAS * CANVAS * FRAMES},
    }
    proc = build_qwen_vl_processor(texts, out / "processor", vocab_size=400, videos=video)
    tok = AutoTokenizer.from_pretrained(proc)
    ids = {
        t: int(tok.convert_tokens_to_ids(t))  # type: ignore[arg-type]  # one token: one id
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    Qwen3VLConfig(
        text_config={"vocab_size": len(tok), **QWEN_TEXT},
        vision_config=QWEN_VISION,
        tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    ).save_pretrained(out / "model")
    print(f"wrote {len(train)} training and {len(test)} held-out clips, processor and model config to {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "build")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="only the first N digit images")
    args = parser.parse_args()
    build(args.out, args.seed, limit=args.limit)


if __name__ == "__main__":
    main()
