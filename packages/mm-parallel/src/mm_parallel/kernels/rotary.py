"""Rotary position embedding applied to one tensor: ``x * cos + rotate_half(x) * sin``.

``cos``/``sin`` broadcast against ``x`` (e.g. ``x`` ``[batch, heads, seq, dim]`` and ``cos`` ``[batch, 1, seq,
dim]``), the "rotate half" convention of the Hugging Face decoders (first and second halves of the head dim
paired). :func:`rotary` is that formula in torch (the same operations, in the same order, as transformers'
``apply_rotary_pos_emb``); :func:`npu_rotary` is ``torch_npu.npu_rotary_mul(input, r1, r2,
rotary_mode='half')``, Ascend's fused kernel documented as the same formula (``r1 * x + r2 * cat(-x2, x1)``)
for 4-D tensors, ``r1``/``r2`` broadcast as ``11SD``/``B1SD``/``BNSD`` for an input ``[batch, heads, seq,
dim]``.

Where it is used: nowhere in mm's model code today. transformers' models apply the rotary embedding inside
their attention code (``apply_rotary_pos_emb``), whose only extension point is the ``kernels`` hub package;
mm does not patch transformers. The one rotary mm writes itself (CosyVoice's DiT) turns adjacent channel
pairs of part of the head in fp32, another convention. The entry serves code that calls it explicitly.
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
