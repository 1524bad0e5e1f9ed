"""``training.lr_scaling_plan``: learning-rate multipliers by parameter or module path pattern.

::

    training:
      lr_scaling_plan:
        model.embed_tokens: 0.1          # a module: every parameter inside it
        model.layers.{0-3}.*.*: 0.5      # parameter paths
        lm_head.weight: 2.0

A key is a pattern in mm's one pattern language (``{*}`` one integer component, ``{a-b}`` a range, ``*`` any
text inside one component), matched against the trainable parameters' paths and against module paths (then
every parameter inside the modules it matches). Paths are the model's own, as ``mm check`` prints them:
wrapper components that sharding, recompute or compilation may add (``_fsdp_wrapped_module``,
``_checkpoint_wrapped_module``, ``_orig_mod``) are dropped before matching. A tied parameter is matched
under each of its names and takes the multiplier of its first name that a pattern matches.

The first pattern in YAML order that matches a parameter wins. A pattern that matches no trainable
parameter, or only parameters that an earlier pattern took, is a :class:`ConfigError` naming
``training.lr_scaling_plan`` (it would silently do nothing). Parameters no pattern matches keep the
multiplier 1.

Each optimizer group is split by multiplier; a split group's ``lr`` is the group's base lr (``training.lr``,
or ``training.muon.adamw_lr`` for Muon's AdamW groups) times the multiplier, and the group carries the
multiplier as ``lr_scale``. The lr schedule multiplies every group's own base lr by the same factor, so the
ratio holds at every step (``training.lr_min`` is scaled with it).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from mm_core.config.schema import TrainingConfig
from mm_core.errors import ConfigError
from mm_parallel.patterns import ModulePattern, PatternError

KEY = "training.lr_scaling_plan"
#: path components that wrappers add around a module; parameter paths are matched without them
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_path(name: str) -> str:
    """``name`` without the wrapper components of :data:`WRAPPER_PARTS`."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


@dataclass(frozen=True)
class LrScaling:
    """Which pattern (None: none) and multiplier each trainable parameter takes, by ``id(param)``."""

    #: ``id(param) -> (pattern or None, multiplier)``
    by_param: dict[int, tuple[str | None, float]]
    #: ``pattern -> (the parameter paths it took, their elements)``, in YAML order
    taken: dict[str, tuple[list[str], int]]

    def scale_of(self, param: nn.Parameter) -> float:
        return self.by_param.get(id(param), (None, 1.0))[1]

    def describe(self, plan: dict[str, float]) -> list[str]:
        """Lines for ``mm check``: per pattern its multiplier and what it took."""
        lines = []
        for pattern, (names, numel) in self.taken.items():
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            lines.append(
                f"  lr x{plan[pattern]:g}  {pattern}: {len(names)} tensors ({numel:,} elements): {shown}"
            )
        rest = [n for n, (pattern, _) in self.by_param.items() if pattern is None]
        if rest:
            lines.append(f"  lr x1  (no pattern): {len(rest)} tensors")
        return lines


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(clean_path(n), p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]


def _modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(clean_path(n), m) for n, m in model.named_modules() if n]


def resolve_lr_scaling(model: nn.Module, plan: dict[str, float]) -> LrScaling:
    """Match ``plan`` (``training.lr_scaling_plan``) against ``model`` (module docstring); raises
    :class:`ConfigError` for a malformed pattern, one that matches nothing, or one shadowed entirely."""
    params = _trainable(model)
    modules = _modules(model)
    by_param: dict[int, tuple[str | None, float]] = {}
    taken: dict[str, tuple[list[str], int]] = {}
    for pattern, scale in plan.items():
        try:
            compiled = ModulePattern(pattern)
        except PatternError as exc:
            raise ConfigError(f"{KEY}: {exc}") from None
        inside = {id(p) for name, m in modules if compiled.matches(name) for p in m.parameters()}
        hits = [(n, p) for n, p in params if compiled.matches(n) or id(p) in inside]
        if not hits:
            raise ConfigError(
                f"{KEY}: pattern {pattern!r} matches no trainable parameter path and no module path of "
                f"the model ({{*}} is one integer component, * any text inside one component)."
                f"{_hint(pattern, params)}"
            )
        names: list[str] = []
        numel = 0
        for name, p in hits:
            if id(p) not in by_param:
                by_param[id(p)] = (pattern, scale)
                names.append(name)
                numel += p.numel()
        if not names:
            earlier = sorted({str(by_param[id(p)][0]) for _, p in hits})
            raise ConfigError(
                f"{KEY}: pattern {pattern!r} matches only parameters that an earlier pattern took "
                f"({', '.join(repr(e) for e in earlier)}; the first match wins): remove it or move it up"
            )
        taken[pattern] = (names, numel)
    for _, p in params:
        by_param.setdefault(id(p), (None, 1.0))
    return LrScaling(by_param, taken)


def _hint(pattern: str, params: Sequence[tuple[str, nn.Parameter]]) -> str:
    near = difflib.get_close_matches(pattern, [n for n, _ in params], n=3, cutoff=0.4)
    return f" Closest parameter paths: {near}." if near else ""


def scale_groups(groups: list[dict[str, Any]], scaling: LrScaling, default_lr: float) -> list[dict[str, Any]]:
    """Split each param group by multiplier (groups in order, multipliers in first-seen order); every
    resulting group gets ``lr_scale`` and an ``lr`` of its base lr (its own ``lr``, else ``default_lr``)
    times that multiplier."""
    out: list[dict[str, Any]] = []
    for group in groups:
        base = float(group.get("lr", default_lr))
        by_scale: dict[float, list[nn.Parameter]] = {}
        for p in group["params"]:
            by_scale.setdefault(scaling.scale_of(p), []).append(p)
        for scale, params in by_scale.items():
            out.append({**group, "params": params, "lr": base * scale, "lr_scale": scale})
    return out


def apply_lr_scaling(
    model: nn.Module, groups: list[dict[str, Any]], cfg: TrainingConfig
) -> list[dict[str, Any]]:
    """``groups`` with ``training.lr_scaling_plan`` applied (see :func:`scale_groups`); an optimizer
    factory calls it on its param groups before building the optimizer. Without a plan the groups are
    returned as they are."""
    if not cfg.lr_scaling_plan:
        return groups
    return scale_groups(groups, resolve_lr_scaling(model, cfg.lr_scaling_plan), cfg.lr)


def check_applied(optimizer: Any, cfg: TrainingConfig) -> None:
    """A ``training.lr_scaling_plan`` that the optimizer of ``training.optimizer`` did not apply (its
    factory does not call :func:`apply_lr_scaling`) is an error, not a silent no-op."""
    if cfg.lr_scaling_plan and not all("lr_scale" in g for g in optimizer.param_groups):
        raise ConfigError(
            f"{KEY}: the optimizer {cfg.optimizer!r} does not apply learning-rate multipliers (its factory "
            "does not call mm_core.optim.lr_scaling.apply_lr_scaling on its param groups); remove the key "
            "or use adamw or muon"
        )


def unscaled_lr(optimizer: Any) -> float:
    """The rate of the step without multipliers (``training.lr`` times the schedule, the Muon groups' for
    Muon): the first group's ``lr`` over its ``lr_scale``, from the first group whose multiplier is not 0
    (the ``lr`` that metrics.jsonl logs)."""
    for group in optimizer.param_groups:
        scale = float(group.get("lr_scale", 1.0))
        if scale != 0:
            return float(group["lr"]) / scale
    return float(optimizer.param_groups[0]["lr"])
