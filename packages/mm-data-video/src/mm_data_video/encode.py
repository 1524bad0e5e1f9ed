"""Encode raw clips and captions once, with a frozen VAE and a frozen text encoder, into a latent store.

Training a video diffusion transformer never runs the VAE or the text encoder: :func:`encode_clips` turns
every clip into normalised VAE latents and every caption into text embeddings, written as ``.npy`` files
with an ``index.jsonl`` (layout: :mod:`mm_data_video.store`) that the ``video_latents`` dataset memory-maps.

- **VAE**: any diffusers video autoencoder with ``encode(video).latent_dist`` (``AutoencoderKLWan`` for
  Wan2.1/2.2). A clip of ``T`` frames of ``H × W`` becomes ``[C, 1 + (T − 1) / t, H / s, W / s]`` latents
  (``t``, ``s``: the VAE's ``scale_factor_temporal`` / ``scale_factor_spatial``; ``T − 1`` and ``H``, ``W``
  must be multiples of them). The latent distribution's mean is stored, normalised with the VAE config's
  ``latents_mean`` / ``latents_std`` when it has them (Wan's pipeline undoes exactly this before decoding).
- **Text**: ``encode_text(captions) -> [tensor [L_i, D] per caption]``, the embeddings of each caption's real
  tokens. :func:`t5_text_encoder` builds it from a tokenizer and a T5/UMT5 encoder as Wan's pipeline encodes
  prompts (``max_length`` tokens, truncated; the trailing padding is cut here and zero-padded again by the
  dataset).

Both run under ``torch.no_grad()`` in eval mode; neither is ever part of the trained model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mm_core.errors import DataError

from .store import StoreWriter

#: ``captions -> one [L_i, D] tensor per caption``
TextEncoder = Callable[[list[str]], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Clip:
    """A raw clip: ``frames`` uint8 ``[T, H, W, 3]`` (as video decoders return them) or float ``[3, T, H, W]``
    in [-1, 1]; ``id`` names its files (letters, digits, ``._-``)."""

    id: str
    frames: np.ndarray[Any, Any] | torch.Tensor
    caption: str


def _video_tensor(clip: Clip) -> torch.Tensor:
    """``[3, T, H, W]`` float32 in [-1, 1]."""
    frames = clip.frames
    t = torch.as_tensor(np.asarray(frames)) if isinstance(frames, np.ndarray) else frames
    if t.dtype == torch.uint8:
        if t.dim() != 4 or t.shape[-1] != 3:
            raise DataError(f"clip {clip.id!r}: uint8 frames must be [T, H, W, 3], got {list(t.shape)}")
        return t.permute(3, 0, 1, 2).float() / 127.5 - 1.0
    if not t.is_floating_point() or t.dim() != 4 or t.shape[0] != 3:
        raise DataError(
            f"clip {clip.id!r}: frames must be uint8 [T, H, W, 3] or float [3, T, H, W] in [-1, 1], got "
            f"{t.dtype} {list(t.shape)}"
        )
    return t.float()


def _scale_factors(vae: nn.Module) -> tuple[int, int]:
    config: Any = getattr(vae, "config", None)
    temporal = getattr(config, "scale_factor_temporal", None)
    spatial = getattr(config, "scale_factor_spatial", None)
    if temporal is None or spatial is None:
        raise DataError(
            f"{type(vae).__name__}: its config has no scale_factor_temporal / scale_factor_spatial; "
            "encode_clips needs a diffusers video autoencoder such as AutoencoderKLWan"
        )
    return int(temporal), int(spatial)


def _normaliser(vae: nn.Module, channels: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    config: Any = getattr(vae, "config", None)
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is None or std is None:
        return None
    if len(mean) != channels or len(std) != channels:
        raise DataError(
            f"{type(vae).__name__}: latents_mean/latents_std have {len(mean)}/{len(std)} entries for "
            f"{channels} latent channels"
        )
    view = (channels, 1, 1, 1)
    return torch.tensor(mean, dtype=torch.float32).view(view), torch.tensor(std, dtype=torch.float32).view(
        view
    )


@torch.no_grad()
def encode_video(vae: nn.Module, clip: Clip, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised latents ``[C, F, H, W]`` (float32, CPU) of one clip (module docstring)."""
    temporal, spatial = _scale_factors(vae)
    video = _video_tensor(clip)
    _, frames, height, width = video.shape
    if (frames - 1) % temporal or height % spatial or width % spatial:
        raise DataError(
            f"clip {clip.id!r}: {frames} frames of {height}×{width}; the VAE needs 1 + a multiple of "
            f"{temporal} frames and sides that are multiples of {spatial}"
        )
    dtype = next(vae.parameters()).dtype
    encode: Any = vae.encode
    dist = encode(video[None].to(device=device, dtype=dtype)).latent_dist
    latents = dist.mean[0].float().cpu()
    norm = _normaliser(vae, latents.shape[0])
    if norm is not None:
        latents = (latents - norm[0]) / norm[1]
    return latents


def t5_text_encoder(
    tokenizer: Any, text_encoder: nn.Module, max_length: int = 512, device: torch.device | str = "cpu"
) -> TextEncoder:
    """``encode_text`` for a T5/UMT5 encoder (Wan's): tokens padded and truncated to ``max_length``, the
    encoder's last hidden state, cut to each caption's real tokens."""

    @torch.no_grad()
    def encode(captions: list[str]) -> list[torch.Tensor]:
        tokens = tokenizer(
            captions,
            padding="max_length",
            max_length=max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = text_encoder(ids, attention_mask=mask).last_hidden_state.float().cpu()
        lengths = mask.sum(dim=1).tolist()
        return [h[: int(n)] for h, n in zip(hidden, lengths)]

    return encode


def encode_clips(
    clips: Iterable[Clip],
    out_dir: str | Path,
    *,
    vae: nn.Module,
    encode_text: TextEncoder,
    device: torch.device | str = "cpu",
    text_batch_size: int = 16,
) -> Path:
    """Encode ``clips`` into a new latent store at ``out_dir`` (it must not hold one yet); returns the path of
    its ``index.jsonl``, written last (a store is complete once it exists)."""
    writer = StoreWriter(out_dir)
    vae.eval()
    temporal, spatial = _scale_factors(vae)
    pending: list[tuple[Clip, torch.Tensor]] = []
    channels: int | None = None

    def flush() -> None:
        if not pending:
            return
        embeddings = encode_text([c.caption for c, _ in pending])
        if len(embeddings) != len(pending):
            raise DataError(f"encode_text returned {len(embeddings)} embeddings for {len(pending)} captions")
        for (clip, latents), emb in zip(pending, embeddings):
            if emb.dim() != 2 or emb.shape[0] == 0:
                raise DataError(
                    f"clip {clip.id!r}: encode_text gave {list(emb.shape)}; expected [tokens, dim]"
                )
            writer.add(clip.id, clip.caption, latents, emb)
        pending.clear()

    for clip in clips:
        writer.check_id(clip.id)
        if any(c.id == clip.id for c, _ in pending):
            raise DataError(f"clip id {clip.id!r} is used twice")
        latents = encode_video(vae, clip, device)
        channels = channels or int(latents.shape[0])
        pending.append((clip, latents))
        if len(pending) >= text_batch_size:
            flush()
    flush()
    meta = {
        "vae": type(vae).__name__,
        "scale_factor_temporal": temporal,
        "scale_factor_spatial": spatial,
        "normalised": _normaliser(vae, channels or 0) is not None,
    }
    return writer.finish(meta)
