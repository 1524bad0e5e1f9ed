"""``training.optimizer: muon``: :class:`mm_parallel.optim.Muon` for hidden matrices, AdamW for the rest.

Muon groups use ``training.lr`` and ``training.weight_decay``; AdamW groups use ``training.muon.adamw_lr``
(default ``training.lr``), ``training.adam_beta1/adam_beta2/adam_eps``, and ``training.weight_decay`` on
their matrices (embeddings, head) but not on 1-D parameters, as ``training.optimizer: adamw`` does.
``training.lr_scaling_plan`` multiplies the base lr of the parameters it matches, in Muon and AdamW groups
alike. The LR scheduler scales every group by the same factor, so each group keeps its own base lr.
The registry entry :data:`build_muon` is an :class:`~mm_core.optim.factory.OptimizerPlugin`: its clipping
policy (``training.muon.clip_muon_params: false`` scales only AdamW gradients), its ``mm check`` summary
(the Muon/AdamW split) and its state size (one momentum buffer) are hooks, read by mm without its name.
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from mm_core.config.schema import TrainingConfig
from mm_core.errors import ConfigError
from mm_core.models.plan import ModelPlan
from mm_core.optim.factory import OptimizerPlugin, ParamFilter
from mm_core.optim.lr_scaling import apply_lr_scaling
from mm_core.parallel.apply import to_dtype
from mm_parallel.grad import clip_grad_norm_
from mm_parallel.optim import Muon, MuonParamPlan, classify_muon_params
from mm_parallel.patterns import ModulePattern, PatternError, match_modules

EXCLUDE_KEY = "training.muon.exclude"


def muon_plan(model: nn.Module, cfg: TrainingConfig, plan: ModelPlan | None = None) -> MuonParamPlan:
    """The Muon/AdamW split for ``model``: the classifier's rules, ``training.muon.exclude`` and the model
    plan's ``muon_exclude_modules``.

    An ``exclude`` entry is a pattern in mm's one pattern language (``{*}`` one integer component, ``{a-b}``
    a range, ``*`` any text inside one component) matched against parameter paths
    (``model.layers.{*}.mlp.gate.weight``, ``model.layers.*.self_attn.*_proj.bias``) and module paths
    (``model.layers.{*}.mlp.gate``: everything inside the modules it matches); it must match something,
    else :class:`ConfigError` naming ``training.muon.exclude`` and the closest names.
    """
    param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    module_names = [n for n, _ in model.named_modules() if n]
    name_patterns: list[str] = []
    module_patterns: list[str] = []
    for pattern in cfg.muon.exclude:
        try:
            compiled = ModulePattern(pattern)
        except PatternError as exc:
            raise ConfigError(f"{EXCLUDE_KEY}: {exc}") from None
        by_name = any(compiled.matches(n) for n in param_names)
        by_module = any(compiled.matches(n) for n in module_names)
        if by_name:
            name_patterns.append(pattern)
        if by_module:
            module_patterns.append(pattern)
        if not (by_name or by_module):
            hint = _closest(pattern, param_names)
            raise ConfigError(
                f"{EXCLUDE_KEY}: pattern {pattern!r} matches no parameter path and no module path of the "
                f"model ({{*}} is one integer component, * any text inside one component).{hint}"
            )
    modules = dict(model.named_modules())
    # the model's defaults may name modules that this configuration of the model does not have; like the
    # YAML's, they may also name parameters that sit directly on a module (a DiT block's modulation table)
    model_default = list((plan or ModelPlan()).muon_exclude_modules)
    for pattern in model_default:
        if pattern not in name_patterns and any(ModulePattern(pattern).matches(n) for n in param_names):
            name_patterns.append(pattern)
    try:
        matched = match_modules(model, model_default, allow_empty=True)
    except PatternError as exc:
        raise ConfigError(f"ModelPlan.muon_exclude_modules of {type(model).__name__}: {exc}") from None
    matched.update(match_modules(model, module_patterns))
    excluded = [modules[n] for hits in matched.values() for n in hits]
    return classify_muon_params(model, exclude=name_patterns, exclude_modules=excluded)


def _closest(pattern: str, names: list[str]) -> str:
    near = difflib.get_close_matches(pattern, names, n=3, cutoff=0.4)
    return f" Closest parameter names: {near}." if near else ""


def muon_groups(plan: MuonParamPlan, cfg: TrainingConfig) -> list[dict[str, Any]]:
    """One Muon group, then AdamW with and without weight decay (1-D parameters take none)."""
    adamw = {
        "use_muon": False,
        "lr": cfg.lr if cfg.muon.adamw_lr is None else cfg.muon.adamw_lr,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_eps,
    }
    muon = [plan.params[n] for n in plan.muon_names]
    decay = [plan.params[n] for n in plan.adamw_names if plan.params[n].ndim >= 2]
    no_decay = [plan.params[n] for n in plan.adamw_names if plan.params[n].ndim < 2]
    groups = [
        {"params": muon, "use_muon": True},
        {"params": decay, **adamw, "weight_decay": cfg.weight_decay},
        {"params": no_decay, **adamw, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def make_muon(model: nn.Module, cfg: TrainingConfig, plan: ModelPlan | None = None) -> torch.optim.Optimizer:
    """The factory of ``training.optimizer: muon`` (see docs/muon.md)."""
    m = cfg.muon
    ns_dtype = to_dtype(m.ns_dtype)
    if ns_dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"training.muon.ns_dtype: {m.ns_dtype!r} is not supported; use bf16 or fp32")
    split = muon_plan(model, cfg, plan)
    if not split.muon_names:
        raise ConfigError(
            "training.optimizer: muon, but no parameter takes Muon (all excluded or not matrices); "
            "check training.muon.exclude or use adamw"
        )
    return Muon(
        apply_lr_scaling(model, muon_groups(split, cfg), cfg),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_coefficients=m.ns_coefficients,
        eps=m.eps,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr_fn,
        ns_dtype=ns_dtype,
    )


def adamw_params(optimizer: torch.optim.Optimizer) -> ParamFilter:
    """A filter accepting the parameters of the optimizer's AdamW groups (``use_muon: False``)."""
    adamw = {id(p) for g in optimizer.param_groups if not g.get("use_muon", True) for p in g["params"]}
    return lambda p: id(p) in adamw


def clip_policy(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> ParamFilter | None:
    """``training.muon.clip_muon_params: false``: the global norm is over every gradient (returned and
    logged), but only the gradients of AdamW groups are scaled. Muon's update is orthogonalised, hence
    invariant to the scale of its gradient (up to ``eps`` and momentum mixing), so clipping it mostly
    reweights the momentum history. ``true`` (default): every gradient is scaled."""
    return None if cfg.muon.clip_muon_params else adamw_params(optimizer)


def clip_grad_norm_adamw_only_(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float | None
) -> torch.Tensor:
    """:func:`mm_parallel.grad.clip_grad_norm_` scaling only the AdamW groups' gradients (see
    :func:`clip_policy`)."""
    return clip_grad_norm_(params, max_norm, scale_only=adamw_params(optimizer))


def split_summary(plan: MuonParamPlan, names_per_reason: int = 3) -> list[str]:
    """Lines for ``mm check``: tensor and element counts per optimizer, then per reason a few names."""
    numel = {d.name: plan.params[d.name].numel() for d in plan.decisions}
    by_reason: dict[tuple[bool, str], list[str]] = defaultdict(list)
    for d in plan.decisions:
        tied = f" (tied: {', '.join(d.aliases)})" if d.aliases else ""
        reason = re.sub(r"(?<=\.)\d+(?=[.\s)]|$)", "{*}", d.reason)  # one line for all layers
        by_reason[(d.use_muon, reason)].append(d.name + tied)
    muon, adamw = plan.muon_names, plan.adamw_names
    lines = [
        f"muon {len(muon)} tensors ({sum(numel[n] for n in muon):,} elements), "
        f"adamw {len(adamw)} tensors ({sum(numel[n] for n in adamw):,} elements)"
    ]
    for (use_muon, reason), names in sorted(by_reason.items(), key=lambda kv: (not kv[0][0], kv[0][1])):
        shown = ", ".join(names[:names_per_reason]) + (", ..." if len(names) > names_per_reason else "")
        lines.append(f"  {'muon ' if use_muon else 'adamw'} {len(names):>4}  {reason}: {shown}")
    return lines


def describe(model: nn.Module, cfg: TrainingConfig, plan: ModelPlan) -> list[str]:
    """The ``mm check`` summary: the Muon/AdamW split (see :func:`split_summary`)."""
    return split_summary(muon_plan(model, cfg, plan))


#: the ``mm.optimizers`` entry ``muon``
build_muon = OptimizerPlugin(build=make_muon, clip_policy=clip_policy, describe=describe, states_per_param=1)
