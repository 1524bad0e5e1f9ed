"""Grouped matrix product of mixture-of-experts layers: rows sorted by expert, one weight per expert.

``x`` ``[tokens, in]`` (the rows of expert ``e`` are ``offsets[e-1]:offsets[e]``), ``weight`` ``[experts, in,
out]`` (a transposed view of ``[experts, out, in]`` is fine), ``offsets`` ``[experts]`` the cumulative row
counts on the tensors' device (the last is ``tokens``; int32 or int64); the result is ``[tokens, out]`` with
``x[rows of e] @ weight[e]``. Every entry is differentiable in ``x`` and ``weight`` and reads nothing back to
the host.

- :func:`grouped_mm`: ``torch._grouped_mm`` (one fused call on CUDA and CPU; the op transformers'
  ``grouped_mm`` experts use).
- :func:`npu_grouped_mm`: ``torch_npu.npu_grouped_matmul`` in the documented single-tensor form ("单单单":
  one ``x``, one 3-D ``weight``, one output; ``split_item=3``), the groups as a device tensor of cumulative
  counts (``group_list_type=0``). The op has no autograd formula of its own in many torch_npu versions, so
  :class:`NpuGroupedMm` supplies the backward with the same op: ``grad_x`` groups the rows (``group_type=0``,
  the weight transposed), ``grad_weight`` groups the shared ``K`` axis (``group_type=2``: ``x`` transposed,
  the output 3-D ``[experts, in, out]``), as torch_npu's op-plugin documentation
  (``docs/context/torch_npu-npu_grouped_matmul.md``) describes both.
- :func:`grouped_mm_reference`: a loop of plain matmuls, the definition the others are tested against.
"""

from __future__ import annotations

from typing import Any

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


def _npu_gmm(a: torch.Tensor, b: torch.Tensor, group_list: torch.Tensor, group_type: int) -> torch.Tensor:
    """One ``npu_grouped_matmul`` call with single tensors in and out, groups as cumulative counts."""
    import torch_npu

    outs = torch_npu.npu_grouped_matmul(
        [a], [b], group_list=group_list, split_item=3, group_type=group_type, group_list_type=0
    )
    out: torch.Tensor = outs[0]
    return out


class NpuGroupedMm(torch.autograd.Function):
    """``x @ weight`` per group through ``npu_grouped_matmul``, forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, group_list)
        # rows grouped (group_type 0): x [tokens, in] untransposed, weight [experts, in, out] (may be a view)
        return _npu_gmm(x, weight, group_list, group_type=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # dx[rows of e] = dy[rows of e] @ weight[e].T: rows grouped again, the weight transposed
            grad_x = _npu_gmm(grad, weight.transpose(-2, -1), group_list, group_type=0)
        if ctx.needs_input_grad[1]:
            # dW[e] = x[rows of e].T @ dy[rows of e]: the token axis is K, grouped (group_type 2); x is passed
            # transposed ([in, tokens], as the op requires), dy untransposed; the output is [experts, in, out]
            grad_weight = _npu_gmm(x.transpose(0, 1), grad, group_list, group_type=2)
        return grad_x, grad_weight, None


def npu_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul (Ascend fused kernel, differentiable through :class:`NpuGroupedMm`)."""
    _check(x, weight, offsets)
    out: torch.Tensor = NpuGroupedMm.apply(x.contiguous(), weight, offsets.to(torch.int64))  # type: ignore[no-untyped-call]
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
