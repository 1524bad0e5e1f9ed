"""The plumbing every task shares around its optimizer steps, in one place.

:class:`TaskToolkit` is built by a task once its models exist and called from its step and hooks:

- :meth:`~TaskToolkit.clip`: clip a model's gradients by their global norm over the sharded parameters
  (``training.clip_grad``, with the optimizer's clipping policy);
- :meth:`~TaskToolkit.update`: step an optimizer and its lr schedule unless the step's loss or gradient
  norm is not finite (``training.skip_nonfinite_steps``, else the run stops; see
  :mod:`mm_core.train.nonfinite`), then drop the gradients;
- :meth:`~TaskToolkit.update_then_read`: the same decision with the update issued before the step's host
  read, where the optimizer can skip a non-finite step on the device (fused AdamW);
- :meth:`~TaskToolkit.after_load`: after a resume, check that a meta-built model got every weight;
- :meth:`~TaskToolkit.before_save`: refuse to checkpoint non-finite weights;
- :meth:`~TaskToolkit.nonfinite_metrics`: the ``skipped_nonfinite_steps`` count for the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mm_core.optim.factory import ParamFilter
from mm_core.parallel.apply import check_initialised
from mm_core.tasks.base import TaskContext
from mm_core.train.nonfinite import NonFiniteGuard
from mm_parallel.grad import clip_grad_norm_


class TaskToolkit:
    """Clipping, the non-finite policy and the load / save checks of a task's trained ``models``."""

    def __init__(self, ctx: TaskContext, models: Iterable[nn.Module]) -> None:
        tcfg = ctx.cfg.training
        self.ctx = ctx
        self.models = list(models)
        self.nonfinite = NonFiniteGuard(tcfg.skip_nonfinite_steps, tcfg.save, ctx.info)

    def clip(self, model: nn.Module, scale_only: ParamFilter | None = None) -> torch.Tensor:
        """Clip the gradients of ``model``'s trainable parameters to ``training.clip_grad`` (their global
        norm; ``scale_only``: the optimizer's clipping policy, ``BuiltOptimizer.clip_scale_only``); returns
        the norm before clipping, on the device (no host sync)."""
        params = [p for p in model.parameters() if p.requires_grad]
        return clip_grad_norm_(params, self.ctx.cfg.training.clip_grad, scale_only=scale_only)

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        step: int,
        grad_norm: float,
        loss: float = 0.0,
    ) -> bool:
        """Step ``optimizer`` and ``scheduler`` unless ``loss`` or ``grad_norm`` (host values of step
        ``step``) is not finite, then zero the gradients; returns whether the update was applied."""
        applied = self.nonfinite.allows_update(step, loss, grad_norm)
        if applied:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return applied

    @staticmethod
    def masks_on_device(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer.step()`` can leave the weights and its state untouched on the device when told
        the step is not finite: torch's fused Adam / AdamW, through the ``found_inf`` attribute that
        ``torch.amp.GradScaler`` sets for them (the kernel skips the update and undoes the step count)."""
        return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
            g.get("fused") for g in optimizer.param_groups
        )

    def update_then_read(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        read: Callable[[], dict[str, float]],
        names: tuple[str, str],
    ) -> tuple[dict[str, float], bool]:
        """:meth:`update` with the host read after the update is issued (for :meth:`masks_on_device`
        optimizers): the update runs on the device masked by ``loss``/``grad_norm`` being finite (0-dim
        device tensors); then ``read()`` gives the step's host values (``names``: the keys of the loss and
        the grad norm in them) and the same policy decides: the lr schedule advances, or the step counts as
        skipped, or :class:`~mm_core.errors.NonFiniteError` (the update was not applied). Returns the values
        and whether the update was applied."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        # the GradScaler protocol of torch's fused Adam/AdamW: a non-zero found_inf skips the whole update
        optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        values = read()
        applied = self.nonfinite.allows_update(step, values[names[0]], values[names[1]])
        if applied:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return values, applied

    def after_load(self) -> None:
        """Every weight of every model was filled (a model built on the meta device holds NaN until then)."""
        for model in self.models:
            check_initialised(model)

    def before_save(self, step: int) -> None:
        """Raise before a checkpoint of non-finite weights of any model is written."""
        for model in self.models:
            self.nonfinite.check_weights(model, step, self.ctx.device)

    def nonfinite_metrics(self) -> dict[str, float]:
        """``skipped_nonfinite_steps`` (steps skipped in this process) when ``training.skip_nonfinite_steps``
        is set; else nothing."""
        if not self.ctx.cfg.training.skip_nonfinite_steps:
            return {}
        return {"skipped_nonfinite_steps": self.nonfinite.skipped}
