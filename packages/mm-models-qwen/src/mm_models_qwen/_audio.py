"""Qwen3-Omni's audio tower, each clip encoded as if it were alone in the batch.

The tower cuts each clip's mel frames into chunks of ``2 * n_window`` frames (the last one shorter), pads
every chunk of the batch to the batch's longest chunk and runs three stride-2 convolutions over them. In the
padded tensor a convolution has outputs past the end a chunk alone would have (the first of them reads the
chunk's last real frame), and the next convolution reads them where the chunk alone has zero padding: a
short clip's features depend on how long the other clips of its micro-batch are (``micro_batch_size: 2``
and ``1`` × 2 accumulation steps gave different losses for the spoken-digits omni example).

:func:`encode_audio` runs the same modules and the same computation, except that after each convolution the
frames beyond the length the chunk would be padded to if its clip were encoded alone (its clip's longest
chunk: the full chunk length for a clip of several chunks, the chunk's own length for a one-chunk clip)
are set to zero, as the convolution's own zero padding makes them then. Every clip's features are those of
the tower run on that clip alone, whatever else the micro-batch holds."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def _own_padded_lengths(lengths: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per chunk of the batch: the length it is padded to when its clip is encoded alone."""
    chunks = torch.div(lengths + chunk - 1, chunk, rounding_mode="floor")
    alone = torch.where(chunks > 1, torch.full_like(lengths, chunk), lengths)
    return torch.repeat_interleave(alone, chunks)


def encode_audio(
    tower: Any, input_features: torch.Tensor, feature_attention_mask: torch.Tensor
) -> torch.Tensor:
    """The rows the audio tower ``tower`` (Qwen3-Omni's ``model.audio_tower``, output projection included)
    gives for ``input_features`` [clips, mels, frames] with ``feature_attention_mask`` [clips, frames], each
    clip as if encoded alone (module docstring); [audio tokens of all clips, hidden]."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        chunk_and_pad_features,
        get_audio_cu_seqlens,
        get_max_seqlen,
        get_valid_indices,
    )

    lengths = feature_attention_mask.sum(-1).to(torch.long)
    frames = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)
    padded, chunk_lengths = chunk_and_pad_features(frames, lengths, tower.n_window)
    valid_indices = get_valid_indices(chunk_lengths, tower.n_window)
    cu_seqlens = get_audio_cu_seqlens(chunk_lengths, lengths, tower.n_window_infer, tower.n_window)
    max_seqlen = get_max_seqlen(cu_seqlens, tower.config)
    limits = _own_padded_lengths(lengths, 2 * tower.n_window)

    padded = padded.unsqueeze(1).to(dtype=tower.conv2d1.weight.dtype)
    embeds = []
    for part, limit in zip(
        padded.split(tower.conv_chunksize, dim=0), limits.split(tower.conv_chunksize, dim=0), strict=True
    ):
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):
            part = F.gelu(conv(part))
            limit = torch.div(limit - 1, 2, rounding_mode="floor") + 1
            keep = torch.arange(part.shape[-1], device=part.device) < limit.unsqueeze(1)
            part = part * keep[:, None, None, :].to(part.dtype)
        embeds.append(part)
    embed = torch.cat(embeds, dim=0)
    b, c, f, t = embed.size()
    embed = tower.conv_out(embed.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
    embed = embed + tower.positional_embedding.positional_embedding[:t, :].unsqueeze(0).to(embed.dtype)
    hidden = torch.index_select(embed.reshape(-1, embed.shape[-1]), 0, valid_indices)
    for layer in tower.layers:
        hidden = layer(hidden, cu_seqlens, max_seqlen=max_seqlen)[0]
    hidden = tower.ln_post(hidden)
    result: torch.Tensor = tower.proj2(tower.act(tower.proj1(hidden)))
    return result
