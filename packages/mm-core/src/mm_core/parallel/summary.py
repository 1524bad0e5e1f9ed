"""The build of one model in a few lines, the same in ``mm check`` and in a worker's log: parameter counts
(after ``model.freeze`` and LoRA), FSDP and expert units, the loss head and the per-rank memory estimate,
all read from the :class:`~mm_core.parallel.plan.BuildPlan`."""

from __future__ import annotations

from torch import nn

from mm_core.config.schema import DataConfig
from mm_core.parallel.estimate import estimate_breakdown
from mm_core.parallel.plan import BuildPlan

GiB = 2**30


def tokens_per_micro_batch(data: DataConfig, micro_batch_size: int) -> int:
    """The padded tokens of one micro-batch: ``data.dataloader_param.max_tokens_per_batch`` when set, else
    ``training.micro_batch_size`` x the configured length (``seq_len`` or ``cutoff_len``; 0 when unknown)."""
    budget = data.dataloader_param.max_tokens_per_batch
    if budget is not None:
        return int(budget)
    basic = data.dataset_param.basic_parameters
    seq = basic.get("seq_len") or basic.get("cutoff_len") or 0
    return micro_batch_size * int(seq)


def describe_build(name: str, model: nn.Module, plan: BuildPlan, tokens: int, moments: float) -> list[str]:
    """Lines naming model ``name`` of a task (``model``: the main one): what its build plan gives, counted on
    ``model`` as built (on meta in ``mm check``, sharded in a worker: parameters count whole either way).
    ``tokens``: one micro-batch's padded tokens; ``moments``: optimizer states per trainable parameter."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mem = estimate_breakdown(model, plan, tokens, moments)
    head = f"build {name}: "
    experts = len(plan.experts.names)
    return [
        f"{head}{plan.facts.class_name}, {total:,} parameters, {trainable:,} trainable, "
        f"{total - trainable:,} frozen ({len(plan.prepared.frozen)} modules by model.freeze, "
        f"LoRA adapters on {len(plan.prepared.lora)})",
        f"{head}{len(plan.fsdp.names)} FSDP units from {plan.fsdp.key}, {len(plan.edges.groups)} for the "
        f"embedding / final norm + head (model plan) and the root; {experts} "
        f"expert-parallel modules (ep={plan.sizes.ep})",
        f"{head}{plan.chunked.note}",
        f"{head}{mem.total / GiB:.4f} GiB per rank estimated (CPU), model states "
        f"{(mem.params + mem.grads + mem.optimizer) / GiB:.4f}",
    ]
