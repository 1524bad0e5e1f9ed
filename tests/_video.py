"""Tiny assets for the video tests: for Wan2.2, clips encoded by a tiny random VAE into a latent store, a
tiny random ``WanTransformer3DModel`` saved as a diffusers folder, and the YAML that trains it; for LTX-2, a
store of random video + audio latents and two text embeddings per sample (the connectors' outputs), a tiny
random ``LTX2VideoTransformer3DModel`` and its YAML."""

from __future__ import annotations

import json
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
#: the tiny LTX-2 transformer: 2 video heads of 8 (8 latent channels), 2 audio heads of 4 (2 channels × 4 mel
#: bins), 12-wide text (the connectors' output), 2 blocks
TINY_LTX2 = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 16,
    "audio_in_channels": 8,
    "audio_out_channels": 8,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 4,
    "audio_cross_attention_dim": 8,
    "caption_channels": 12,
    "num_layers": 2,
}
#: latents of every LTX-2 test sample: video [C, F, H, W] and audio [C, L, M]
LTX2_VIDEO, LTX2_AUDIO = (8, 3, 4, 4), (2, 5, 4)


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


def _train_config(store: Path, model_id: str, model: Path, text_length: int, **basic: object) -> dict:
    """The YAML of a tiny run: fp32, the raw flow-matching loss, logged every step."""
    return {
        "parallel": {"fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": "video_latents",
                "basic_parameters": {"dataset": str(store), "text_length": text_length, **basic},
            },
            "dataloader_param": {"collate_param": {"collator_id": "video_latents"}},
        },
        "model": {
            "model_id": model_id,
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


def make_video_assets(root: Path, n: int = 8, shapes: list[tuple[int, int, int]] | None = None) -> Path:
    """Store, model folder and YAML (fp32, raw flow-matching loss, log every step) under ``root``."""
    store = write_store(root / "store", n, shapes or [(9, 32, 32)])
    model = write_wan(root / "transformer")
    cfg = _train_config(store, "wan2_2", model, text_length=24)
    path = root / "wan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_av_store(root: Path, n: int, seed: int = 0) -> Path:
    """A store of ``n`` random LTX-2 samples: video and audio latents, a video and an audio text embedding of
    3 to 6 real tokens (the text mask matters), written with mm-data-video's ``StoreWriter``."""
    from mm_data_video import StoreWriter

    g = torch.Generator().manual_seed(seed)
    writer = StoreWriter(root)
    for i in range(n):
        tokens = 3 + i % 4
        writer.add(
            f"av{i:03d}",
            f"a {i % 10} moving {'left' if i % 2 else 'right'}",
            torch.randn(LTX2_VIDEO, generator=g),
            torch.randn(tokens, 12, generator=g),
            audio_latents=torch.randn(LTX2_AUDIO, generator=g),
            audio_text=torch.randn(tokens, 12, generator=g),
        )
    writer.finish({"vae": "random", "audio_vae": "random"})
    return root


def make_ltx2_assets(root: Path, n: int = 8) -> Path:
    """Store, a random tiny ``LTX2VideoTransformer3DModel`` folder and the YAML that trains it, under
    ``root``."""
    from diffusers import LTX2VideoTransformer3DModel

    store = write_av_store(root / "store", n)
    torch.manual_seed(0)
    LTX2VideoTransformer3DModel(**TINY_LTX2).save_pretrained(root / "transformer")
    cfg = _train_config(store, "ltx2", root / "transformer", text_length=8, patch_size=[1, 1, 1])
    path = root / "ltx2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_export_loads(ckpt: Path, dst: Path, diffusers_class: str) -> None:
    """``mm convert dcp-to-hf CKPT DST`` (its entry in this process, ``_mm.mm_here``) writes a folder
    that diffusers' ``diffusers_class`` loads, with the checkpoint's weights (all of them, under diffusers'
    names)."""
    import diffusers
    from _mm import checkpoint_tensors, mm_here

    proc = mm_here("convert", "dcp-to-hf", str(ckpt), str(dst))
    assert proc.returncode == 0, proc.stderr
    config = json.loads((dst / "config.json").read_text())
    assert config["_class_name"] == diffusers_class and "architectures" not in config
    model = getattr(diffusers, diffusers_class).from_pretrained(dst)
    state = checkpoint_tensors(ckpt)
    exported = model.state_dict()
    assert sorted(exported) == sorted(k[6:] for k in state)
    for name, value in exported.items():
        assert torch.equal(value, state[f"model.{name}"]), name
