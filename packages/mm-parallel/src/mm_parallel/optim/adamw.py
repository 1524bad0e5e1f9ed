"""The AdamW update used for ``use_muon=False`` groups (numerics of ``torch.optim.AdamW``)."""

from __future__ import annotations

from torch import Tensor


def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One in-place AdamW step on rank-local tensors, identical to torch's single-tensor path."""
    step += 1
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_value = step.item()
    bias_correction1 = 1 - beta1**step_value
    bias_correction2 = 1 - beta2**step_value
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / (bias_correction2**0.5)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
