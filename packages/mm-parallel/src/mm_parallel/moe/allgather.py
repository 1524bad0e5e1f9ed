"""The all-gather expert dispatcher (``parallel.ep_plan.dispatcher: allgather``).

Every rank of the ``ep`` group receives every rank's tokens (an all-gather), computes the assignments that
fall on its own experts, and the partial outputs are summed back onto the ranks that own the tokens (a
reduce-scatter). Per token the all-to-all dispatcher sends one row per routed expert (``top_k``) and this
one sends one row per ep rank (``ep``), so it moves less when ``ep < top_k`` and more beyond; it replaces
the all-to-all's per-expert count exchange and uneven splits with one scalar all-reduce (the group's
largest token count) and equal chunks.

Ranks may hold different numbers of tokens: each rank's rows are padded to the group's largest count
(padding rows carry expert ``-1`` and are never computed), so both collectives use equal chunks. The two
collectives are each other's backward: the gradient of an all-gather is a reduce-scatter and vice versa.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mm_parallel.memory.recompute import read_once
from mm_parallel.moe.all_to_all import CommTimer
from mm_parallel.moe.grouped import expert_mlp, tokens_per_expert


def _gather(x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    token = timer.start(out.device) if timer is not None else None
    dist.all_gather_single(out, x.contiguous(), group=group)
    if timer is not None:
        timer.stop(token)
    return out


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    token = timer.start(out.device) if timer is not None else None
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    if timer is not None:
        timer.stop(token)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return _gather(x, group, timer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.timer), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return _reduce_scatter(x, group, timer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.timer), None, None


def all_gather_rows(
    x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None = None
) -> torch.Tensor:
    """``[rows, ...]`` on each rank -> ``[ranks * rows, ...]`` (rank order); differentiable (the gradient is
    reduce-scattered back). Every rank must pass the same number of rows."""
    out: torch.Tensor = _AllGather.apply(x, group, timer)  # type: ignore[no-untyped-call]
    return out


def reduce_scatter_rows(
    x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None = None
) -> torch.Tensor:
    """``[ranks * rows, ...]`` on each rank -> the sum over ranks of chunk ``rank``; differentiable (the
    gradient is all-gathered)."""
    out: torch.Tensor = _ReduceScatter.apply(x, group, timer)  # type: ignore[no-untyped-call]
    return out


def allgather_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    first_expert: int,
    group: dist.ProcessGroup,
    timer: CommTimer | None = None,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """The fused-experts call ``[tokens, hidden] -> [tokens, hidden]`` with this rank's local experts
    ``first_expert .. first_expert + gate_up_proj.shape[0] - 1`` (plain local tensors) and the all-gather
    dispatcher over ``group``; ``glu(gate, up)`` is the experts' gated unit (see
    :func:`~mm_parallel.moe.grouped.expert_mlp`)."""
    tokens, k = top_k_index.shape
    n_local = gate_up_proj.shape[0]
    ranks = dist.get_world_size(group)
    # every rank's token count and assignments per expert, in one small all-gather and the layer's one host
    # read (a recomputed forward reuses it): the group's largest token count (ranks differ with uneven
    # micro-batches) and how many rows each of this rank's experts gets
    mine_stats = torch.cat(
        [
            top_k_index.new_full((1,), tokens, dtype=torch.int64),
            tokens_per_expert(top_k_index, n_local * ranks),
        ]
    )
    host = read_once(_gather(mine_stats, group, None).view(ranks, -1))
    rows = max(r[0] for r in host)
    local_counts = [sum(r[1 + first_expert + e] for r in host) for e in range(n_local)]
    pad = rows - tokens
    x, idx, w = hidden_states, top_k_index, top_k_weights
    if pad:
        x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
        idx = torch.cat([idx, idx.new_full((pad, k), -1)])
        w = torch.cat([w, w.new_zeros((pad, k))])
    all_x = all_gather_rows(x, group, timer)
    all_w = all_gather_rows(w, group, timer)
    with torch.no_grad():
        all_idx = _gather(idx, group, timer)
    # the assignments of every rank's tokens that fall on this rank's experts, grouped by expert (a stable
    # sort puts the others, keyed past the last local expert, at the end: fixed sizes, no host sync)
    flat = all_idx.reshape(-1) - first_expert
    key = torch.where((flat >= 0) & (flat < n_local), flat, torch.full_like(flat, n_local))
    order = torch.argsort(key, stable=True)[: sum(local_counts)]
    token_of = order // k
    counts = tokens_per_expert(key[order], n_local)
    y = expert_mlp(
        all_x[token_of],
        gate_up_proj,
        down_proj,
        counts,
        glu,
        use_grouped_mm=use_grouped_mm,
        host_counts=local_counts,
    )
    weights = all_w.reshape(-1)[order].to(y.dtype)
    partial = all_x.new_zeros(all_x.shape).index_add(0, token_of, (y * weights[:, None]).to(all_x.dtype))
    out = reduce_scatter_rows(partial, group, timer)
    # a fresh tensor, not a view: FSDP2 hooks the module's output, and an in-place op on a view would drop it
    return out[:tokens].clone() if pad else out
