"""Rotary position embedding applied to one tensor: ``x * cos + rotate_half(x) * sin``.

``cos``/``sin`` broadcast against ``x`` (e.g. ``x`` ``[batch, heads, seq, dim]`` and ``cos`` ``[batch, 1, seq,
dim]``), the "rotate half" convention of the Hugging Face decoders (first and second halves of the head dim
paired). :func:`rotary` is that formula in torch (the same operations, in the same order, as transformers'
``apply_rotary_pos_emb``); :func:`npu_rotary` is ``torch_npu.npu_rotary_mul(x, cos, sin)``, Ascend's fused
kernel for the same formula.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split along the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (torch)."""
    return (x * cos) + (rotate_half(x) * sin)


def npu_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (Ascend fused kernel; 4-D ``x``, ``cos``/``sin`` broadcast to it)."""
    import torch_npu

    out: torch.Tensor = torch_npu.npu_rotary_mul(x, cos.to(x.dtype), sin.to(x.dtype))
    return out
