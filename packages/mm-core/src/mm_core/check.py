"""``mm check``: every validation of ``mm train`` without training, and the resolved plan."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mm_core.config.schema import MMConfig
from mm_core.config.support import check_supported
from mm_core.models.hub import ModelHub
from mm_core.parallel_state import ParallelSizes, resolve_sizes
from mm_core.parallelize import apply_freeze, fsdp_patterns, resolve_patterns, to_dtype
from mm_core.registry import collator_register, data_register, import_plugins, optimizer_register

GiB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes per rank: model states (sharded) and the largest gathered FSDP unit."""

    params: float
    grads: float
    optimizer: float
    gathered: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered


def _numel(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def estimate_memory(
    model: nn.Module, cfg: MMConfig, sizes: ParallelSizes, unit_names: list[str]
) -> MemoryEstimate:
    """Model-state memory per rank: fp32 master weights, grads and AdamW moments sharded over the FSDP
    group, plus two gathered units (current + prefetched) in ``param_dtype``. Activations are not included."""
    total, trainable = _numel(model), _numel(model, trainable_only=True)
    shard = sizes.fsdp
    param_bytes = to_dtype(cfg.parallel.fsdp_plan.param_dtype).itemsize
    modules = dict(model.named_modules())
    # the root unit holds what no other unit holds
    inner = sum(_numel(modules[n]) for n in unit_names if n)
    biggest = max([_numel(modules[n]) for n in unit_names if n] + [total - inner])
    return MemoryEstimate(
        params=4 * total / shard,
        grads=4 * trainable / shard,
        optimizer=8 * trainable / shard,
        gathered=0 if shard == 1 else 2 * biggest * param_bytes,
    )


def run_check(cfg: MMConfig, world_size: int, *, quiet: bool = False) -> None:
    """Validate ``cfg`` for ``world_size`` ranks; print the plan unless ``quiet``. Raises MMError."""
    out = (lambda *a: None) if quiet else print
    check_supported(cfg)
    import_plugins(cfg.training.plugin)
    sizes = resolve_sizes(cfg.parallel, world_size)
    data_register.get(cfg.data.dataset_param.dataset_type)
    if cfg.data.dataloader_param.collate_param.name:
        collator_register.get(cfg.data.dataloader_param.collate_param.name)
    optimizer_register.get(cfg.training.optimizer)
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=True)
    frozen = apply_freeze(model, cfg.model.freeze)
    patterns, source = fsdp_patterns(model, cfg)
    matched = resolve_patterns(model, patterns, source)
    if cfg.parallel.fsdp_plan.ignored_modules:
        resolve_patterns(model, cfg.parallel.fsdp_plan.ignored_modules, "parallel.fsdp_plan.ignored_modules")
    units = sorted({n for hits in matched.values() for n in hits})
    mem = estimate_memory(model, cfg, sizes, units)

    tcfg = cfg.training
    out(
        f"layout      : {sizes.layout} (world {sizes.world_size}: dp_replicate={sizes.dp_replicate}, "
        f"dp_shard={sizes.dp_shard}, cp={sizes.cp})"
    )
    out(f"model       : {cfg.model.model_id} -> {type(model).__name__}")
    total, trainable = _numel(model), _numel(model, trainable_only=True)
    out(f"parameters  : {total:,} total, {trainable:,} trainable, {total - trainable:,} frozen")
    if frozen:
        more = " ..." if len(frozen) > 4 else ""
        out(f"frozen      : {len(frozen)} modules ({', '.join(frozen[:4])}{more})")
    out(f"fsdp units  : from {source}")
    for pat, hits in matched.items():
        shown = ", ".join(hits[:3]) + (f", ... ({len(hits)} modules)" if len(hits) > 3 else "")
        out(f"  {pat:<32} -> {shown}")
    out("  (root)                           -> the remaining parameters")
    gbs = tcfg.micro_batch_size * tcfg.grad_accum * sizes.dp
    out(
        f"batch       : micro {tcfg.micro_batch_size} x accumulation {tcfg.grad_accum} x dp {sizes.dp} "
        f"= {gbs} samples per step"
    )
    out(
        f"memory/rank : {mem.total / GiB:.3f} GiB model states (params {mem.params / GiB:.3f}, grads "
        f"{mem.grads / GiB:.3f}, optimizer {mem.optimizer / GiB:.3f}, gathered units "
        f"{mem.gathered / GiB:.3f}); activations not included"
    )
    if tcfg.optimizer == "muon":
        from mm_core.models.hub import model_plans
        from mm_core.optim.muon import muon_plan, split_summary

        lines = split_summary(muon_plan(model, tcfg, model_plans(model)))
        out(f"optimizer   : {lines[0]}")
        for line in lines[1:]:
            out(line)
