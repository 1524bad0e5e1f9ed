"""Qwen3-TTS (``qwen3_tts`` on mm-data-audio's ``tts_codes``) trains the same model on 2 FSDP ranks as in 1
process: gloo, fp32, 3 steps of 2 micro-batches, a tiny model folder (byte-level BPE tokenizer, config.json in
the official layout, model.safetensors under the official names) and 24 utterances of random codec codes with
and without a language, a preset speaker or an x-vector. The FSDP run builds the model on the meta device,
loads the folder into the shards and recomputes the decoder layers. The loss, both of its parts (talker and
code predictor, ``ModelPlan.loss_parts``) and the gradient norm agree within 1e-5 relative, the token counts
exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _mm import assert_close_series, train_layouts

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4"]),
    (
        "fsdp2",
        2,
        ["training.micro_batch_size=2", "training.init_model_with_meta_device=true", "model.recompute=true"],
    ),
]
WORDS = ["hello", "world", "a", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "speech"]
HIDDEN, GROUPS, CODEBOOK = 32, 4, 32


def _config(ids: dict[str, int]) -> dict:
    """A tiny Qwen3-TTS config.json (official layout; the talker and code predictor widths differ, so the
    projection between them exists, as in the 1.7B model)."""
    stack = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    return {
        "model_type": "qwen3_tts",
        "tts_model_type": "base",
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<|tts_pad|>"],
        "tts_bos_token_id": ids["<|tts_bos|>"],
        "tts_eos_token_id": ids["<|tts_eos|>"],
        "talker_config": {
            **stack,
            "hidden_size": HIDDEN,
            "intermediate_size": 64,
            "vocab_size": 64,
            "text_vocab_size": 320,
            "text_hidden_size": 48,
            "num_code_groups": GROUPS,
            "max_position_embeddings": 512,
            "rope_theta": 1000000,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
            "codec_pad_id": 40,
            "codec_bos_id": 41,
            "codec_eos_token_id": 42,
            "codec_think_id": 43,
            "codec_nothink_id": 44,
            "codec_think_bos_id": 45,
            "codec_think_eos_id": 46,
            "codec_language_id": {"english": 50, "chinese": 51},
            "spk_id": {"vivian": 60},
            "code_predictor_config": {
                **stack,
                "hidden_size": 24,
                "intermediate_size": 48,
                "vocab_size": CODEBOOK,
                "num_code_groups": GROUPS,
                "max_position_embeddings": 64,
                "rope_theta": 1000000,
            },
        },
    }


def make_tts_assets(root: Path) -> Path:
    """Model folder, data and YAML under ``root``; returns the YAML path."""
    from mm_core.config.schema import ModelConfig
    from mm_core.models import ModelHub
    from mm_data_audio.processor_build import build_tts_tokenizer

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 7)))) for _ in range(24)]
    model_dir = root / "model"
    ids = build_tts_tokenizer(
        [f"<|im_start|>assistant\n{t}<|im_end|>\n" for t in texts] * 3, model_dir, vocab_size=300
    )
    (model_dir / "config.json").write_text(json.dumps(_config(ids)))
    torch.manual_seed(0)
    args = ModelConfig(model_id="qwen3_tts", model_name_or_path=str(model_dir), from_scratch=True)
    ModelHub.build(args).save_pretrained(model_dir)  # model.safetensors under the official names

    data = root / "data"
    (data / "codes").mkdir(parents=True)
    records = []
    for i, text in enumerate(texts):
        np.save(data / "codes" / f"{i}.npy", rng.integers(0, CODEBOOK, (int(rng.integers(2, 9)), GROUPS)))
        record = {"text": text, "codes": f"codes/{i}.npy"}
        if i % 3 == 1:
            record["language"] = "english"
        if i % 4 == 2:
            record["speaker"] = "vivian"
        elif i % 5 == 3:
            np.save(data / f"spk{i}.npy", rng.standard_normal(HIDDEN).astype(np.float32))
            record["speaker"] = f"spk{i}.npy"
        records.append(record)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    cfg = {
        "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": "tts_codes",
                "basic_parameters": {"dataset_dir": str(data), "dataset": "train.jsonl", "cutoff_len": 128},
                "preprocess_parameters": {"model_name_or_path": str(model_dir)},
            },
            "dataloader_param": {"shuffle": False, "collate_param": {"collator_id": "tts_codes"}},
        },
        "model": {
            "model_id": "qwen3_tts",
            "model_name_or_path": str(model_dir),
            "loss_cfg": {"loss_type": "raw"},
        },
        "training": {
            "train_iters": STEPS,
            "lr": 3e-3,
            "seed": 7,
            "save": None,
            "progress_bar": False,
            "log_interval": 1,
        },
    }
    path = root / "qwen3_tts.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = make_tts_assets(tmp_path_factory.mktemp("qwen3_tts_assets"))
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, COMMON, timeout=180)


@pytest.mark.slow
def test_qwen3_tts_trains_the_same_on_two_fsdp_ranks(runs):
    ref, fsdp = runs["single"], runs["fsdp2"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "talker_loss", "code_predictor_loss"):
        assert_close_series(
            [r[key] for r in ref], [r[key] for r in fsdp[: len(ref)]], 1e-5, f"qwen3_tts {key}"
        )
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in fsdp]
    for r in ref:  # loss = talker_loss + 0.3 x code_predictor_loss, per micro-batch and so per step
        assert r["loss"] == pytest.approx(r["talker_loss"] + 0.3 * r["code_predictor_loss"], rel=1e-6)
    assert ref[0]["loss"] > ref[-1]["loss"]  # it learns
