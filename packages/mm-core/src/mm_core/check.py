"""``mm check``: every validation of ``mm train`` without training, and the resolved plan."""

from __future__ import annotations

from torch import nn

from mm_core.config.schema import MMConfig
from mm_core.config.support import check_supported
from mm_core.models.hub import ModelHub
from mm_core.models.plan import plan_of
from mm_core.optim.factory import describe_optimizer
from mm_core.parallel.apply import apply_freeze, fsdp_patterns, resolve_patterns
from mm_core.parallel.estimate import estimate_breakdown
from mm_core.parallel.memory import describe_features, hook_groups, plan_memory_features
from mm_core.parallel.state import ParallelSizes, resolve_sizes
from mm_core.preflight import run_preflight
from mm_core.registry import collator_register, data_register, import_plugins, optimizer_register
from mm_parallel.device import detect_device_type

GiB = 2**30


def _numel(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def _print_expert_parallel(model: nn.Module, cfg: MMConfig, sizes: ParallelSizes, out) -> list[str]:
    """Which modules are expert-parallel, and which experts each rank computes; returns the modules that are
    FSDP units of their own (over efsdp, when ep > 1)."""
    from mm_core.parallel.experts import expert_layout, expert_modules

    names, source = expert_modules(model, cfg, sizes)
    if not names:
        return []
    out(
        f"expert par. : ep={sizes.ep} x efsdp={sizes.efsdp}"
        + (f" x dp_replicate={sizes.dp_replicate}" if sizes.dp_replicate > 1 else "")
        + f", from {source}; "
        + (
            "each expert module is its own FSDP unit over efsdp; "
            f"dispatcher {cfg.parallel.ep_plan.dispatcher}"
            if sizes.ep > 1
            else "experts stay in their layer's FSDP unit (no exchange with ep=1)"
        )
    )
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} modules)" if len(names) > 3 else "")
    out(f"  expert-parallel modules          -> {shown}")
    for line in expert_layout(model, names, sizes):
        out(line)
    return names if sizes.ep > 1 else []


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
    run_preflight(cfg, out)  # every path the run reads: data, tokenizer/processor, weights, training.load
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=True)
    frozen = apply_freeze(model, cfg.model.freeze)
    if sizes.cp > 1:  # the same model checks the trainer makes for context parallelism
        from mm_core.parallel.context import use_context_parallel_attention

        use_context_parallel_attention(model, cfg, sizes)
    patterns, source = fsdp_patterns(model, cfg)
    matched = resolve_patterns(model, patterns, source)
    if cfg.parallel.fsdp_plan.ignored_modules:
        resolve_patterns(model, cfg.parallel.fsdp_plan.ignored_modules, "parallel.fsdp_plan.ignored_modules")
    units = sorted({n for hits in matched.values() for n in hits})
    feats = plan_memory_features(model, cfg)
    mem = estimate_breakdown(
        model, cfg, sizes.fsdp, units, feats.recompute, feats.offload, detect_device_type()
    )

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
    out(f"model plan  : {type(model).__name__} (defaults for plans the YAML leaves out)")
    for line in plan_of(model).describe():
        out(line)
    out(f"fsdp units  : from {source}")
    for pat, hits in matched.items():
        shown = ", ".join(hits[:3]) + (f", ... ({len(hits)} modules)" if len(hits) > 3 else "")
        out(f"  {pat:<32} -> {shown}")
    out("  (root)                           -> the remaining parameters")
    expert_units = _print_expert_parallel(model, cfg, sizes, out)
    if cfg.parallel.fsdp_plan.hook_modules:  # the trainer's check, on the same units
        hook_groups(model, list(cfg.parallel.fsdp_plan.hook_modules), units + expert_units)
    budget = cfg.data.dataloader_param.max_tokens_per_batch
    if budget is not None:
        out(
            f"batch       : token budget {budget:,} per micro-batch (padded) "
            f"x accumulation {tcfg.grad_accum} "
            f"x dp {sizes.dp} = at most {budget * tcfg.grad_accum * sizes.dp:,} tokens per step "
            "(training.micro_batch_size is not used)"
        )
    else:
        gbs = tcfg.micro_batch_size * tcfg.grad_accum * sizes.dp
        out(
            f"batch       : micro {tcfg.micro_batch_size} x accumulation {tcfg.grad_accum} x dp {sizes.dp} "
            f"= {gbs} samples per step"
        )
    for line in describe_features(feats, cfg):
        out(line)
    out(
        f"memory/rank : {mem.total / GiB:.3f} GiB estimated peak = model states (params "
        f"{mem.params / GiB:.3f}, grads {mem.grads / GiB:.3f}, optimizer {mem.optimizer / GiB:.3f}) + "
        f"gathered units {mem.gathered / GiB:.3f} + activations {mem.activations / GiB:.3f} + backward "
        f"transient {mem.transient / GiB:.3f} (see docs/memory.md)"
    )
    lines = describe_optimizer(model, tcfg, plan_of(model))
    out(f"optimizer   : {lines[0]}")
    for line in lines[1:]:
        out(line)
