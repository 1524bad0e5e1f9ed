"""Tiny assets for the CosyVoice3 tests: a speech store of synthetic utterances (sums of sines of several
lengths, random 25 Hz speech tokens, random speaker embeddings on some), a byte-level BPE text tokenizer
trained on their texts, tiny LM and flow model folders, and the YAML that trains each stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

SPEECH_VOCAB = 64
#: the tiny Qwen2 backbone of the LM stage
TINY_LM = {
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "speech_vocab": SPEECH_VOCAB,
}
#: the tiny flow model (no dropout: every layout must draw the same)
TINY_FLOW = {
    "vocab_size": SPEECH_VOCAB,
    "pre_lookahead_channels": 16,
    "dim": 32,
    "depth": 2,
    "heads": 2,
    "dim_head": 16,
    "conv_pos_groups": 4,
    "dropout": 0.0,
    "static_chunk_size": 8,
}
WORDS = ["hello", "speech", "tokens", "flow", "matching", "voice", "seven", "blue", "green", "quiet"]


def write_speech_store(root: Path, n: int = 8, seed: int = 0) -> Path:
    """``n`` utterances of 8 to 8 + n - 1 speech tokens (0.32 s and up), a few words of text each; every
    other one has a speaker embedding."""
    from mm_data_audio.cosyvoice.store import Utterance, write_store

    rng = np.random.default_rng(seed)
    utts = []
    for i in range(n):
        tokens = 8 + (i * 5) % n
        t = np.arange(960 * tokens) / 24000
        wave = np.sum([0.2 / k * np.sin(2 * np.pi * (110 + 30 * i) * k * t) for k in (1, 2, 3)], axis=0)
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 3))
        utts.append(
            Utterance(
                id=f"utt{i:02d}",
                text=text,
                wave=wave,
                speech_tokens=rng.integers(0, SPEECH_VOCAB, tokens),
                speaker=rng.standard_normal(192) if i % 2 else None,
            )
        )
    return write_store(root, utts, SPEECH_VOCAB)


def write_tokenizer(folder: Path) -> Path:
    from mm_core.data.bpe import write_bytelevel_bpe

    corpus = [" ".join(WORDS)] * 20 + ["You are a helpful assistant."] * 5
    return write_bytelevel_bpe(
        corpus, 300, folder, special_tokens=["<|endoftext|>", "<|endofprompt|>"], chat_template=""
    )


def write_models(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Random tiny LM and flow folders (``config.json`` + ``model.safetensors``)."""
    from mm_core.models import ModelArguments
    from mm_models_cosyvoice.flow import CosyVoice3FlowForTraining
    from mm_models_cosyvoice.lm import CosyVoice3LMForTraining

    torch.manual_seed(seed)
    lm = CosyVoice3LMForTraining._from_config(
        ModelArguments(model_id="cosyvoice3_lm", from_scratch=True, config_overrides=TINY_LM)
    )
    lm.save_pretrained(root / "lm")
    flow = CosyVoice3FlowForTraining._from_config(
        ModelArguments(model_id="cosyvoice3_flow", from_scratch=True, config_overrides=TINY_FLOW)
    )
    flow.save_pretrained(root / "flow")
    return root / "lm", root / "flow"


def make_stage_configs(root: Path) -> dict[str, Path]:
    """Store, tokenizer, model folders and one YAML per stage (``lm``: mm's token loss; ``flow``: the raw
    flow-matching loss), fp32, logged every step."""
    store = write_speech_store(root / "store")
    tokenizer = write_tokenizer(root / "tokenizer")
    lm, flow = write_models(root)
    out = {}
    for stage, model_id, folder, loss in (
        ("lm", "cosyvoice3_lm", lm, "per_token_loss"),
        ("flow", "cosyvoice3_flow", flow, "raw"),
    ):
        basic: dict[str, object] = {"dataset": str(store), "stage": stage}
        if stage == "lm":
            basic["bistream_prob"] = 0.5
        cfg = {
            "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
            "data": {
                "dataset_param": {
                    "dataset_type": "cosyvoice_speech",
                    "basic_parameters": basic,
                    "preprocess_parameters": {"model_name_or_path": str(tokenizer)} if stage == "lm" else {},
                },
                "dataloader_param": {"collate_param": {"collator_id": f"cosyvoice_{stage}"}},
            },
            "model": {
                "model_id": model_id,
                "model_name_or_path": str(folder),
                "loss_cfg": {"loss_type": loss},
            },
            "training": {
                "train_iters": 3,
                "lr": 1e-3,
                "seed": 7,
                "save": None,
                "progress_bar": False,
                "log_interval": 1,
            },
        }
        path = root / f"{stage}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        out[stage] = path
    return out


#: the tiny discriminator of the vocoder stage (``training.task_param.discriminator``)
TINY_DISCRIMINATOR = {"mpd_channels": [4, 8, 8, 8, 8], "mrd_channels": 4}


def make_vocoder_config(root: Path) -> Path:
    """CosyVoice3's vocoder stage: a tiny HiFT generator against a tiny discriminator (the
    ``cosyvoice_vocoder`` task) on 1920-sample crops (4 mel frames) of the speech store of
    :func:`write_speech_store`. Returns the YAML path."""
    cfg = {
        "parallel": {"fully_shard_parallel_size": "auto"},
        "data": {
            "dataset_param": {
                "dataset_type": "cosyvoice_speech",
                "basic_parameters": {
                    "dataset": str(write_speech_store(root / "store")),
                    "stage": "vocoder",
                    "segment_samples": 1920,
                },
            },
            "dataloader_param": {"collate_param": {"collator_id": "cosyvoice_vocoder"}},
        },
        "model": {
            "model_id": "cosyvoice3_hift",
            "from_scratch": True,
            "config_overrides": {"base_channels": 16, "f0_cond_channels": 8},
        },
        "training": {
            "task": "cosyvoice_vocoder",
            "task_param": {"discriminator": TINY_DISCRIMINATOR},
            "train_iters": 2,
            "lr": 1.0e-3,
            "seed": 7,
        },
    }
    path = root / "vocoder.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path
