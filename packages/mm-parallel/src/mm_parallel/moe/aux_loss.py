"""The router load-balancing loss (Switch Transformer, as transformers computes it) over a global batch.

For router logits of all MoE layers, with ``m`` the row mask (1 for a real token, 0 for padding), ``E``
experts and top-``k`` routing::

    f_e = sum over layers and rows of m * [e in top-k of the row] / R      (R = sum over layers and rows of m)
    P_e = sum over layers and rows of m * softmax(logits)_e / R
    aux = E * sum_e f_e * P_e

This is transformers' ``load_balancing_loss_func``. It is not linear in the batch, so averaging per-rank
values would not give the loss of the whole micro-batch. Here the sums behind ``f``, ``P`` and ``R`` are
reduced over ``group`` (the data- and context-parallel ranks of one micro-step), so every layout computes
the value one process computes on the whole micro-batch, and each rank back-propagates exactly its share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    row_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(share, value)``: ``value`` is the global auxiliary loss (no gradient, the same on every
    rank of ``group``); ``share`` carries this rank's gradient and sums over the ranks of ``group`` to
    ``value``.

    ``router_logits`` holds one ``[rows, num_experts]`` tensor per MoE layer; ``row_mask`` (``[rows]`` or
    any shape with ``rows`` elements) weights rows (None: every row counts). ``group`` None with no process
    group initialised means one process.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
    rows = torch.zeros((), dtype=torch.float64, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    mask = None if row_mask is None else row_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        if mask is None:
            # a fixed-size count (bincount's output size depends on the values: a host sync on a device)
            ones = torch.ones_like(selected, dtype=counts.dtype)
            counts += torch.zeros_like(counts).scatter_add_(0, selected, ones)
            prob_sum = prob_sum + probs.sum(dim=0)
            rows += probs.shape[0]
        else:
            if mask.numel() != probs.shape[0]:
                raise ValueError(f"row_mask has {mask.numel()} elements for {probs.shape[0]} router rows")
            weights = mask.double().repeat_interleave(top_k)
            counts += torch.zeros_like(counts).scatter_add_(0, selected, weights)
            prob_sum = prob_sum + (probs * mask[:, None]).sum(dim=0)
            rows += mask.double().sum()
    stats = torch.cat([counts, rows.view(1), prob_sum.detach().double()])
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(stats, group=group)
    g_counts, g_prob = stats[:num_experts], stats[num_experts + 1 :]
    g_rows = stats[num_experts].clamp(min=1.0)
    fraction = (g_counts / g_rows).float()
    share = num_experts * (fraction * prob_sum).sum() / g_rows.float()
    value = num_experts * (g_counts / g_rows * g_prob / g_rows).sum()
    return share, value.float()
