"""Tiny Qwen3-VL assets for the tests: images of several sizes, records with 0-2 images, processor, config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import yaml
from _tiny import (
    KIMI_K25_TEXT,
    KIMI_K25_VISION,
    MINIMAX_M3_TEXT,
    MINIMAX_M3_VISION,
    STEP3P7_TEXT,
    STEP3P7_VISION,
    qwen3_5_overrides,
)

from mm_data_vlm.processor_build import build_qwen_vl_processor

SIZES = [(56, 56), (84, 56), (56, 112)]


#: (frames, height, width, frames a second) of the videos of :func:`make_assets` with ``videos=True``
VIDEO_SHAPES = [(8, 56, 56, 4.0), (6, 56, 84, 6.0), (5, 28, 56, 2.0)]


def make_assets(root: Path, n: int = 32, seed: int = 0, videos: bool = False) -> Path:
    """Write data, processor and model config under ``root``; returns the YAML path. With ``videos``, record
    ``i`` also holds ``[0, 1, 1, 1][i % 4]`` short H.264 clips of :data:`VIDEO_SHAPES` (so micro-batches
    mix samples with images, videos, both and neither) and the processor reads videos."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen3VLConfig

    from mm_data_vlm.videos import write_video

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
        record = {
            "messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": f"label {rng.randint(0, 9)}"},
            ],
            "images": names,
        }
        if videos and i % 4:
            t, h, w, fps = VIDEO_SHAPES[i % len(VIDEO_SHAPES)]
            frames = np.random.default_rng(1000 + i).integers(0, 255, (t, h, w, 3), dtype=np.uint8)
            write_video(root / "data" / "img" / f"{i}.mp4", frames, fps)
            record["videos"] = [f"img/{i}.mp4"]
            record["messages"][0]["content"] = "<video>" + q
        records.append(record)
    (root / "data" / "train.json").write_text(json.dumps(records))
    texts = [r["messages"][0]["content"] + r["messages"][1]["content"] for r in records] * 5
    proc = build_qwen_vl_processor(
        texts, root / "processor", vocab_size=300, max_pixels=56 * 112, videos={} if videos else None
    )
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


def make_moe_assets(root: Path, n: int = 32, seed: int = 0, videos: bool = False) -> Path:
    """:func:`make_assets` for ``qwen3_vl_moe``: the same data, processor, towers and token ids, every decoder
    layer a mixture of 4 fused experts (top-2), router load-balancing loss on. Returns the YAML path."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    path = make_assets(root, n, seed, videos=videos)
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


def make_qwen3_5_assets(root: Path, model_id: str, n: int = 32, videos: bool = False) -> Path:
    """:func:`make_assets` for Qwen3.5's vision-language ids (``qwen3_5``, ``qwen3_5_moe``): the same records
    (0, 1 or 2 images of different sizes each), images and Qwen-VL processor (patches of 14, merged 2 x 2);
    the tiny model of :func:`_tiny.qwen3_5_overrides` (Gated DeltaNet and full-attention layers; the MoE
    one's router loss read from ``loss_cfg``) as ``config_overrides``, with the processor's vocabulary and
    image token ids, no config folder (``videos``: as :func:`make_assets`'s). Returns the YAML path."""
    from transformers import AutoTokenizer

    path = make_assets(root, n, videos=videos)
    tok = AutoTokenizer.from_pretrained(root / "processor")
    overrides = qwen3_5_overrides(model_id)
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["dataloader_param"]["collate_param"]["collator_id"] = "vlm"
    cfg["model"] = {
        "model_id": model_id,
        "model_name_or_path": None,
        "from_scratch": True,
        "config_overrides": {
            "text_config": {**overrides["text_config"], "vocab_size": len(tok)},
            "vision_config": {**overrides["vision_config"], "patch_size": 14, "num_position_embeddings": 16},
            "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
            "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
            "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
            "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
            "tie_word_embeddings": True,
        },
        "loss_cfg": {"loss_type": "per_token_loss"},
    }
    out = root / f"{model_id}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


#: the other vision-language families' tiny assets: image processor configuration, image tokens, and the model
#: config (as model.config_overrides) given the tokenizer's ids. Each runs the same records as make_assets.
def _kimi(ids: dict[str, int]) -> dict:
    """The tiny Kimi K2.5 of :mod:`_tiny`, with values wider than queries/keys (12 vs 4 + 4: the padding of
    mm's context-parallel kernel) and an 8 x 8 position-embedding grid."""
    return {
        "text_config": {**KIMI_K25_TEXT, "vocab_size": ids["vocab"], "v_head_dim": 12},
        "vision_config": {**KIMI_K25_VISION, "pos_emb_height": 8, "pos_emb_width": 8},
        "projection_hidden_size": 32,
        "image_token_id": ids["<|media_pad|>"],
        "tie_word_embeddings": True,
    }


def _step(ids: dict[str, int]) -> dict:
    """The tiny Step3p7 of :mod:`_tiny`: 32² global view and 16² crops over ViT patches of 4 (4 image tokens
    per view, 1 per crop)."""
    return {
        "text_config": {**STEP3P7_TEXT, "vocab_size": ids["vocab"]},
        "vision_config": dict(STEP3P7_VISION),
        "image_token_id": ids["<im_patch>"],
    }


def _minimax(ids: dict[str, int]) -> dict:
    """The tiny MiniMax-M3-VL of :mod:`_tiny`."""
    return {
        "text_config": {**MINIMAX_M3_TEXT, "vocab_size": ids["vocab"]},
        "vision_config": dict(MINIMAX_M3_VISION),
        "image_token_index": ids["]<]image[>["],
        "video_token_index": ids["]<]video[>["],
        "projector_hidden_size": 32,
    }


FAMILIES = {
    "kimi_k25": (
        {
            "image_processor_type": "Kimi_K25ImageProcessor",
            "patch_size": 14,
            "merge_size": 2,
            "size": {"max_height": 8, "max_width": 8},
            "max_patches": 64,
        },
        ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"),
        _kimi,
    ),
    "minimax_m3_vl": (
        {
            "image_processor_type": "MiniMaxM3VLImageProcessor",
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 112},
        },
        ("]<]start of image[>[", "]<]end of image[>[", "]<]image[>[", "]<]video[>["),
        _minimax,
    ),
    "step3p7": (
        {
            "image_processor_type": "Step3p7ImageProcessor",
            "size": {"height": 32, "width": 32},
            "patch_size": 16,
            "max_image_size": 64,
            "vision_patch_size": 4,
        },
        ("<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>", "<im_patch>"),
        _step,
    ),
}


def make_family_assets(root: Path, family: str, n: int = 32) -> Path:
    """:func:`make_assets` for another family of :data:`FAMILIES`: the same records and images, that family's
    processor folder (ChatML tokenizer with its image tokens) and tiny model (``model_id`` = ``family``,
    ``config_overrides``, no config folder). Returns the YAML path."""
    from transformers import AutoTokenizer

    from mm_data_vlm.processor_build import build_vl_processor

    path = make_assets(root, n)
    image_config, tokens, model_config = FAMILIES[family]
    records = json.loads((root / "data" / "train.json").read_text())
    texts = [r["messages"][0]["content"] + r["messages"][1]["content"] for r in records] * 5
    proc = build_vl_processor(texts, root / f"processor_{family}", image_config, tokens, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(proc)
    ids = {t: tok.convert_tokens_to_ids(t) for t in tokens} | {"vocab": len(tok)}
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["dataset_param"]["preprocess_parameters"]["model_name_or_path"] = str(proc)
    cfg["data"]["dataset_param"]["basic_parameters"]["cutoff_len"] = 256  # Step's crops make longer samples
    cfg["data"]["dataloader_param"]["collate_param"]["collator_id"] = "vlm"
    cfg["model"] = {
        "model_id": family,
        "model_name_or_path": None,
        "from_scratch": True,
        "config_overrides": model_config(ids),
        "loss_cfg": {"loss_type": "per_token_loss"},
    }
    out = root / f"{family}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out
