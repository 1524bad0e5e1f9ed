"""Tiny Qwen3-VL assets for the tests: images of several sizes, records with 0-2 images, processor, config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import yaml
from mm_data_vlm.processor_build import build_qwen_vl_processor

SIZES = [(56, 56), (84, 56), (56, 112)]


def make_assets(root: Path, n: int = 32, seed: int = 0) -> Path:
    """Write data, processor and model config under ``root``; returns the YAML path."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen3VLConfig

    rng = random.Random(seed)
    (root / "data" / "img").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        k = [1, 2, 1, 0][i % 4]
        names = []
        for j in range(k):
            w, h = SIZES[(i + j) % len(SIZES)]
            arr = np.random.default_rng(i * 7 + j).integers(0, 255, (h, w, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / "data" / "img" / f"{i}_{j}.png")
            names.append(f"img/{i}_{j}.png")
        q = "<image>" * k + f"What is shown in picture {i}?"
        records.append(
            {
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"label {rng.randint(0, 9)}"},
                ],
                "images": names,
            }
        )
    (root / "data" / "train.json").write_text(json.dumps(records))
    texts = [r["messages"][0]["content"] + r["messages"][1]["content"] for r in records] * 5
    proc = build_qwen_vl_processor(texts, root / "processor", vocab_size=300, max_pixels=56 * 112)
    tok = AutoTokenizer.from_pretrained(proc)
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [1, 1, 2],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    ).save_pretrained(root / "model")
    cfg = {
        "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": "vlm_sft",
                "basic_parameters": {
                    "dataset_dir": str(root / "data"),
                    "dataset": "train.json",
                    "cutoff_len": 128,
                },
                "preprocess_parameters": {"model_name_or_path": str(root / "processor")},
            },
            "dataloader_param": {"collate_param": {"collator_id": "qwen3vl"}},
        },
        "model": {
            "model_id": "qwen3_vl",
            "model_name_or_path": str(root / "model"),
            "from_scratch": True,
            "loss_cfg": {"loss_type": "per_token_loss"},
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
    path = root / "vlm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


#: the mixture-of-experts fields the tiny Qwen3-VL-MoE adds to the text config of :func:`make_assets`
MOE_TEXT = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


def make_moe_assets(root: Path, n: int = 32, seed: int = 0) -> Path:
    """:func:`make_assets` for ``qwen3_vl_moe``: the same data, processor, towers and token ids, every decoder
    layer a mixture of 4 fused experts (top-2), router load-balancing loss on. Returns the YAML path."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    path = make_assets(root, n, seed)
    dense = Qwen3VLConfig.from_pretrained(root / "model")
    drop = ("model_type", "transformers_version", "architectures", "dtype")
    text = {k: v for k, v in dense.text_config.to_dict().items() if k not in drop}
    vision = {k: v for k, v in dense.vision_config.to_dict().items() if k not in drop}
    Qwen3VLMoeConfig(
        text_config={**text, **MOE_TEXT},
        vision_config=vision,
        image_token_id=dense.image_token_id,
        video_token_id=dense.video_token_id,
        vision_start_token_id=dense.vision_start_token_id,
        vision_end_token_id=dense.vision_end_token_id,
        tie_word_embeddings=True,
    ).save_pretrained(root / "model")
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["model_id"] = "qwen3_vl_moe"
    cfg["model"]["loss_cfg"]["router_aux_loss_coef"] = 0.02  # the load-balancing loss, read from text_config
    path.write_text(yaml.safe_dump(cfg))
    return path
