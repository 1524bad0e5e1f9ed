"""Batched Newton–Schulz orthogonalisation and the Muon learning-rate adjustment."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Defaults of torch.optim.Muon (Keller Jordan's quintic iteration).
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def zeropower_via_newtonschulz(
    matrices: Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalise a batch ``[B, m, n]`` (or one ``[m, n]``) of matrices with the Muon iteration.

    Matches ``torch.optim._muon._zeropower_via_newtonschulz`` except that the Frobenius normalisation
    is done in fp32 and the iteration runs in ``ns_dtype``. Returns a tensor in ``ns_dtype``.
    """
    if ns_steps >= 100:
        raise ValueError(f"ns_steps must be < 100 for computational efficiency, got {ns_steps}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 floats (a, b, c), got {ns_coefficients!r}")
    if matrices.ndim not in (2, 3):
        raise ValueError(f"expected a [m, n] or [B, m, n] tensor, got shape {tuple(matrices.shape)}")
    squeeze = matrices.ndim == 2
    x = matrices.unsqueeze(0) if squeeze else matrices
    a, b, c = ns_coefficients
    tall = x.size(-2) > x.size(-1)
    x32 = x.to(torch.float32)
    if tall:
        x32 = x32.mT
    norms = torch.linalg.vector_norm(x32, dim=(-2, -1), keepdim=True).clamp_(min=eps)
    x = (x32 / norms).to(ns_dtype)
    for _ in range(ns_steps):
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    if tall:
        x = x.mT
    x = x.contiguous()
    return x.squeeze(0) if squeeze else x


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Learning rate for one ``rows x cols`` matrix, as ``torch.optim.Muon`` computes it."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS} or None, got {adjust_lr_fn!r}")
    return lr * ratio


def ns_cost(rows: int, cols: int) -> int:
    """Relative cost of orthogonalising one matrix: ``m * n * min(m, n)`` multiply-adds per iteration."""
    return rows * cols * min(rows, cols)
