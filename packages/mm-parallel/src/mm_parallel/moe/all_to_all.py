"""All-to-all with uneven splits that autograd can differentiate (the backward is the reverse exchange)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class CommTimer:
    """Time and count of the exchanges of one module (forward and backward), without a host sync.

    On CPU (gloo's collectives return when done) the wall time of each call. On an accelerator, two device
    events recorded on the current stream around each exchange (the stream waits for the collective, so
    the pair spans it); their elapsed times are read only when :attr:`seconds` is read (which waits for the
    last one), and pairs that have already completed are folded in as later ones are recorded. Nothing
    here synchronizes the device, so exchanges and compute overlap as they would untimed.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._seconds = 0.0
        self._pending: list[tuple[Any, Any]] = []  # (start, end) device events not yet read

    def reset(self) -> None:
        self.calls, self._seconds, self._pending = 0, 0.0, []

    @property
    def seconds(self) -> float:
        """Seconds spent in the exchanges so far (waits for the device events still pending)."""
        for start, end in self._pending:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0
        self._pending = []
        return self._seconds

    def start(self, device: torch.device) -> Any:
        """Before an exchange on ``device``: a token for :meth:`stop`."""
        if device.type == "cpu":
            return time.perf_counter()
        event = torch.Event(device=device, enable_timing=True)
        event.record()
        return event

    def stop(self, token: Any) -> None:
        """After the exchange started with :meth:`start`."""
        self.calls += 1
        if isinstance(token, float):
            self._seconds += time.perf_counter() - token
            return
        end = torch.Event(device=token.device, enable_timing=True)
        end.record()
        waiting = []
        for start, stop in self._pending:
            if stop.query():  # completed (query() does not wait)
                self._seconds += start.elapsed_time(stop) / 1000.0
            else:
                waiting.append((start, stop))
        self._pending = [*waiting, (token, end)]


def _exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    timer: CommTimer | None,
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    token = timer.start(out.device) if timer is not None else None
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if timer is not None:
        timer.stop(token)
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
