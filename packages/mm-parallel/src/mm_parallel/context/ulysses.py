"""Ulysses sequence parallelism: an all-to-all turns "all heads of 1/U of the sequence" into "1/U of the
heads of the whole sequence" before attention, and the inverse all-to-all turns the output back.

Grouped-query attention: key/value heads are split over the Ulysses ranks like query heads; when their
number is not a multiple of the Ulysses size they are first repeated just enough
(``U / gcd(kv_heads, U)`` times) that each rank gets whole key/value heads matching its query heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 with equal splits; its gradient is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``[batch, heads, len, dim]`` (my sequence slice) -> ``[batch, heads/size, size*len, dim]`` (my heads,
    the slices of every Ulysses rank in rank order)."""
    b, h, s, d = x.shape
    x = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)
    # [source rank, b, h/size, s, d]; Function.apply is unannotated
    x = _AllToAll.apply(x, group)  # type: ignore[no-untyped-call]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`."""
    b, hs, n, d = x.shape
    s = n // size
    x = x.reshape(b, hs, size, s, d).permute(2, 0, 1, 3, 4)
    # [head group, b, h/size, s, d]; Function.apply is unannotated
    x = _AllToAll.apply(x, group)  # type: ignore[no-untyped-call]
    return x.permute(1, 0, 2, 3, 4).reshape(b, size * hs, s, d)


def kv_repeats(q_heads: int, kv_heads: int, size: int) -> int:
    """How many times each key/value head must be repeated so the heads split evenly over ``size`` ranks."""
    if q_heads % size:
        raise ValueError(
            f"Ulysses size {size} must divide the number of attention heads {q_heads} "
            f"(accepted sizes: {', '.join(str(d) for d in range(1, q_heads + 1) if q_heads % d == 0)})"
        )
    return size // math.gcd(kv_heads, size)
