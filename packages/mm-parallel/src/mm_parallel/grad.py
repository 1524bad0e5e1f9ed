"""Gradient-norm clipping that is correct for DTensor gradients on any number of meshes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement

# (mesh id, placements, device): gradients that can be reduced and scaled together
_GroupKey = tuple[int | None, tuple[Placement, ...], torch.device]


def _group_key(t: torch.Tensor) -> _GroupKey:
    if isinstance(t, DTensor):
        return (id(t.device_mesh), tuple(t.placements), t.device)
    return (None, (), t.device)


@torch.no_grad()
def total_grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm over all ``params`` (sharded, replicated or plain), as a plain tensor.

    Gradients are grouped by mesh and placements so that each group reduces over its own mesh; the group
    norms are then combined. Every rank gets the same value.
    """
    groups: dict[_GroupKey, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[_group_key(p.grad)].append(p.grad)
    norm_type = float(norm_type)
    parts: list[torch.Tensor] = []
    for grads in groups.values():
        # CPU reductions of long fp32 vectors drift by ~1e-5 relative, enough to make the same gradients
        # report different norms under different shardings: accumulate in fp64 there.
        acc = torch.float64 if grads[0].device.type == "cpu" else torch.float32
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in grads]
        norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        parts.append(norm.float())
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    stacked = torch.stack([p.to(device) for p in parts])
    if norm_type == float("inf"):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float | None,
    norm_type: float = 2.0,
    *,
    scale_only: Callable[[nn.Parameter], bool] | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    ``max_norm`` of ``None`` or ``0`` only measures the norm. The norm is always over every gradient of
    ``params``; with ``scale_only`` only the gradients of the parameters it accepts are scaled (an
    optimizer's clipping policy, e.g. Muon leaving its orthogonalised matrices alone).
    """
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    if max_norm:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        groups: dict[_GroupKey, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None and (scale_only is None or scale_only(p)):
                groups[_group_key(p.grad)].append(p.grad)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
