"""Tiny Qwen audio assets for the tests: clips written from numpy (tones over noise, 0.3-1.7 s), 56² images,
ShareGPT records with 0-2 clips (and, for Qwen3-Omni, 0-1 images) per sample, a processor folder, the model's
config.json and a YAML; for ``qwen3_asr`` and ``qwen3_omni_moe`` (:func:`make_audio_assets`).

The records come in a fixed order (the YAML turns shuffling off) chosen so that, with 4 samples per global
micro-batch, one rank of a 2-rank run gets micro-batches without audio (or without images) while the other
gets some, and whole micro-batches lack audio (or images): every idle-tower path runs in every layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

RATE = 16000
#: (clips, images) per record, in dataset order (see the module docstring)
OMNI_MEDIA = [
    *[(1, 0), (0, 1), (2, 0), (0, 1)],  # rank 0: audio only, rank 1: images only
    *[(1, 1), (2, 0), (0, 0), (1, 1)],
    *[(0, 0), (1, 0), (0, 0), (0, 1)],  # rank 0: neither
    *[(0, 1), (0, 1), (0, 0), (0, 0)],  # no audio in the micro-batch
    *[(1, 0), (2, 0), (1, 0), (0, 0)],  # no image in the micro-batch
    *[(1, 1), (1, 0), (2, 1), (0, 1)],
]
ASR_MEDIA = [(k, 0) for k in (1, 0, 2, 0, 1, 1, 0, 1, 0, 0, 1, 2, 1, 1, 1, 1, 0, 0, 0, 0, 2, 1, 0, 1)]

#: the tiny towers and decoder (mrope_section sums to head_dim / 2 = 64 / 4 / 2)
AUDIO_CONFIG = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "downsample_hidden_size": 8,
    "output_dim": 64,
    "n_window": 50,  # the only chunk size (with 49-52) the encoders' row count allows
    "n_window_infer": 200,
}
VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 14,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MOE_TEXT = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
}


def clip(seconds: float, seed: int) -> np.ndarray:
    """A tone (random pitch) over white noise, mono float32 at :data:`RATE`."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    wave = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.05 * rng.standard_normal(t.shape)
    return wave.astype(np.float32)


def _records(root: Path, media: list[tuple[int, int]], asr: bool) -> list[dict[str, Any]]:
    import soundfile as sf
    from PIL import Image

    (root / "data" / "wav").mkdir(parents=True, exist_ok=True)
    (root / "data" / "img").mkdir(parents=True, exist_ok=True)
    records = []
    for i, (clips, images) in enumerate(media):
        audios, pictures = [], []
        for j in range(clips):
            name = f"wav/{i}_{j}.wav"
            sf.write(root / "data" / name, clip(0.3 + 0.1 * ((7 * i + 3 * j) % 15), 100 * i + j), RATE)
            audios.append(name)
        for j in range(images):
            name = f"img/{i}_{j}.png"
            pixels = np.random.default_rng(1000 + i).integers(0, 255, (56, 56, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "data" / name)
            pictures.append(name)
        if asr:
            question, answer = "<audio>" * clips + "Transcribe.", f"language English<asr_text>tone {i % 7}"
        else:
            question = "<audio>" * clips + "<image>" * images + f"What is heard and seen in {i}?"
            answer = f"sound {i % 5} picture {i % 3}"
        records.append(
            {
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "audios": audios,
                "images": pictures,
            }
        )
    (root / "data" / "train.json").write_text(json.dumps(records))
    return records


def _model_config(family: str, ids: dict[str, int], vocab: int) -> Any:
    from transformers.models.qwen3_asr import Qwen3ASRConfig
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    text = {"vocab_size": vocab, **TEXT_CONFIG}
    if family == "qwen3_asr":
        return Qwen3ASRConfig(
            audio_config=AUDIO_CONFIG,
            text_config={**text, "head_dim": 16, "tie_word_embeddings": True},
            audio_token_id=ids["<|audio_pad|>"],
            pad_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        )
    return Qwen3OmniMoeThinkerConfig(
        audio_config=AUDIO_CONFIG,
        vision_config=VISION_CONFIG,
        text_config={**text, **MOE_TEXT},
        audio_token_id=ids["<|audio_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],  # read by the 3-D positions; not a declared field
    )


def make_audio_assets(root: Path, family: str) -> Path:
    """Write data, processor and model config for ``family`` (``qwen3_asr`` or ``qwen3_omni_moe``) under
    ``root``; returns the YAML path (fp32, per-token loss, no shuffling, 10 steps, no checkpoints)."""
    from mm_data_audio.processor_build import build_qwen3_asr_processor
    from mm_data_audio.processor_omni import build_qwen3_omni_processor

    asr = family == "qwen3_asr"
    records = _records(root, ASR_MEDIA if asr else OMNI_MEDIA, asr)
    texts = [m["content"] for r in records for m in r["messages"]] * 5
    build = build_qwen3_asr_processor if asr else build_qwen3_omni_processor
    proc = build(texts, root / "processor", vocab_size=300)
    return write_run(root, family, proc, name=f"{family}.yaml", cutoff_len=256, train_iters=10)


def write_run(
    root: Path,
    family: str,
    proc: Path,
    *,
    name: str,
    cutoff_len: int,
    train_iters: int,
    preprocess: dict[str, Any] | None = None,
    config_attrs: dict[str, Any] | None = None,
) -> Path:
    """The tiny model's config.json (``root/model``, its token ids read from processor ``proc``, plus
    ``config_attrs``) and the YAML ``root/name`` of an ``audio_sft`` run over ``root/data/train.json`` (fp32,
    per-token loss and, for Qwen3-Omni, the router loss, no shuffling, no checkpoints); returns its path."""
    from transformers import AutoTokenizer

    asr = family == "qwen3_asr"
    tok = AutoTokenizer.from_pretrained(proc)
    names = ["<|endoftext|>", "<|im_end|>", "<|audio_start|>", "<|audio_pad|>"]
    names += [] if asr else ["<|vision_start|>", "<|image_pad|>", "<|video_pad|>"]
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in names}
    config = _model_config(family, ids, len(tok))
    for key, value in (config_attrs or {}).items():
        setattr(config, key, value)
    config.save_pretrained(root / "model")
    loss: dict[str, Any] = {"loss_type": "per_token_loss"}
    if not asr:
        loss["router_aux_loss_coef"] = 0.02  # the load-balancing loss, read from text_config
    cfg = {
        "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": "audio_sft",
                "basic_parameters": {
                    "dataset_dir": str(root / "data"),
                    "dataset": "train.json",
                    "cutoff_len": cutoff_len,
                },
                "preprocess_parameters": {"model_name_or_path": str(proc), **(preprocess or {})},
            },
            "dataloader_param": {"shuffle": False, "collate_param": {"collator_id": "audio"}},
        },
        "model": {
            "model_id": family,
            "model_name_or_path": str(root / "model"),
            "from_scratch": True,
            "loss_cfg": loss,
        },
        "training": {
            "train_iters": train_iters,
            "lr": 3e-3,
            "seed": 7,
            "save": None,
            "progress_bar": False,
            "log_interval": 1,
        },
    }
    path = root / name
    path.write_text(yaml.safe_dump(cfg))
    return path
