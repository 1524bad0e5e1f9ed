"""The DiT estimator of CosyVoice3's flow-matching acoustic model: a velocity field over log-mel frames.

The estimator sees, per frame, the noisy mel ``x_t``, the prompt-mel condition ``cond`` (zeros outside the
prompt), the token features ``mu`` and the speaker vector ``spk`` (the same on every frame), and the flow
time ``t``; it predicts the velocity ``dx/dt``. Layers, in the official names (``decoder.estimator.*``):

- ``time_embed``: sinusoidal features of ``1000 t`` (256 wide: ``[sin, cos]`` of ``1000 t · f_k``,
  ``f_k = 10000^(−k / 127)``), then ``time_mlp`` = Linear, SiLU, Linear;
- ``input_embed``: ``proj`` (Linear over the concatenation ``[x_t, cond, mu, spk]``) plus a causal
  convolutional position embedding (``conv_pos_embed``: twice [left-pad 30, grouped Conv1d k31 g16, Mish]),
  added to its input;
- ``rotary_embed``: the rotary frequencies (``inv_freq``, a stored buffer);
- ``transformer_blocks``: pre-norm blocks with adaptive layer norm (``attn_norm.linear`` maps SiLU(t) to
  shift, scale and gate of the attention and of the feed-forward, in that order), multi-head self-attention
  (``to_q/to_k/to_v``, ``to_out.0``) and a GELU(tanh) feed-forward (``ff.ff.0.0``, ``ff.ff.2``);
- ``norm_out`` (adaptive, ``linear`` gives scale then shift) and ``proj_out``.

**The rotary quirk** (kept for weight compatibility): the rotation is applied to the full-width query and key
projections before they are split into heads, with a table ``dim_head`` wide, so only the first head's
channels are rotated (adjacent pairs ``(2j, 2j + 1)`` by ``position × 10000^(−2j / dim_head)``); the other
heads carry no position but the convolutional embedding's.

**Masks.** Keys are limited to the sample's frames; padded query rows output zeros. With ``streaming`` (per
sample) the attention is also block-causal over chunks of ``static_chunk_size`` frames: a frame sees every
frame of its own chunk and the chunks before it (the official unified streaming/offline training). Every
layer is per frame or causal in time, so a sample's output does not depend on how much padding its batch
adds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: width of the sinusoidal time features
TIME_FEATURES = 256
#: LayerNorm epsilon of the adaptive norms
NORM_EPS = 1e-6


def timestep_features(t: torch.Tensor, width: int = TIME_FEATURES, scale: float = 1000.0) -> torch.Tensor:
    """``[B] -> [B, width]``: ``[sin(scale·t·f), cos(scale·t·f)]``, ``f_k = 10000^(−k / (width/2 − 1))``."""
    half = width // 2
    k = torch.arange(half, device=t.device, dtype=torch.float32)
    freqs = torch.exp(-math.log(10000.0) * k / (half - 1))
    args = scale * t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FEATURES, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        dtype = next(self.time_mlp.parameters()).dtype
        out: torch.Tensor = self.time_mlp(timestep_features(t).to(dtype))
        return out


class CausalConvPositionEmbedding(nn.Module):
    """Two causal grouped convolutions with Mish, over time (``[B, N, D] -> [B, N, D]``)."""

    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (self.kernel_size - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel_size - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, in_dim: int, dim: int, kernel_size: int, groups: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim, kernel_size, groups)

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spk: torch.Tensor
    ) -> torch.Tensor:
        spk_frames = spk.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat([x, cond, mu, spk_frames], dim=-1))
        out: torch.Tensor = h + self.conv_pos_embed(h)
        return out


class RotaryEmbedding(nn.Module):
    """Rotary frequencies ``10000^(−2j / dim)``, ``j < dim / 2`` (stored: the official file has them)."""

    inv_freq: torch.Tensor

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", self.frequencies())

    def frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        return 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)
        )

    def angles(self, length: int, device: torch.device) -> torch.Tensor:
        """``[length, dim]``: the angle of each channel, equal within a rotated pair."""
        pos = torch.arange(length, device=device, dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq.to(device=device, dtype=torch.float32)[None, :]
        return angles.repeat_interleave(2, dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``angles.shape[-1]`` channels of ``x`` [B, N, C] in adjacent pairs; the rest pass."""
    width = angles.shape[-1]
    rot, rest = x[..., :width].float(), x[..., width:]
    pairs = rot.unflatten(-1, (-1, 2))
    turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    out = rot * angles.cos() + turned * angles.sin()
    return torch.cat([out.to(x.dtype), rest], dim=-1)


class AdaLayerNormZero(nn.Module):
    """``linear(SiLU(t))`` -> shift, scale, gate for the attention and for the feed-forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(c.unsqueeze(1) for c in self.linear(F.silu(t)).chunk(6, dim=-1))


class AdaLayerNormZeroFinal(nn.Module):
    """The output norm: ``linear(SiLU(t))`` -> scale, shift (in that order)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(t)).chunk(2, dim=-1)
        normed = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)
        return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.dim_head = heads, dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(dropout))

    def forward(
        self, x: torch.Tensor, frames: torch.Tensor, attn_mask: torch.Tensor, angles: torch.Tensor
    ) -> torch.Tensor:
        """``x`` [B, N, D]; ``frames`` [B, N] bool (real frames); ``attn_mask`` [B, 1, N, N] bool."""
        q = apply_rotary(self.to_q(x), angles)
        k = apply_rotary(self.to_k(x), angles)
        v = self.to_v(x)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = self.to_out(out.transpose(1, 2).reshape(b, n, -1))
        return out.masked_fill(~frames.unsqueeze(-1), 0.0)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int, dropout: float) -> None:
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Dropout(dropout),
            nn.Linear(inner, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ff(x)
        return out


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head, dropout)
        self.ff = FeedForward(dim, ff_mult, dropout)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        frames: torch.Tensor,
        attn_mask: torch.Tensor,
        angles: torch.Tensor,
    ) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.attn_norm(t)
        normed = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(normed, frames, attn_mask, angles)
        normed = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * (1 + scale2) + shift2
        return x + gate2 * self.ff(normed)


def attention_mask(frames: torch.Tensor, streaming: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, 1, N, N]`` bool: keys among the sample's frames; for streaming samples also only keys before
    the end of the query's chunk of ``chunk`` frames. A row without any key (an empty sample) sees all."""
    n = frames.shape[1]
    mask = frames[:, None, None, :].expand(-1, 1, n, -1)
    if chunk > 0 and bool(streaming.any()):
        pos = torch.arange(n, device=frames.device)
        visible = pos[None, :] < ((pos[:, None] // chunk) + 1) * chunk  # [N(query), N(key)]
        causal = torch.where(
            streaming[:, None, None, None], visible[None, None], torch.ones_like(visible)[None, None]
        )
        mask = mask & causal
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


class DiT(nn.Module):
    """The estimator (module docstring). ``forward(x, frames, mu, t, spk, cond, streaming)`` with ``x``,
    ``mu``, ``cond`` [B, N, mel_dim], ``spk`` [B, mel_dim], ``t`` [B], ``frames`` [B, N] bool, ``streaming``
    [B] bool -> velocity [B, N, out_channels]."""

    def __init__(
        self,
        *,
        dim: int,
        depth: int,
        heads: int,
        dim_head: int,
        ff_mult: int,
        dropout: float,
        mel_dim: int,
        out_channels: int,
        conv_pos_kernel: int,
        conv_pos_groups: int,
        static_chunk_size: int,
    ) -> None:
        super().__init__()
        self.static_chunk_size = static_chunk_size
        self.time_embed = TimestepEmbedding(dim)
        self.input_embed = InputEmbedding(4 * mel_dim, dim, conv_pos_kernel, conv_pos_groups)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList(
            [DiTBlock(dim, heads, dim_head, ff_mult, dropout) for _ in range(depth)]
        )
        self.norm_out = AdaLayerNormZeroFinal(dim)
        self.proj_out = nn.Linear(dim, out_channels)

    def forward(
        self,
        x: torch.Tensor,
        frames: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spk: torch.Tensor,
        cond: torch.Tensor,
        streaming: torch.Tensor,
    ) -> torch.Tensor:
        temb = self.time_embed(t)
        h = self.input_embed(x, cond, mu, spk)
        mask = attention_mask(frames, streaming, self.static_chunk_size)
        angles = self.rotary_embed.angles(h.shape[1], h.device)
        for block in self.transformer_blocks:
            h = block(h, temb, frames, mask, angles)
        out: torch.Tensor = self.proj_out(self.norm_out(h, temb))
        return out
