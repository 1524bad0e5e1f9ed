"""Named step statistics: device tensors keyed by name, summed over ranks in one all-reduce and read on the
host in one sync.

A step's counts stay on the device until the step reads them all at once; naming them replaces positions
in a stacked vector (``values[3]``) with keys (``values["tokens"]``). The order of a mapping is the order of
the elements in the buffer that travels, so the same mapping always gives the same collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


def sum_over_ranks(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum named float64 tensors (0-dim or 1-dim, on one device) over every rank in ONE all-reduce.

    They travel concatenated in the mapping's order; each comes back under its name with its own shape (a
    view of the reduced buffer, still on the device: no host sync)."""
    if not values:
        raise ValueError("sum_over_ranks: no values to reduce")
    names = list(values)
    flat = torch.cat([values[name].reshape(-1) for name in names])
    dist.all_reduce(flat)
    sizes = [values[name].numel() for name in names]
    return {
        name: part.reshape(values[name].shape) for name, part in zip(names, flat.split(sizes), strict=True)
    }


class PendingRead:
    """Named 0-dim device tensors on their way to the host (:func:`start_read`); :meth:`result` waits for them
    only (one host sync), not for device work queued after the copy."""

    def __init__(self, names: list[str], buffer: torch.Tensor, event: torch.Event | None) -> None:
        self._names, self._buffer, self._event = names, buffer, event

    def result(self) -> dict[str, float]:
        if self._event is not None:
            self._event.synchronize()
        return dict(zip(self._names, self._buffer.tolist(), strict=True))


def start_read(values: Mapping[str, torch.Tensor]) -> PendingRead:
    """Start reading named 0-dim tensors (on one device) on the host: on an accelerator one asynchronous copy
    into pinned host memory, marked by an event, so work launched after it (the optimizer update) runs while
    the host waits for the values; on CPU the values themselves. :meth:`PendingRead.result` gives the floats
    (the step's one host sync)."""
    names = list(values)
    if not names:
        return PendingRead([], torch.zeros(0, dtype=torch.float64), None)
    stacked = torch.stack([values[name].reshape(()) for name in names])
    if stacked.device.type == "cpu":
        return PendingRead(names, stacked, None)
    buffer = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    buffer.copy_(stacked, non_blocking=True)
    event = torch.Event(device=stacked.device)
    event.record()
    return PendingRead(names, buffer, event)


def read_on_host(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Named 0-dim tensors (on one device) as floats, in ONE host sync (one stacked ``.tolist()``)."""
    names = list(values)
    if not names:
        return {}
    floats = torch.stack([values[name].reshape(()) for name in names]).tolist()
    return dict(zip(names, floats, strict=True))
