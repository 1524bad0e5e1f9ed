"""Model FLOPs of a training step, for ``tflops_per_s`` and ``mfu`` in ``metrics.jsonl``.

The count is the usual one for transformers (forward 2, backward 4 FLOPs per parameter and token through a
matrix product, so 6; attention scores and their weighted sum on top), taken from the model itself:

- **text**: every 2-D-or-more weight of the language model (attention, dense and shared-expert MLPs, routers,
  the output head) counts 6 per token; the token embedding does not (a lookup), unless the head is tied to
  it (then it counts once, as the head). Routed experts (``ModelPlan.expert_modules``) count only the share a
  token uses, ``top_k / experts`` (the model facts' experts per token over routed experts,
  :class:`~mm_core.models.facts.ModelFacts`).
- **attention**: ``12 × layers × (heads × head_dim) × context`` per token, with the context of a causal token
  half the micro-batch's (padded) sequence length.
- **vision**: the weights of the vision tower's units (``ModelPlan.fsdp_units`` outside
  ``cp_split_module``) count 6 per row that enters them, measured during the step by a forward pre-hook on
  each unit (rows = the input's elements over its last dimension), so images of any size count what they
  cost; the vision tower's attention is left out (a few percent at image sizes of a few thousand rows).

A layer that is not full attention (linear attention, sliding windows) is counted as full attention: the
figure is an upper bound there. ``mfu`` divides ``tflops_per_s`` (per device) by the device's peak: the
YAML's ``tools.peak_tflops``, else the table :data:`PEAK_TFLOPS` for the device name and the run's parameter
dtype; neither (a CPU, an unknown device, fp32 without a setting) leaves ``mfu`` out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mm_core.models.facts import ModelFacts
from mm_core.models.plan import plan_of
from mm_parallel.patterns import match_modules

if TYPE_CHECKING:
    from mm_core.parallel.plan import BuildPlan

#: dense bf16/fp16 tensor-core peak TFLOP/s per device, by a substring of ``torch.cuda.get_device_name()``
#: (vendor data sheets; SXM parts). Checked in order: the first substring found wins.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
)

#: the same for Ascend NPUs, by a substring of ``torch.npu.get_device_name()`` (torch_npu): Atlas A3 chips
#: (910C, reported as ``Ascend910_93xx``) 781 = 300 dense-BF16 PFLOP/s of a CloudMatrix 384 over its 384 chips
#: (SemiAnalysis, 2025); Atlas A2 chips (``Ascend910B1``..``B4``) 313, the figure published for the 910B class
#: (published figures range 280-376 by bin: set ``tools.peak_tflops`` for a measured one).
NPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("Ascend910_93", 781.0),
    ("Ascend910B", 313.0),
)


def device_name(device: torch.device) -> str:
    """The accelerator's product name (``torch.cuda``/``torch.npu``'s ``get_device_name``); "" elsewhere."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    if device.type == "npu":
        npu = getattr(torch, "npu", None)  # registered by torch_npu
        return str(npu.get_device_name(device)) if npu is not None else ""
    return ""


def peak_tflops(
    device: torch.device, param_dtype: torch.dtype | None, configured: float | None
) -> float | None:
    """The peak TFLOP/s one device of this run can reach: ``configured`` (``tools.peak_tflops``) when set,
    else the table's bf16/fp16 figure for a CUDA or Ascend device training in bf16 or fp16; None otherwise."""
    if configured:
        return float(configured)
    if device.type not in ("cuda", "npu") or param_dtype not in (torch.bfloat16, torch.float16):
        return None
    table = PEAK_TFLOPS if device.type == "cuda" else NPU_PEAK_TFLOPS
    name = device_name(device)
    return next((peak for key, peak in table if key in name), None)


def _matched(model: nn.Module, patterns: tuple[str, ...]) -> tuple[str, ...]:
    """Every match of ``patterns`` (none is fine), pattern by pattern."""
    return tuple(n for names in match_modules(model, patterns, allow_empty=True).values() for n in names)


def _numel(module: nn.Module, *, matrices_only: bool = True) -> int:
    # DTensor.numel() is the global size, so a sharded model counts as the whole model
    return sum(p.numel() for p in module.parameters() if not matrices_only or p.dim() >= 2)


@dataclass
class StepFlops:
    """What one token and one vision row cost; :meth:`forward_flops` counts one micro-batch."""

    text_params: float  # matrix weights a text token goes through (routed experts at their active share)
    attn_layers: int
    attn_width: int  # query heads × head_dim
    vision_units: list[tuple[nn.Module, int]]  # (unit, its matrix weights)
    vision_rows: int = 0  # rows that entered vision units during the current forward

    @classmethod
    def of(cls, model: nn.Module, plan: BuildPlan | None = None) -> StepFlops:
        """Count ``model`` (built, sharded or not) and hook its vision units. ``plan``: the model's build plan
        (its model plan, facts and default-plan matches are read from it); None resolves them here."""
        if plan is not None:
            mplan, facts = plan.model_plan, plan.facts
            routed, units = plan.default_experts, plan.default_units
        else:
            mplan, facts = plan_of(model), ModelFacts.of(model)
            routed = _matched(model, mplan.expert_modules)
            units = _matched(model, mplan.fsdp_units)
        split = mplan.cp_split_module
        try:
            language = model.get_submodule(split) if split else model
        except AttributeError:  # a plan naming no module: refused where the split is used (context parallel)
            language, split = model, None
        counted = {id(p): p.numel() for p in language.parameters() if p.dim() >= 2}
        get_embed: Any = getattr(model, "get_input_embeddings", None)
        get_head: Any = getattr(model, "get_output_embeddings", None)
        embed_w = getattr(get_embed() if callable(get_embed) else None, "weight", None)
        head_w = getattr(get_head() if callable(get_head) else None, "weight", None)
        if isinstance(embed_w, torch.Tensor):
            counted.pop(id(embed_w), None)  # a lookup, not a product
        if isinstance(head_w, torch.Tensor):
            counted[id(head_w)] = head_w.numel()  # the head, tied or not: a product per token
        text = float(sum(counted.values()))
        if mplan.expert_modules:
            experts = sum(_numel(model.get_submodule(name)) for name in routed)
            total, top_k = facts.num_experts, facts.experts_per_token
            if experts and total and top_k:
                text -= experts * (1.0 - float(top_k) / float(total))
        heads, head_dim, layers = facts.num_heads, facts.head_dim, facts.num_layers
        vision: list[tuple[nn.Module, int]] = []
        if split:
            prefix = split + "."
            for name in units:
                if not name.startswith(prefix):
                    unit = model.get_submodule(name)
                    vision.append((unit, _numel(unit)))
        counter = cls(float(text), layers, heads * int(head_dim), vision)
        for unit, _ in vision:
            unit.register_forward_pre_hook(counter._count_rows, with_kwargs=True)
        return counter

    def _count_rows(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            self.vision_rows += x.numel() // max(x.shape[-1], 1)

    def forward_flops(
        self, forward: Callable[[], Any], tokens: torch.Tensor, context: int, vision_share: float = 1.0
    ) -> tuple[Any, torch.Tensor]:
        """Run ``forward()`` (one micro-batch); return its result and its training FLOPs (a tensor beside
        ``tokens``, no host sync): ``tokens`` text tokens attending over sequences of ``context`` positions,
        plus the rows the forward fed the vision units (counted during this forward only: a recompute in
        the backward is not model work) times ``vision_share`` (1 / the ranks that run the same vision
        tower, e.g. under context parallelism)."""
        self.vision_rows = 0
        out = forward()
        rows, self.vision_rows = self.vision_rows, 0
        attention = 12.0 * self.attn_layers * self.attn_width * (context / 2.0)
        flops = tokens.to(torch.float64) * (6.0 * self.text_params + attention)
        if self.vision_units:  # the tower's units run in sequence on the same rows: rows per unit × weights
            per_unit = rows / len(self.vision_units)
            flops += 6.0 * per_unit * sum(n for _, n in self.vision_units) * vision_share
        return out, flops
