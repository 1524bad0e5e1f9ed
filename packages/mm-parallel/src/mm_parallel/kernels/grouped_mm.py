"""Grouped matrix product of mixture-of-experts layers: rows sorted by expert, one weight per expert.

``x`` ``[tokens, in]`` (the rows of expert ``e`` are ``offsets[e-1]:offsets[e]``), ``weight`` ``[experts, in,
out]``, ``offsets`` int32 ``[experts]`` the cumulative row counts (the last is ``tokens``); the result is
``[tokens, out]`` with ``x[rows of e] @ weight[e]``.

- :func:`grouped_mm`: ``torch._grouped_mm`` (one fused call on CUDA and CPU; the op transformers'
  ``grouped_mm`` experts use).
- :func:`npu_grouped_mm`: ``torch_npu.npu_grouped_matmul([x], [weight], group_list=offsets, group_type=0,
  split_item=3)`` (rows split into groups, one output tensor; ``group_list_type=0``: cumulative counts).
- :func:`grouped_mm_reference`: a loop of plain matmuls, the definition the others are tested against.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or offsets.dim() != 1 or offsets.shape[0] != weight.shape[0]:
        raise ValueError(
            "grouped_mm takes x [tokens, in], weight [experts, in, out] and offsets [experts]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(offsets.shape)}"
        )


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul (torch's fused ``_grouped_mm``; its rows must be 16-byte aligned, else the loop)."""
    _check(x, weight, offsets)
    if any(t.shape[-1] * t.element_size() % 16 for t in (x, weight)):
        return grouped_mm_reference(x, weight, offsets)
    return torch._grouped_mm(x, weight, offs=offsets.to(torch.int32))


def npu_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul (Ascend fused kernel)."""
    import torch_npu

    _check(x, weight, offsets)
    outs = torch_npu.npu_grouped_matmul(
        [x], [weight], group_list=offsets.to(torch.int64), split_item=3, group_type=0, group_list_type=0
    )
    out: torch.Tensor = outs[0]
    return out


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul as one plain matmul per expert (the definition)."""
    _check(x, weight, offsets)
    out = x.new_zeros(x.shape[0], weight.shape[-1])
    start = 0
    for e, stop in enumerate(offsets.tolist()):
        out[start:stop] = x[start:stop] @ weight[e]
        start = stop
    return out
