"""Build the moving-digits example's assets offline: clips of scikit-learn's digits moving across a canvas,
a tiny Wan VAE trained on them, a tiny frozen text encoder, the latent store and the transformer's config.

Writes, under ``--out`` (default: ``examples/moving_digits_t2v/build``):

- ``vae/``: a tiny ``AutoencoderKLWan`` (Wan2.1's VAE architecture with two down-sampling stages: 4× spatial,
  4× temporal compression to 16 channels), **trained here** for ``--vae-steps`` steps on 5-frame windows of
  the training clips (plain torch loop: MSE of the reconstruction from the latent mean, the digit's pixels
  weighted ×5, plus a small KL term), because a random VAE does not reconstruct anything recognisable. Its
  config's ``latents_mean`` / ``latents_std`` are set to the per-channel statistics of the training clips'
  latents, so the stored latents have unit scale, as Wan's do. Encoding and decoding (``sample.py``) use this
  one folder;
- ``tokenizer/``: a word-level tokenizer over the captions' words (``a``, the ten digits, ``moving`` and the
  four directions, plus ``<pad>``, ``</s>``, ``<unk>``; T5-style end token appended);
- ``text_encoder/``: a tiny random ``UMT5EncoderModel`` (2 layers, width 32), **never trained**: frozen, it
  still gives every caption distinct embeddings, which is all the transformer needs to tell them apart;
- ``store/``: the latent store (:func:`mm_data_video.encode_clips`) of the training clips: every training
  image, ``--per-image`` times, moving in one of its digit's three training directions;
- ``model/config.json``: the tiny ``WanTransformer3DModel`` (random init by ``model.from_scratch``);
- ``build_info.json``: sizes, the VAE's training loss and how well it reconstructs held-out clips (MSE and
  the digit classifier's accuracy on the reconstructions: the ceiling for generated clips).

The clips, captions and held-out split are :mod:`moving_digits` (beside this script). Needs scikit-learn and
pillow; about 15 minutes on one CPU core (mostly the VAE's training).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import moving_digits as md
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
#: the tiny Wan VAE: 4× spatial and 4× temporal compression to 16 latent channels (two down-sampling stages,
#: both also temporal; Wan2.1's VAE has three stages, 8× spatial: measured here, at 8× this tiny VAE did not
#: learn the digits' shapes within the CPU budget, README)
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 16,
    "z_dim": 16,
    "dim_mult": [1, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [True, True],
    "scale_factor_spatial": 4,
    "scale_factor_temporal": 4,
}
#: frames of the windows the VAE trains on: 1 + 4 (the causal VAE encodes the first frame alone, then
#: chunks of 4, with the same weights: a 9-frame clip is the same computation, one chunk longer)
VAE_WINDOW = 5
#: the tiny Wan transformer trained by config.yaml (4 blocks of width 128)
WAN_CONFIG: dict[str, Any] = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 64,
    "ffn_dim": 512,
    "num_layers": 4,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
WORDS = ("a", "moving", *(str(d) for d in range(10)), *md.DIRECTIONS)
SPECIALS = ("<pad>", "</s>", "<unk>")
#: the digit's pixels weigh this much more than the background in the VAE's reconstruction loss
FOREGROUND_WEIGHT = 4.0
KL_WEIGHT = 1e-4


def to_video(frames: np.ndarray[Any, Any]) -> torch.Tensor:
    """uint8 ``[B, T, H, W, 3]`` -> float ``[B, 3, T, H, W]`` in [-1, 1] (the VAE's input)."""
    return torch.from_numpy(frames).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def train_vae(clips: np.ndarray[Any, Any], steps: int, batch: int, seed: int, lr: float = 3e-3) -> Any:
    """A tiny ``AutoencoderKLWan`` trained on random :data:`VAE_WINDOW`-frame windows of ``clips`` (uint8
    ``[N, T, H, W, 3]``) to reconstruct them from the latent mean (the only latent the store holds and the
    sampler decodes), with a small KL term that keeps the latents near unit scale; returns it in eval mode,
    with the reconstruction loss of the first and last 10 steps as ``mm_losses``."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae: Any = AutoencoderKLWan(**VAE_CONFIG)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / max(steps, 1)))
    )
    rng = np.random.default_rng(seed)
    losses = []
    vae.train()
    for step in range(steps):
        start = int(rng.integers(0, clips.shape[1] - VAE_WINDOW + 1))
        x = to_video(clips[rng.integers(0, len(clips), batch)][:, start : start + VAE_WINDOW])
        dist = vae.encode(x).latent_dist
        y = vae.decode(dist.mean).sample
        weight = 1.0 + FOREGROUND_WEIGHT * (x > -0.99).float()
        recon = (weight * (y - x) ** 2).mean()
        kl = 0.5 * (dist.mean**2 + dist.var - 1.0 - dist.logvar).mean()
        loss = recon + KL_WEIGHT * kl
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(recon.detach()))
        if step % 100 == 0 or step == steps - 1:
            print(
                f"vae step {step + 1}/{steps}: reconstruction {losses[-1]:.4f}, kl {float(kl.detach()):.3f}",
                flush=True,
            )
    vae.eval()
    head, tail = losses[: min(10, steps)], losses[-min(10, steps) :]
    vae.mm_losses = (sum(head) / len(head), sum(tail) / len(tail))
    return vae


@torch.no_grad()
def set_latent_scale(vae: Any, clips: np.ndarray[Any, Any], batch: int = 32) -> None:
    """``latents_mean`` / ``latents_std``: per-channel statistics of the latent means of ``clips``."""
    means = torch.cat(
        [vae.encode(to_video(clips[i : i + batch])).latent_dist.mean for i in range(0, len(clips), batch)]
    )
    mean = means.mean(dim=(0, 2, 3, 4))
    std = means.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())


def write_text_encoder(out: Path, seed: int) -> None:
    """``tokenizer/`` (word level over :data:`WORDS`) and a random tiny ``text_encoder/`` (UMT5)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.models.umt5 import UMT5Config, UMT5EncoderModel

    vocab = {word: i for i, word in enumerate((*SPECIALS, *WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", vocab["</s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )
    tokenizer.save_pretrained(out / "tokenizer")
    config = UMT5Config(
        vocab_size=len(vocab),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["</s>"],
        decoder_start_token_id=vocab["<pad>"],
    )
    torch.manual_seed(seed)
    UMT5EncoderModel(config).save_pretrained(out / "text_encoder")


@torch.no_grad()
def check_vae(
    vae: Any, clips: np.ndarray[Any, Any], captions: list[str], classifier: Any
) -> dict[str, float]:
    """How well the VAE reconstructs ``clips`` (latent mean in, decoded out): MSE in [-1, 1] and the judge's
    scores on the reconstructions and on the originals."""
    x = to_video(clips)
    latents = vae.encode(x).latent_dist.mean
    y = vae.decode(latents).sample.clamp(-1, 1)
    recon = [((v + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy() for v in y]
    scores = md.judge(classifier, recon, captions)
    original = md.judge(classifier, list(clips), captions)
    return {
        "mse": float(((y - x) ** 2).mean()),
        "digit_frame_accuracy": scores["digit_frame_accuracy"],
        "direction_accuracy": scores["direction_accuracy"],
        "original_digit_frame_accuracy": original["digit_frame_accuracy"],
    }


def build(
    out: Path,
    per_image: int = 2,
    vae_steps: int = 900,
    vae_batch: int = 16,
    seed: int = 0,
    max_images: int | None = None,
) -> Path:
    """Write every asset under ``out`` (module docstring); ``max_images`` limits the training images
    (tests)."""
    from mm_data_video import Clip, encode_clips

    start = time.time()
    images, labels = md.load_digit_images()
    train_ids, test_ids = md.split_images(len(images), seed)
    if max_images is not None:
        train_ids, test_ids = train_ids[:max_images], test_ids[: max(2, max_images // 4)]
    specs = md.clip_specs(train_ids, labels, per_image, seed, held_out=False)
    clips = np.stack([md.render(images[s.image], s.direction, s.offset) for s in specs])
    print(f"{len(specs)} training clips of {md.FRAMES}×{md.CANVAS}×{md.CANVAS}", flush=True)

    vae = train_vae(clips, vae_steps, vae_batch, seed)
    set_latent_scale(vae, clips[:512])
    out.mkdir(parents=True, exist_ok=True)
    vae.save_pretrained(out / "vae")
    classifier = md.train_classifier(images[train_ids], labels[train_ids])
    check_specs = md.clip_specs(test_ids[:64], labels, 1, seed + 1, held_out=True)
    check = check_vae(
        vae,
        np.stack([md.render(images[s.image], s.direction, s.offset) for s in check_specs]),
        [s.caption for s in check_specs],
        classifier,
    )
    print(f"VAE on {len(check_specs)} held-out clips: {json.dumps(check)}", flush=True)

    write_text_encoder(out, seed)
    encode_clips(
        (Clip(f"clip{i:05d}", frames, s.caption) for i, (s, frames) in enumerate(zip(specs, clips))),
        out / "store",
        vae=vae,
        encode_text=md.load_text_encoder(out),
    )
    (out / "model").mkdir(exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(WAN_CONFIG, indent=2) + "\n", encoding="utf-8")

    store_bytes = sum(p.stat().st_size for p in (out / "store").rglob("*") if p.is_file())
    info = {
        "seed": seed,
        "training_clips": len(specs),
        "training_images": len(train_ids),
        "held_out_images": len(test_ids),
        "training_captions": sorted({s.caption for s in specs}),
        "held_out_captions": [md.caption(d, w) for d, w in md.HELD_OUT_PAIRS],
        "store_bytes": store_bytes,
        "vae_parameters": sum(p.numel() for p in vae.parameters()),
        "vae_steps": vae_steps,
        "vae_reconstruction_loss": {"first_10_steps": vae.mm_losses[0], "last_10_steps": vae.mm_losses[1]},
        "vae_check_on_held_out_clips": check,
        "seconds": round(time.time() - start, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in info.items() if "captions" not in k}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=HERE / "build")
    parser.add_argument("--per-image", type=int, default=2, help="training clips per training image")
    parser.add_argument("--vae-steps", type=int, default=900)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    build(args.out, args.per_image, args.vae_steps, args.vae_batch, args.seed)


if __name__ == "__main__":
    main()
