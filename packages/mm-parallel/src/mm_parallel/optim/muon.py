"""Muon for plain tensors and FSDP2/HSDP/EP DTensor parameters, with AdamW groups built in."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .adamw import adamw_update
from .exchange import ExchangePlan
from .layout import MatrixLayout, check_dtype, describe, local_view, matrices_of
from .newton_schulz import (
    ADJUST_LR_FNS,
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    NS_DTYPES,
    adjust_lr,
)
from .orthogonalize import NSConfig, orthogonalize
from .stats import MuonStepStats

ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8}
_UNSUPPORTED_ADAMW_FLAGS = (
    "amsgrad",
    "maximize",
    "capturable",
    "differentiable",
    "fused",
)


class Muon(Optimizer):
    """Muon with the arguments and defaults of ``torch.optim.Muon``, distributed over DTensor shards.

    Groups with ``use_muon=False`` take an AdamW update (keys ``lr``, ``betas`` (default
    (0.9, 0.999)), ``eps`` (default 1e-8), ``weight_decay`` (default: this optimizer's)). Muon groups
    take 2-D matrices and 3-D ``[experts, m, n]`` weights (a batch of matrices). ``ns_dtype`` is
    the dtype of the Newton–Schulz iteration and of the shards exchanged between ranks.
    All state (``step``, ``momentum_buffer`` or ``exp_avg``/``exp_avg_sq``) exists from construction,
    with the parameter's placements, so DCP and ``get_optimizer_state_dict`` work unchanged.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if momentum < 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"adjust_lr_fn={adjust_lr_fn!r} is not supported; use one of {ADJUST_LR_FNS} or None."
            )
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype} is not supported; use one of {NS_DTYPES}.")
        self.ns_dtype = ns_dtype
        self.sync_timing = False
        self.last_step_stats = MuonStepStats()
        self._layouts: dict[int, MatrixLayout] = {}
        self._plans: dict[tuple[MatrixLayout, ...], ExchangePlan] = {}
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``use_muon=False`` for AdamW) and create its state right away."""
        if not param_group.get("use_muon", True):
            for key, value in ADAMW_DEFAULTS.items():
                param_group.setdefault(key, value)
            bad = [flag for flag in _UNSUPPORTED_ADAMW_FLAGS if param_group.get(flag)]
            if bad:
                raise ValueError(f"AdamW groups of mm_parallel.optim.Muon do not support {bad}; drop them.")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for index, p in enumerate(group["params"]):
            check_dtype(p, f"group {len(self.param_groups) - 1} param {index}")
            state = self.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if group["use_muon"]:
                self._layouts[id(p)] = describe(p, f"group {len(self.param_groups) - 1} index {index}")
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimisation step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        stats = MuonStepStats()
        entries: list[tuple[Tensor, dict[str, Any], MatrixLayout]] = []
        updates: list[Tensor] = []
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
                continue
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = _local_grad(p)
                state = self.state[p]
                state["step"] += 1
                buf = local_view(state["momentum_buffer"])
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                entries.append((p, group, self._layouts[id(p)]))
                updates.append(matrices_of(update))
        if entries:
            self._muon_apply(entries, updates, stats)
        stats.step_seconds = time.perf_counter() - start
        self.last_step_stats = stats
        return loss

    def _muon_apply(
        self,
        entries: list[tuple[Tensor, dict[str, Any], MatrixLayout]],
        updates: list[Tensor],
        stats: MuonStepStats,
    ) -> None:
        config = _ns_config(entries[0][1], self.ns_dtype)
        if any(_ns_config(group, self.ns_dtype) != config for _, group, _ in entries):
            raise ValueError(
                "All Muon groups of one optimizer must share ns_coefficients, ns_steps and eps "
                "(they are orthogonalised together). Use one value or separate optimizers."
            )
        sync = _device_sync(updates[0].device) if self.sync_timing else (lambda: None)
        results = orthogonalize(
            [layout for _, _, layout in entries],
            updates,
            config,
            stats,
            self._plans,
            sync,
        )
        for (p, group, layout), result in zip(entries, results, strict=True):
            lr = float(group["lr"])
            local = local_view(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(
                result.view(local.shape),
                alpha=-adjust_lr(lr, group["adjust_lr_fn"], layout.rows, layout.cols),
            )

    def _adamw_step(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            adamw_update(
                local_view(p),
                _local_grad(p),
                local_view(state["exp_avg"]),
                local_view(state["exp_avg_sq"]),
                state["step"],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )


def _local_grad(p: Tensor) -> Tensor:
    grad = p.grad
    assert grad is not None
    if grad.is_sparse:
        raise RuntimeError("Muon does not support sparse gradients")
    if isinstance(p, DTensor) and (not isinstance(grad, DTensor) or grad.placements != p.placements):
        got = grad.placements if isinstance(grad, DTensor) else "a plain tensor"
        raise RuntimeError(
            f"gradient of a DTensor parameter with placements {p.placements} is {got}; "
            "gradients must have the parameter's placements (as FSDP2 produces them)."
        )
    return local_view(grad)


def _ns_config(group: dict[str, Any], dtype: torch.dtype) -> NSConfig:
    return NSConfig(
        tuple(group["ns_coefficients"]),
        int(group["ns_steps"]),
        float(group["eps"]),
        dtype,
    )


def _device_sync(device: torch.device) -> Callable[[], None]:
    module = getattr(torch, device.type, None)
    synchronize = getattr(module, "synchronize", None) if device.type != "cpu" else None
    return synchronize if callable(synchronize) else (lambda: None)
