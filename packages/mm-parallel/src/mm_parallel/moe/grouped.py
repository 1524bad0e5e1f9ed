"""Expert MLPs on rows grouped by expert: one grouped matrix product per projection where the backend has
one, a loop of plain matrix products otherwise; same result.

The grouped product is the kernel table's own ``grouped_mm`` entry where the table has one for the device
type (:func:`fused_grouped_mm`: Ascend's ``npu_grouped_matmul``), else torch's
``torch.nn.functional.grouped_mm`` where it runs (:func:`grouped_mm_supported`: CPU, CUDA). It takes the
group offsets as a device tensor (no host sync); the loop needs the sizes on the host, read once per expert
MLP (:func:`~mm_parallel.memory.read_once`, so not again when the forward is recomputed) unless the caller
has them already."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mm_parallel.kernels import DEFAULT, KERNELS
from mm_parallel.memory.recompute import read_once

GroupedMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``expert_ids`` (any shape, values in ``0 .. num_experts - 1``) go to each expert: a fixed
    ``[num_experts]`` int64 count on the device (``bincount``'s output size depends on the values, which
    costs a host sync on an accelerator; this does not)."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))


def fused_grouped_mm(device_type: str) -> GroupedMm | None:
    """The kernel table's own ``grouped_mm`` entry for ``device_type`` (``"npu"``: ``npu_grouped_matmul``),
    taking ``x [rows, in]``, ``weight [groups, in, out]`` and cumulative offsets; None where the table has
    none for it (CPU, CUDA: :func:`grouped_mm_supported` decides between torch's product and the loop)."""
    return None if device_type == DEFAULT else KERNELS["grouped_mm"].get(device_type)


def use_grouped_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_linear`` takes a grouped product here by default: the table's fused entry for the
    device type (same dtypes), else torch's ``grouped_mm`` where :func:`grouped_mm_supported`."""
    if fused_grouped_mm(x.device.type) is not None:
        return x.dtype == weight.dtype
    return grouped_mm_supported(x, weight)


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``grouped_mm`` can multiply ``x [rows, k]`` by ``weight [groups, n, k]`` (transposed) here.

    It needs rows whose byte strides are multiples of 16; on CUDA it needs bf16 and compute capability 8.0+
    (Ampere or newer); on CPU it takes fp32/bf16. Other devices: False (Ascend has the table's fused
    entry instead, :func:`fused_grouped_mm`).
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
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    *,
    use_grouped_mm: bool | None = None,
    host_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """``out[rows of group g] = x[rows of group g] @ weight[g].T``.

    ``x`` is ``[rows, k]`` with rows sorted by group; ``counts[g]`` rows belong to group ``g`` (zero is fine);
    ``weight`` is ``[groups, n, k]`` (the ``nn.Linear`` layout of each group). ``use_grouped_mm``: True for
    the grouped product (the table's fused entry on a device type that has one, else torch's
    ``grouped_mm``), False for the loop, None to choose (:func:`use_grouped_product`). ``host_counts``: the
    same counts on the host, when the caller has them (the loop reads ``counts`` otherwise; the grouped
    product never needs them).
    """
    if use_grouped_mm is None:
        use_grouped_mm = use_grouped_product(x, weight)
    if use_grouped_mm:
        fused = fused_grouped_mm(x.device.type)
        if fused is not None:  # cumulative offsets on the device: no host sync
            return fused(x, weight.transpose(-2, -1), torch.cumsum(counts, 0))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=offs)
    sizes = list(host_counts) if host_counts is not None else read_once(counts)
    pieces = torch.split(x, sizes, dim=0)
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
    host_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """The gated expert MLP ``down(glu(gate(x), up(x)))`` for rows grouped by expert, with fused weights
    ``gate_up_proj [experts, 2 * inter, hidden]`` (gate rows first) and ``down_proj [experts, hidden,
    inter]`` (transformers' layout). ``glu`` is the gated unit: ``act(gate) * up`` for SwiGLU
    (:meth:`ExpertParallelExperts.glu <mm_parallel.moe.ExpertParallelExperts.glu>`), or a clamped one.
    ``host_counts``: ``counts`` on the host if the caller has them (see :func:`grouped_linear`); without
    them the loop of plain products reads them once for both projections."""
    sizes = host_counts

    def linear(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        nonlocal sizes
        grouped = use_grouped_product(inputs, weight) if use_grouped_mm is None else use_grouped_mm
        if not grouped and sizes is None:
            sizes = read_once(counts)
        return grouped_linear(inputs, weight, counts, use_grouped_mm=grouped, host_counts=sizes)

    gate, up = linear(x, gate_up_proj).chunk(2, dim=-1)
    return linear(glu(gate, up), down_proj)
