"""Tiny Wan2.2 assets for the video tests: clips encoded by a tiny random VAE into a latent store, a tiny
random ``WanTransformer3DModel`` saved as a diffusers folder, and the YAML that trains it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

#: the tiny transformer of the issue (2 heads of 12, 2 blocks, 16 latent channels, 32-wide text)
TINY_WAN = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
#: the tiny VAE: 8× spatial, 4× temporal compression to 16 channels
TINY_VAE = {
    "base_dim": 3,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
TEXT_DIM = 32


def byte_text_encoder(seed: int = 0):
    """A frozen stand-in text encoder: each caption's bytes through a seeded embedding, [len, TEXT_DIM]."""
    table = torch.randn(256, TEXT_DIM, generator=torch.Generator().manual_seed(seed))

    def encode(captions: list[str]) -> list[torch.Tensor]:
        return [table[torch.tensor(list(c.encode()), dtype=torch.long)] for c in captions]

    return encode


def write_store(root: Path, n: int, shapes: list[tuple[int, int, int]], seed: int = 0) -> Path:
    """Encode ``n`` random clips (frame/height/width cycling through ``shapes``) with the tiny VAE into a
    latent store at ``root``."""
    from diffusers import AutoencoderKLWan

    from mm_data_video import Clip, encode_clips

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**TINY_VAE)
    rng = np.random.default_rng(seed)
    clips = []
    for i in range(n):
        t, h, w = shapes[i % len(shapes)]
        frames = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
        clips.append(Clip(f"clip{i:03d}", frames, f"a {i % 10} moving {'left' if i % 2 else 'right'}"))
    encode_clips(clips, root, vae=vae, encode_text=byte_text_encoder(seed))
    return root


def write_wan(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """A random tiny ``WanTransformer3DModel`` saved as a diffusers model folder."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    WanTransformer3DModel(**{**TINY_WAN, **overrides}).save_pretrained(folder)
    return folder


def make_video_assets(root: Path, n: int = 8, shapes: list[tuple[int, int, int]] | None = None) -> Path:
    """Store, model folder and YAML (fp32, raw flow-matching loss, log every step) under ``root``."""
    store = write_store(root / "store", n, shapes or [(9, 32, 32)])
    model = write_wan(root / "transformer")
    cfg = {
        "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": "video_latents",
                "basic_parameters": {"dataset": str(store), "text_length": 24},
            },
            "dataloader_param": {"collate_param": {"collator_id": "video_latents"}},
        },
        "model": {
            "model_id": "wan2_2",
            "model_name_or_path": str(model),
            "loss_cfg": {"loss_type": "raw"},
            "config_overrides": {"flow_matching": {"timestep_sampling": "logit_normal", "shift": 3.0}},
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
    path = root / "wan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
