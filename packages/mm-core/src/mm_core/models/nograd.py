"""Parameters that train nothing, for ``mm check``: the frozen ones with the reason they are frozen, and, on
request, the trainable ones that one micro-batch gives no gradient.

A trainable parameter without a gradient is silent waste (optimizer state, gradient reduction) and usually
a sign of a branch the loss never reaches; a frozen one should say why. Two reports:

- :func:`describe_frozen` (free, on the meta-built model ``mm check`` already has): every parameter with
  ``requires_grad=False``, grouped by module path shape, with its reason: ``model.freeze`` (the YAML) or the
  model class's own policy. A class that freezes parameters itself names them and says why in its plan's
  ``ModelPlan.frozen_reasons`` (module pattern, reason), e.g. MiniMax-M3-VL's sparse-attention indexers.
- :func:`probe_gradients` (``mm check --grad-probe``): one forward and backward of a real micro-batch on a
  materialised model, with the loss the trainer uses; lists the trainable parameters whose ``.grad`` stays
  None. Which parameters receive a gradient does not depend on their values, so a random initialisation
  serves; it does depend on the batch (a branch only some samples take), so it is evidence about that
  micro-batch, not a proof for every batch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mm_core.models.plan import plan_of
from mm_parallel.patterns import ModulePattern

#: the reason of parameters frozen by ``model.freeze``
YAML_FREEZE = "model.freeze"
#: the reason of parameters frozen because LoRA trains only its adapters
LORA_FREEZE = "training.lora (only the adapters train)"


def path_shape(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.{*}.mlp``: every integer path component as ``{*}``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "{*}", name)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of modules of one path shape (``model.layers.{*}.self_attn.indexer``)."""

    shape: str
    modules: int
    tensors: int
    elements: int
    reason: str = ""


def _group(entries: Sequence[tuple[str, str, int, str]]) -> list[ParamGroup]:
    """``(module, shape, numel, reason)`` per parameter -> one group per (shape, reason), in model order."""
    order: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for module, shape, numel, reason in entries:
        order.setdefault((shape, reason), []).append((module, numel))
    return [
        ParamGroup(shape, len({m for m, _ in items}), len(items), sum(n for _, n in items), reason)
        for (shape, reason), items in order.items()
    ]


def frozen_groups(
    model: nn.Module, yaml_frozen: Sequence[str] = (), lora_adapted: Sequence[str] = ()
) -> list[ParamGroup]:
    """The parameters with ``requires_grad=False``, grouped with their reason. ``yaml_frozen``: the module
    names ``model.freeze`` matched (what ``apply_freeze`` returns); ``lora_adapted``: the modules that got
    LoRA adapters (``training.lora``: every other parameter is frozen)."""
    patterns = [(ModulePattern(p), p, r) for p, r in plan_of(model).frozen_reasons]
    by_yaml = sorted(yaml_frozen, key=len, reverse=True)  # the innermost frozen module names the group
    owner = type(model).__name__
    entries: list[tuple[str, str, int, str]] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        module = next((m for m in by_yaml if name.startswith(m + ".")), None)
        if module is not None:
            entries.append((module, path_shape(module), param.numel(), YAML_FREEZE))
            continue
        parts = name.split(".")[:-1]
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        hit = next(((m, p, r) for m in prefixes for pat, p, r in patterns if pat.matches(m)), None)
        if hit is not None:
            entries.append((hit[0], hit[1], param.numel(), f"frozen by {owner}: {hit[2]}"))
        elif lora_adapted:
            parent = ".".join(parts)
            entries.append((parent, path_shape(parent), param.numel(), LORA_FREEZE))
        else:
            parent = ".".join(parts)
            entries.append(
                (parent, path_shape(parent), param.numel(), f"frozen by {owner} (no reason given)")
            )
    return _group(entries)


def _rows(groups: Sequence[ParamGroup], limit: int) -> list[str]:
    width = min(56, max((len(g.shape) for g in groups), default=0))
    lines = []
    for g in groups[:limit]:
        what = f"{g.modules} module{'s' * (g.modules != 1)}, {g.tensors} tensor{'s' * (g.tensors != 1)}, "
        what += f"{g.elements:,} elements"
        lines.append(f"  {g.shape:<{width}}  {what}" + (f": {g.reason}" if g.reason else ""))
    if len(groups) > limit:
        lines.append(f"  ... and {len(groups) - limit} more groups")
    return lines


def describe_frozen(
    model: nn.Module, yaml_frozen: Sequence[str] = (), lora_adapted: Sequence[str] = (), limit: int = 12
) -> list[str]:
    """Lines for ``mm check``: the frozen parameters (none: no line) and why."""
    groups = frozen_groups(model, yaml_frozen, lora_adapted)
    if not groups:
        return []
    tensors, elements = sum(g.tensors for g in groups), sum(g.elements for g in groups)
    head = (
        f"frozen      : {elements:,} parameters in {tensors} tensor{'s' * (tensors != 1)} (no gradient, no "
        "optimizer state)"
    )
    return [head, *_rows(groups, limit)]


def no_gradient_groups(model: nn.Module) -> tuple[list[ParamGroup], int]:
    """After a backward: the trainable parameters whose ``.grad`` is None, grouped; and how many trainable
    tensors there are."""
    entries = []
    trainable = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        trainable += 1
        if param.grad is None:
            parent = name.rpartition(".")[0]
            entries.append((parent, path_shape(parent), param.numel(), ""))
    return _group(entries), trainable


def probe_gradients(model: nn.Module, batch: dict[str, Any], loss_cfg: Any) -> tuple[list[ParamGroup], int]:
    """One forward and backward of ``batch`` (on the model's device) with the trainer's loss: the model's own
    ``.loss`` for ``loss_type: raw``, else mm's loss of the logits against the shifted labels, plus the router
    load-balancing loss when ``router_aux_loss_coef`` is set. Returns :func:`no_gradient_groups`.

    ``loss_cfg`` is the ``model.loss_cfg`` block. Gradients already present are cleared first."""
    from mm_core.models.output import output_field
    from mm_core.parallel.experts import router_aux_for
    from mm_core.train.loss import loss_sum, shift_labels

    model.train()
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    aux = router_aux_for(model, loss_cfg)
    kwargs: dict[str, Any] = {"use_cache": False}
    if aux is not None and aux.coef:
        kwargs["output_router_logits"] = True
    if loss_cfg.loss_type == "raw":
        out = model(**batch, **kwargs)
        loss = output_field(out, "loss")
    else:
        targets = shift_labels(batch.pop("labels"))
        out = model(**batch, **kwargs)
        loss = loss_sum(output_field(out, "logits"), targets, loss_cfg.loss_type)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the forward of {type(model).__name__} gave no loss tensor to probe gradients with")
    if aux is not None and aux.coef:
        share, _ = aux(output_field(out, "router_logits"), batch.get("attention_mask"))
        loss = loss + aux.coef * share
    torch.autograd.backward([loss])
    return no_gradient_groups(model)


def describe_probe(groups: Sequence[ParamGroup], trainable: int, how: str, limit: int = 12) -> list[str]:
    """Lines for ``mm check --grad-probe``."""
    if not groups:
        return [f"gradients   : {how}: every one of the {trainable} trainable tensors got a gradient"]
    tensors = sum(g.tensors for g in groups)
    head = (
        f"gradients   : {how}: {tensors} of {trainable} trainable tensors got NO gradient (trained by "
        "nothing: freeze them with model.freeze, or find why the loss does not reach them)"
    )
    return [head, *_rows(groups, limit)]
