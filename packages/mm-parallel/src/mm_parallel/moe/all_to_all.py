"""All-to-all with uneven splits that autograd can differentiate (the backward is the reverse exchange)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommTimer:
    """Wall time and count of the all-to-all exchanges of one module (forward and backward)."""

    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    timer: CommTimer | None,
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if timer is not None:
        if out.device.type != "cpu":
            getattr(torch, out.device.type).synchronize()
        timer.seconds += time.perf_counter() - t0
        timer.calls += 1
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
        timer: CommTimer | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return _exchange(x, out_splits, in_splits, group, timer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.timer), None, None, None, None


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    timer: CommTimer | None = None,
) -> torch.Tensor:
    """Send ``in_splits[j]`` leading rows of ``x`` (in order) to rank ``j`` of ``group``; receive
    ``out_splits[j]`` rows from rank ``j``. Differentiable; zero-row splits are fine."""
    # torch.autograd.Function.apply is unannotated (returns what forward returns)
    out: torch.Tensor = _AllToAll.apply(x, list(out_splits), list(in_splits), group, timer)  # type: ignore[no-untyped-call]
    return out


def exchange_counts(
    counts: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None = None
) -> torch.Tensor:
    """``counts`` is ``[ranks, n]`` (row ``j`` goes to rank ``j``); returns ``[ranks, n]`` where row ``s``
    came from rank ``s``. Not differentiable (integer bookkeeping)."""
    sizes = [counts.shape[1]] * counts.shape[0]
    return _exchange(counts.reshape(-1), sizes, sizes, group, timer).view_as(counts)
