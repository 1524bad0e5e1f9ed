"""Expert MLPs on rows grouped by expert: one grouped matrix product per projection where the backend has
one (``torch.nn.functional.grouped_mm``), a loop of plain matrix products otherwise; same result."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``grouped_mm`` can multiply ``x [rows, k]`` by ``weight [groups, n, k]`` (transposed) here.

    It needs rows whose byte strides are multiples of 16; on CUDA it needs bf16 and compute capability 8.0+
    (Ampere or newer); on CPU it takes fp32/bf16. Other devices (e.g. NPU) use the loop.
    """
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    size = x.element_size()
    if (x.shape[-1] * size) % 16 or (weight.shape[-2] * size) % 16:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    return False


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, use_grouped_mm: bool | None = None
) -> torch.Tensor:
    """``out[rows of group g] = x[rows of group g] @ weight[g].T``.

    ``x`` is ``[rows, k]`` with rows sorted by group; ``counts[g]`` rows belong to group ``g`` (zero is fine);
    ``weight`` is ``[groups, n, k]`` (the ``nn.Linear`` layout of each group).
    """
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x, weight)
    if use_grouped_mm:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=offs)
    pieces = torch.split(x, counts.tolist(), dim=0)
    outs = [F.linear(piece, weight[g]) for g, piece in enumerate(pieces)]
    return torch.cat(outs, dim=0) if outs else x.new_zeros((0, weight.shape[-2]))


def expert_mlp(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    counts: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """The gated expert MLP ``down(glu(gate(x), up(x)))`` for rows grouped by expert, with fused weights
    ``gate_up_proj [experts, 2 * inter, hidden]`` (gate rows first) and ``down_proj [experts, hidden,
    inter]`` (transformers' layout). ``glu`` is the gated unit: ``act(gate) * up`` for SwiGLU
    (:meth:`ExpertParallelExperts.glu <mm_parallel.moe.ExpertParallelExperts.glu>`), or a clamped one."""
    gate_up = grouped_linear(x, gate_up_proj, counts, use_grouped_mm=use_grouped_mm)
    gate, up = gate_up.chunk(2, dim=-1)
    return grouped_linear(glu(gate, up), down_proj, counts, use_grouped_mm=use_grouped_mm)
