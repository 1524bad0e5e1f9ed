"""The non-finite policy: a NaN/inf loss or grad norm stops the run (or is skipped, within a budget), and
non-finite weights are never checkpointed. See docs/reliability.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mm_core.checkpoint.layout import read_latest
from mm_core.errors import NonFiniteError


class NonFiniteGuard:
    """``training.skip_nonfinite_steps`` (``allowed``) and the checks around updates and saves."""

    def __init__(self, allowed: int, save: str | None, info: Callable[[str], None]) -> None:
        self.allowed = allowed
        self.save = save
        self.info = info
        self.skipped = 0  # steps skipped in this process

    def _last_good(self) -> str:
        latest = read_latest(Path(self.save)) if self.save else None
        return str(latest) if latest is not None else "none"

    def allows_update(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when step ``step`` may update the model. A non-finite loss or grad norm is skipped while the
        budget allows, else :class:`NonFiniteError` (no update, no checkpoint of it)."""
        bad = [
            f"{name} is {v}" for name, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v)
        ]
        if not bad:
            return True
        if self.skipped < self.allowed:
            self.skipped += 1
            self.info(
                f"step {step}: the {' and the '.join(bad)}; skipped the update "
                f"({self.skipped} of training.skip_nonfinite_steps: {self.allowed})"
            )
            return False
        raise NonFiniteError(
            f"training stopped at step {step}: the {' and the '.join(bad)}; the update was not applied "
            f"and no checkpoint of it was written (last good checkpoint: {self._last_good()}); lower "
            "training.lr or check the data, or set training.skip_nonfinite_steps: N to skip up to N such "
            "steps" + (f" (already skipped {self.allowed})" if self.allowed else "")
        )

    def check_weights(self, model: nn.Module, step: int, device: torch.device) -> None:
        """Raise before a checkpoint of non-finite weights is written (every rank checks its shards and all
        agree: one small all-reduce and one host sync, at save steps only)."""
        named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in model.named_parameters()]
        named = [(n, t) for n, t in named if t.numel()]
        finite = torch.stack([torch.isfinite(t).all() for _, t in named])
        bad = finite.logical_not().sum().to(device=device, dtype=torch.float64).reshape(1)
        if dist.is_initialized():
            dist.all_reduce(bad)
        if not bad.item():
            return
        mine = [n for (n, _), ok in zip(named, finite.tolist()) if not ok]
        shown = ", ".join(mine[:5]) or "tensors on other ranks"
        raise NonFiniteError(
            f"training stopped at step {step}: the weights are not finite ({shown}); no checkpoint of them "
            f"was written (last good checkpoint: {self._last_good()}); lower training.lr or check the data"
        )
