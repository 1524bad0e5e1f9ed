"""The omni variant of the spoken-digits example (``build_data.py --omni``): Qwen3-Omni's thinker
(``model_id: qwen3_omni_moe``) hears one spoken digit and sees one handwritten digit in the same sample and
answers a question about the two.

Writes, under ``--out`` (default: ``examples/spoken_digits/build_omni``):

- ``data/audio/{train,test}/<i>.flac``: one digit spoken by espeak-ng (the voices, speeds and pitches of the
  ASR data; the test voices are held out the same way);
- ``data/images/<k>.png``: scikit-learn's bundled 8×8 handwritten digit ``k`` upscaled to 56×56 (4 image
  tokens); a seeded 80/20 split of the 1797 images, so test images are unseen too;
- ``data/train.jsonl`` / ``data/test.jsonl``: ``audio_sft`` records, e.g.
  ``{"messages": [{"role": "user", "content": "<audio><image>What is the sum of the spoken digit and the
  written digit?"}, {"role": "assistant", "content": "12"}], "audios": [...], "images": [...],
  "question": "sum"}``; each record asks one of :data:`QUESTIONS` in turn (which digit is spoken, which is
  written, are they the same, their sum), all four over the same two inputs, so the model learns to read each
  input and to combine them; ``evaluate.py --omni`` reports the accuracy of each;
- ``processor/``: :func:`mm_data_audio.processor_omni.build_qwen3_omni_processor` (``WhisperFeatureExtractor``
  with 128 mel bins and a Qwen-VL image processor, patch 14, 56×56 images);
- ``model/config.json``: a tiny ``Qwen3OmniMoeThinkerConfig`` (:func:`thinker_config`).

Needs espeak-ng (as ``build_data.py``), scikit-learn and Pillow.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from build_data import (
    INIT_STD,
    TEST_ACCENTS,
    TEST_VARIANTS,
    TRAIN_ACCENTS,
    TRAIN_VARIANTS,
    Clip,
    espeak_program,
    plan,
    voices,
    write_clips,
    write_jsonl,
)

SIZE = 56
#: question kind -> (the user's question after ``<audio><image>``, the answer for (spoken, written) digits)
QUESTIONS: dict[str, tuple[str, Callable[[int, int], str]]] = {
    "spoken": ("Which digit is spoken?", lambda s, w: str(s)),
    "written": ("Which digit is written?", lambda s, w: str(w)),
    "same": ("Is the spoken digit the same as the written one?", lambda s, w: "yes" if s == w else "no"),
    "sum": ("What is the sum of the spoken digit and the written digit?", lambda s, w: str(s + w)),
}

#: the thinker: audio encoder as the ASR model's, a 2-block vision tower, a 4-layer decoder whose MLPs are 4
#: experts (2 active per token); width 96 throughout, weights at standard deviation INIT_STD (build_data.py)
AUDIO = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "d_model": 96,
    "downsample_hidden_size": 32,
    "output_dim": 96,
    "n_window": 50,
    "n_window_infer": 400,
    "initializer_range": INIT_STD,
}
VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 14,  # the processor's (Qwen-VL's) patch
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 96,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
    "initializer_range": INIT_STD,
}
TEXT = {
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "max_position_embeddings": 512,
    # 3-D rotary sections (time, height, width) summing to head_dim / 2 = 96 / 4 / 2
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 4, 4],
        "mrope_interleaved": True,
    },
    "initializer_range": INIT_STD,
}


def thinker_config(tokenizer: Any) -> Any:
    """A tiny ``Qwen3OmniMoeThinkerConfig`` for ``tokenizer`` (its vocabulary and media token ids)."""
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    names = ("<|endoftext|>", "<|audio_start|>", "<|audio_pad|>", "<|vision_start|>", "<|image_pad|>")
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in (*names, "<|video_pad|>")}
    return Qwen3OmniMoeThinkerConfig(
        audio_config=AUDIO,
        vision_config=VISION,
        text_config={"vocab_size": len(tokenizer), **TEXT},
        audio_token_id=ids["<|audio_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],  # read by the 3-D positions; not a declared field
        pad_token_id=ids["<|endoftext|>"],
        initializer_range=INIT_STD,
    )


def write_images(images_dir: Path) -> list[int]:
    """Every scikit-learn digit as ``<k>.png`` (56×56 RGB); their labels."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    digits = load_digits()
    images_dir.mkdir(parents=True, exist_ok=True)
    for k, pixels in enumerate(digits.images):
        gray = (pixels / 16.0 * 255.0).clip(0, 255).astype(np.uint8)
        image = Image.fromarray(gray, mode="L").resize((SIZE, SIZE), Image.Resampling.NEAREST).convert("RGB")
        image.save(images_dir / f"{k}.png")
    return [int(t) for t in digits.target]


def records(
    clips: list[Clip],
    lines: list[dict[str, Any]],
    image_ids: list[int],
    labels: list[int],
    rng: random.Random,
) -> list[dict[str, Any]]:
    """One record per clip: the clip, a random image of ``image_ids`` (the same digit as the clip's a quarter
    of the time, so "same" is not almost always "no") and the next question of :data:`QUESTIONS` in turn."""
    by_digit: dict[int, list[int]] = {}
    for k in image_ids:
        by_digit.setdefault(labels[k], []).append(k)
    kinds = list(QUESTIONS)
    out = []
    for i, (clip, line) in enumerate(zip(clips, lines)):
        spoken = int(clip.digits)
        k = rng.choice(by_digit[spoken]) if rng.random() < 0.25 else rng.choice(image_ids)
        kind = kinds[i % len(kinds)]
        question, answer = QUESTIONS[kind]
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"<audio><image>{question}"},
                    {"role": "assistant", "content": answer(spoken, labels[k])},
                ],
                "audios": [line["audio"]],
                "images": [f"images/{k}.png"],
                "question": kind,
                "voice": clip.voice,
            }
        )
    return out


def build_omni(out: Path, num_train: int, num_test: int, seed: int) -> Path:
    """Data, processor and thinker config of the omni variant under ``out``."""
    from transformers import AutoTokenizer

    from mm_data_audio.processor_omni import build_qwen3_omni_processor

    program = espeak_program()
    rng = random.Random(seed)
    data = out / "data"
    labels = write_images(data / "images")
    order = list(range(len(labels)))
    rng.shuffle(order)
    n_test_images = len(order) // 5
    split_images = {"test": order[:n_test_images], "train": order[n_test_images:]}
    sizes = {"train": num_train, "test": num_test}
    split_voices = {
        "train": voices(TRAIN_ACCENTS, TRAIN_VARIANTS),
        "test": voices(TEST_ACCENTS, TEST_VARIANTS),
    }
    for split in ("train", "test"):
        clips = plan(sizes[split], split_voices[split], rng, digits_per_clip=(1, 1))
        lines = write_clips(clips, data, f"audio/{split}", program)
        write_jsonl(data / f"{split}.jsonl", records(clips, lines, split_images[split], labels, rng))

    texts = [*"0123456789", "yes", "no", "user", "assistant", "\n"] * 20
    texts += [question for question, _ in QUESTIONS.values()] * 20
    proc = build_qwen3_omni_processor(texts, out / "processor", vocab_size=320)
    tokenizer = AutoTokenizer.from_pretrained(proc)
    (out / "model").mkdir(parents=True, exist_ok=True)
    thinker_config(tokenizer).save_pretrained(out / "model")
    return out
