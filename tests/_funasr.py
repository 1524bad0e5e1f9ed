"""Tiny FunASR assets for the tests: an ``asr_manifest`` JSONL over clips written from numpy (tones over
noise, 0.4-1.1 s: 7-18 LFR rows, so micro-batches pad them differently in each layout), a ``fun-asr-nano``
processor folder (ChatML for Fun-ASR-Nano, the bare-transcript template for Paraformer) and a tiny model
folder (transformers' config.json, or funasr's config.yaml with a CMVN file) plus YAML, per family
(:func:`make_funasr_assets`: ``fun_asr_nano`` or ``paraformer``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

RATE = 16000
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
#: funasr's CMVN file format (Kaldi nnet1 text): <AddShift> then <Rescale>, one bracketed vector each
_MVN = (
    "<Nnet>\n<Splice> {n} {n}\n[ 0 ]\n<AddShift> {n} {n}\n<LearnRateCoef> 0 [ {shift} ]\n"
    "<Rescale> {n} {n}\n<LearnRateCoef> 0 [ {scale} ]\n</Nnet>\n"
)


def clip(seconds: float, seed: int) -> np.ndarray:
    """A tone (random pitch) over white noise, mono float32 at :data:`RATE`."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    wave = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.05 * rng.standard_normal(t.shape)
    return wave.astype(np.float32)


def write_manifest(root: Path, n: int, seconds: list[float]) -> list[str]:
    """``n`` clips (``seconds[i % len]`` long) and ``data/train.jsonl``; returns the transcripts."""
    import soundfile as sf

    (root / "data" / "wav").mkdir(parents=True, exist_ok=True)
    texts, lines = [], []
    for i in range(n):
        name = f"wav/{i}.wav"
        sf.write(root / "data" / name, clip(seconds[i % len(seconds)], 50 + i), RATE)
        text = " ".join(WORDS[(3 * i + k) % 10] for k in range(1 + i % 2))
        texts.append(text)
        lines.append(json.dumps({"audio": name, "text": text}))
    (root / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    return texts


def write_cmvn(path: Path, dim: int, seed: int = 0) -> None:
    """A Kaldi CMVN file (am.mvn) with a shift near minus the features' mean and a scale near 1 / std."""
    rng = np.random.default_rng(seed)
    shift = " ".join(f"{v:.4f}" for v in -(8.0 + rng.uniform(-2, 2, dim)))
    scale = " ".join(f"{v:.4f}" for v in 0.3 + 0.1 * rng.uniform(0, 1, dim))
    path.write_text(_MVN.format(n=dim, shift=shift, scale=scale))


def nano_config(vocab: int, audio_token_id: int) -> dict[str, Any]:
    """A tiny Fun-ASR-Nano: SAN-M encoder d_model 32, 2 layers (the last one the "timestamp" layer, both with
    the final LayerNorm), adaptor at the text width 64 (intermediate 64 // 4), Qwen3 text 2 layers; no
    dropout, so every layout computes the same thing."""
    return {
        "audio_config": {
            "model_type": "fun_asr_nano_encoder",
            "hidden_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_timestamp_prediction_layers": 1,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "max_position_embeddings": 257,
            "fsmn_kernel_size": 5,
        },
        "adaptor_config": {
            "hidden_size": 64,
            "intermediate_size": 16,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "projector_hidden_size": 48,
        },
        "text_config": {
            "model_type": "qwen3",
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "tie_word_embeddings": True,
        },
        "audio_token_id": audio_token_id,
        "tie_word_embeddings": True,
    }


def paraformer_config(vocab: int) -> dict[str, Any]:
    """A tiny Paraformer in funasr's config.yaml form: SAN-M encoder 2 layers (encoders0 + 1), SAN-M decoder
    2 layers + the FFN-only decoders3, CIF predictor, CTC weight 0.3, funasr's WavFrontend with a CMVN file;
    no dropout, no SpecAugment and no glancing sampler (their random draws differ between layouts)."""
    return {
        "model": "Paraformer",
        "model_conf": {
            "ctc_weight": 0.3,
            "lsm_weight": 0.1,
            "length_normalized_loss": False,
            "predictor_weight": 1.0,
            "predictor_bias": 1,
            "sampling_ratio": 0.0,
        },
        "vocab_size": vocab,
        "encoder": "SANMEncoder",
        "encoder_conf": {
            "output_size": 32,
            "attention_heads": 2,
            "linear_units": 64,
            "num_blocks": 2,
            "dropout_rate": 0.0,
            "positional_dropout_rate": 0.0,
            "attention_dropout_rate": 0.0,
            "input_layer": "pe",
            "pos_enc_class": "SinusoidalPositionEncoder",
            "normalize_before": True,
            "kernel_size": 5,
            "sanm_shfit": 0,
            "selfattention_layer_type": "sanm",
        },
        "decoder": "ParaformerSANMDecoder",
        "decoder_conf": {
            "attention_heads": 2,
            "linear_units": 64,
            "num_blocks": 2,
            "dropout_rate": 0.0,
            "positional_dropout_rate": 0.0,
            "self_attention_dropout_rate": 0.0,
            "src_attention_dropout_rate": 0.0,
            "att_layer_num": 2,
            "kernel_size": 5,
            "sanm_shfit": 0,
        },
        "predictor": "CifPredictorV2",
        "predictor_conf": {"idim": 32, "threshold": 1.0, "l_order": 1, "r_order": 1, "tail_threshold": 0.45},
        "ctc_conf": {"dropout_rate": 0.0, "ctc_type": "builtin", "reduce": True, "ignore_nan_grad": True},
        "frontend": "WavFrontend",
        "frontend_conf": {
            "fs": RATE,
            "window": "hamming",
            "n_mels": 80,
            "frame_length": 25,
            "frame_shift": 10,
            "lfr_m": 7,
            "lfr_n": 6,
            "cmvn_file": "am.mvn",
        },
    }


def make_funasr_assets(root: Path, family: str, n: int = 16) -> Path:
    """Data, processor, model folder and YAML for ``family`` under ``root``; returns the YAML path."""
    from transformers import AutoTokenizer

    from mm_data_audio.processor_funasr import build_fun_asr_nano_processor, build_paraformer_processor

    nano = family == "fun_asr_nano"
    texts = write_manifest(root, n, [0.4, 0.7, 1.1, 0.5, 0.9, 0.6])
    build = build_fun_asr_nano_processor if nano else build_paraformer_processor
    processor = build(texts * 10, root / "processor", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(processor)
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    if nano:
        from transformers import FunAsrNanoConfig

        FunAsrNanoConfig(
            **nano_config(len(tok), tok.convert_tokens_to_ids("<|object_ref_start|>"))
        ).save_pretrained(model_dir)
        loss, preprocess = {"loss_type": "per_token_loss"}, {"asr_prompt": "Transcribe."}
    else:
        (model_dir / "config.yaml").write_text(yaml.safe_dump(paraformer_config(len(tok)), sort_keys=False))
        write_cmvn(model_dir / "am.mvn", 560)
        loss, preprocess = {"loss_type": "raw"}, {}
    cfg = {
        "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": "asr_manifest",
                "basic_parameters": {
                    "dataset_dir": str(root / "data"),
                    "dataset": "train.jsonl",
                    "cutoff_len": 128,
                },
                "preprocess_parameters": {"model_name_or_path": str(processor), **preprocess},
            },
            "dataloader_param": {"collate_param": {"collator_id": "audio"}},
        },
        "model": {
            "model_id": family,
            "model_name_or_path": str(model_dir),
            "from_scratch": True,
            "loss_cfg": loss,
        },
        "training": {
            "train_iters": 10,
            "lr": 3e-3,
            "seed": 7,
            "save": None,
            "progress_bar": False,
            "log_interval": 1,
        },
    }
    path = root / f"{family}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
