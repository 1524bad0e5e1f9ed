"""Decide which parameters take Muon and which take AdamW, from module types and model metadata."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mm_parallel.patterns import ModulePattern

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.normalization.LayerNorm,
    nn.modules.normalization.GroupNorm,
    nn.modules.normalization.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_CONV_TYPES: tuple[type[nn.Module], ...] = (nn.modules.conv._ConvNd,)
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)

ModuleSpec = type[nn.Module] | nn.Module | str


@dataclass(frozen=True)
class ParamDecision:
    """Where one parameter goes and why. ``aliases`` lists other names of a tied parameter."""

    name: str
    shape: tuple[int, ...]
    use_muon: bool
    reason: str
    aliases: tuple[str, ...] = ()


@dataclass
class MuonParamPlan:
    """The Muon/AdamW split of a model; ``str(plan)`` is a table for logs."""

    decisions: list[ParamDecision]
    params: dict[str, nn.Parameter] = field(repr=False)

    @property
    def muon_names(self) -> list[str]:
        return [d.name for d in self.decisions if d.use_muon]

    @property
    def adamw_names(self) -> list[str]:
        return [d.name for d in self.decisions if not d.use_muon]

    def param_groups(
        self,
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] | None = None,
        adamw_eps: float | None = None,
        adamw_weight_decay: float | None = None,
    ) -> list[dict[str, Any]]:
        """Groups for :class:`~mm_parallel.optim.Muon`; AdamW options left None take its defaults."""
        groups: list[dict[str, Any]] = []
        muon = [self.params[n] for n in self.muon_names]
        if muon:
            groups.append({"params": muon, "use_muon": True})
        adamw = [self.params[n] for n in self.adamw_names]
        if adamw:
            group: dict[str, Any] = {"params": adamw, "use_muon": False}
            options = {
                "lr": adamw_lr,
                "betas": adamw_betas,
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            }
            group.update({k: v for k, v in options.items() if v is not None})
            groups.append(group)
        return groups

    def __str__(self) -> str:
        width = max([len(d.name) for d in self.decisions] + [9])
        lines = [f"{'parameter':<{width}}  {'shape':<20} optimizer  reason"]
        for d in self.decisions:
            tied = f" (tied: {', '.join(d.aliases)})" if d.aliases else ""
            optimizer = "muon" if d.use_muon else "adamw"
            lines.append(f"{d.name:<{width}}  {list(d.shape)!s:<20} {optimizer:<10} {d.reason}{tied}")
        muon = sum(self.params[n].numel() for n in self.muon_names)
        adamw = sum(self.params[n].numel() for n in self.adamw_names)
        lines.append(
            f"muon: {len(self.muon_names)} tensors, {muon:,} elements; "
            f"adamw: {len(self.adamw_names)} tensors, {adamw:,} elements"
        )
        return "\n".join(lines)


def classify_muon_params(
    model: nn.Module,
    *,
    exclude: Iterable[str] = (),
    exclude_modules: Iterable[ModuleSpec] = (),
) -> MuonParamPlan:
    """Split trainable parameters into Muon (hidden 2-D/3-D weights) and AdamW (everything else).

    AdamW takes: parameters whose path matches a pattern in ``exclude``; parameters of modules in
    ``exclude_modules`` (module types, module objects, or patterns on module paths — pass routers/gates
    here, e.g. from model metadata); embeddings; the output head
    (``model.get_output_embeddings()``) and anything tied to it or to an embedding; normalisation
    layers; convolution kernels; and anything with ndim < 2 or ndim > 3.
    Patterns use :mod:`mm_parallel.patterns` (``{*}`` one integer component, ``{a-b}`` a range, ``*`` any
    text inside one component) and match whole dotted paths.
    Raises ValueError when a pattern matches nothing, listing the closest names.
    """
    exclude_patterns = [ModulePattern(p) for p in exclude]
    specs = list(exclude_modules)
    module_types = tuple(s for s in specs if isinstance(s, type))
    module_objects = {id(s) for s in specs if isinstance(s, nn.Module)}
    module_patterns = [ModulePattern(s) for s in specs if isinstance(s, str)]
    for spec in specs:
        if not isinstance(spec, (type, nn.Module, str)):
            raise TypeError(
                f"exclude_modules entries must be module types, modules or path patterns, got {spec!r}"
            )

    modules = dict(model.named_modules(remove_duplicate=False))
    _check_patterns(module_patterns, list(modules), "exclude_modules", "module")
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in modules.items():
        for local_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{local_name}" if module_name else local_name
            owners.setdefault(id(param), []).append((full, module, module_name))
    names = [entries[0][0] for entries in owners.values()]
    _check_patterns(
        exclude_patterns,
        [n for entries in owners.values() for n, _, _ in entries],
        "exclude",
        "parameter",
    )

    excluded: dict[str, str] = {}
    for module_name, module in modules.items():
        reason = _module_exclusion(module, module_name, module_types, module_objects, module_patterns)
        if reason is not None:
            excluded.setdefault(module_name, reason)
    special: dict[int, str] = {}
    head = getattr(model, "get_output_embeddings", None)
    head_module = head() if callable(head) else None
    for module in modules.values():
        if isinstance(module, _EMBEDDING_TYPES):
            for p in module.parameters(recurse=False):
                special[id(p)] = "embedding"
    if isinstance(head_module, nn.Module):
        for p in head_module.parameters(recurse=False):
            special[id(p)] = "embedding (tied to the output head)" if id(p) in special else "output head"

    decisions: list[ParamDecision] = []
    params: dict[str, nn.Parameter] = {}
    for (key, entries), name in zip(owners.items(), names, strict=True):
        param = _param_of(entries[0][1], entries[0][0])
        if not param.requires_grad:
            continue
        reason = _adamw_reason(param, entries, exclude_patterns, excluded, special.get(key))
        muon_reason = "hidden 3-D weight (batch of matrices)" if param.ndim == 3 else "hidden 2-D weight"
        decisions.append(
            ParamDecision(
                name,
                tuple(param.shape),
                reason is None,
                reason or muon_reason,
                tuple(n for n, _, _ in entries[1:]),
            )
        )
        params[name] = param
    return MuonParamPlan(decisions, params)


def muon_param_groups(
    model: nn.Module,
    *,
    exclude: Iterable[str] = (),
    exclude_modules: Iterable[ModuleSpec] = (),
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] | None = None,
    adamw_eps: float | None = None,
    adamw_weight_decay: float | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups for :class:`~mm_parallel.optim.Muon` (see :func:`classify_muon_params`)."""
    plan = classify_muon_params(model, exclude=exclude, exclude_modules=exclude_modules)
    return plan.param_groups(
        adamw_lr=adamw_lr,
        adamw_betas=adamw_betas,
        adamw_eps=adamw_eps,
        adamw_weight_decay=adamw_weight_decay,
    )


def _param_of(module: nn.Module, full_name: str) -> nn.Parameter:
    param: nn.Parameter = getattr(module, full_name.rsplit(".", 1)[-1])
    return param


def _module_exclusion(
    module: nn.Module,
    module_name: str,
    module_types: tuple[type, ...],
    module_objects: set[int],
    module_patterns: list[ModulePattern],
) -> str | None:
    if module_types and isinstance(module, module_types):
        return f"in excluded module {module_name} ({type(module).__name__})"
    if id(module) in module_objects:
        return f"in excluded module {module_name or '<root>'}"
    for pattern in module_patterns:
        if pattern.matches(module_name):
            return f"in excluded module {module_name} (pattern {pattern.text!r})"
    return None


def _adamw_reason(
    param: torch.Tensor,
    entries: list[tuple[str, nn.Module, str]],
    exclude: list[ModulePattern],
    excluded_modules: dict[str, str],
    special: str | None,
) -> str | None:
    for name, _, module_name in entries:
        for pattern in exclude:
            if pattern.matches(name):
                return f"excluded by pattern {pattern.text!r}"
        parts = module_name.split(".") if module_name else []
        for depth in range(len(parts) + 1):  # the module itself or any ancestor
            reason = excluded_modules.get(".".join(parts[:depth]))
            if reason is not None:
                return reason
    if special is not None:
        return special
    modules = [module for _, module, _ in entries]
    if any(isinstance(m, _NORM_TYPES) for m in modules):
        return "normalization layer"
    if any(isinstance(m, _CONV_TYPES) for m in modules) or param.ndim in (4, 5):
        return "convolution kernel"
    if param.ndim < 2:
        return "ndim < 2 (bias, norm scale or scalar)"
    if param.ndim > 3:
        return f"ndim {param.ndim} is not a matrix or a batch of matrices"
    return None


def _check_patterns(patterns: list[ModulePattern], names: list[str], option: str, kind: str) -> None:
    for pattern in patterns:
        if not any(pattern.matches(n) for n in names):
            near = difflib.get_close_matches(pattern.text, names, n=5, cutoff=0.4)
            hint = f" Closest {kind} names: {near}." if near else ""
            raise ValueError(f"{option} pattern {pattern.text!r} matches no {kind} of the model.{hint}")
