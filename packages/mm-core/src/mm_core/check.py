"""``mm check``: every validation of ``mm train`` without training, and the resolved plan.

Parameters that train nothing are listed: the frozen ones with the reason (``model.freeze`` or the model's
own policy), and, with ``mm check --grad-probe``, the trainable ones that one real micro-batch gives no
gradient (see :mod:`mm_core.models.nograd`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mm_core.config.schema import MMConfig, ModelConfig
from mm_core.config.support import check_supported
from mm_core.errors import ConfigError
from mm_core.models.hub import ModelHub
from mm_core.models.nograd import describe_frozen, describe_probe, probe_gradients
from mm_core.models.special_tokens import resize_embeddings, vocabulary_size
from mm_core.optim.factory import describe_optimizer, optimizer_plugin
from mm_core.parallel.apply import prepare_model
from mm_core.parallel.context import use_context_parallel_attention
from mm_core.parallel.estimate import MemoryBreakdown, estimate_breakdown, model_parts
from mm_core.parallel.memory import describe_features
from mm_core.parallel.plan import BuildPlan, plan_json
from mm_core.parallel.state import ParallelSizes, resolve_sizes
from mm_core.parallel.summary import tokens_per_micro_batch
from mm_core.preflight import run_preflight
from mm_core.registry import collator_register, data_register, import_plugins, optimizer_register
from mm_core.tasks.base import MAIN, Task, task_class
from mm_core.tasks.building import build_lines, build_settings, prepare_and_plan
from mm_parallel.device import detect_device_type

GiB = 2**30


def _numel(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def _print_expert_parallel(model: nn.Module, plan: BuildPlan, out: Callable[..., None]) -> None:
    """Which modules are expert-parallel, and which experts each rank computes."""
    from mm_core.parallel.experts import expert_layout

    names, sizes = list(plan.experts.names), plan.sizes
    if not names:
        return
    out(
        f"expert par. : ep={sizes.ep} x efsdp={sizes.efsdp}"
        + (f" x dp_replicate={sizes.dp_replicate}" if sizes.dp_replicate > 1 else "")
        + f", from {plan.experts.key}; "
        + (
            "each expert module is its own FSDP unit over efsdp; "
            f"dispatcher {plan.settings.parallel.ep_plan.dispatcher}"
            if sizes.ep > 1
            else "experts stay in their layer's FSDP unit (no exchange with ep=1)"
        )
    )
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} modules)" if len(names) > 3 else "")
    out(f"  expert-parallel modules          -> {shown}")
    for line in expert_layout(model, names, sizes):
        out(line)


#: what ``mm check`` prints about gradients when ``--grad-probe`` is not given
NOT_PROBED = (
    "gradients   : not probed; mm check --grad-probe runs one micro-batch forward and backward on CPU "
    "(the model at its configured size, randomly initialised) and lists trainable parameters that get no "
    "gradient"
)


def _first_micro_batch(cfg: MMConfig) -> dict[str, Any]:
    """The first micro-batch one data-parallel rank would train on (the configured dataset, collator and
    sampler; loader workers off), on the CPU."""
    from mm_core.data import build_collator, build_dataloader, build_dataset, move_to_device

    data = cfg.data.model_copy(deep=True)
    data.dataloader_param.num_workers = 0
    dataset = build_dataset(data, cfg.training.seed)
    loader = build_dataloader(
        dataset,
        build_collator(data, dataset),
        data,
        micro_batch_size=cfg.training.micro_batch_size,
        dp_size=1,
        dp_rank=0,
        seed=cfg.training.seed,
    )
    batch = next(iter(loader), None)
    if batch is None:
        raise ConfigError("mm check --grad-probe: the dataset yields no micro-batch to probe with")
    batch.pop("sample_id", None)
    batch.pop("skipped_samples", None)
    return move_to_device(batch, torch.device("cpu"))


def plan_on_meta(
    cfg: MMConfig, sizes: ParallelSizes, model_cfg: ModelConfig | None = None
) -> tuple[nn.Module, BuildPlan]:
    """The worker's pipeline up to sharding, on the meta device: build ``model_cfg`` (None: the YAML's
    ``model:``), ``model.freeze`` and LoRA, the build plan, and the context-parallel attention switch."""
    settings = build_settings(cfg, model_cfg)
    model = ModelHub.build(settings.model.model_copy(update={"from_scratch": True}), meta=True)
    if settings.main and settings.model.special_tokens:  # the shapes the worker resizes to
        resize_embeddings(model, vocabulary_size(cfg), mean_init=False)
    plan = prepare_and_plan(model, cfg, settings, sizes)
    if plan.context is not None:  # the same model checks the trainer makes for context parallelism
        use_context_parallel_attention(model, plan.context, plan.facts)
    return model, plan


def estimate_for_config(cfg: MMConfig, world_size: int, device_type: str = "cpu") -> MemoryBreakdown:
    """Build the model on meta, resolve its build plan for ``world_size`` ranks and estimate (no training)."""
    import_plugins(cfg.training.plugin)
    model, plan = plan_on_meta(cfg, resolve_sizes(cfg.parallel, world_size))
    moments = optimizer_plugin(cfg.training.optimizer).states_per_param
    return estimate_breakdown(
        model, plan, tokens_per_micro_batch(cfg.data, cfg.training.micro_batch_size), moments, device_type
    )


def grad_probe(cfg: MMConfig) -> list[str]:
    """``mm check --grad-probe``: build the model on the CPU (random initialisation: which parameters get a
    gradient does not depend on their values), apply ``model.freeze`` (and LoRA), run one micro-batch forward
    and backward with the trainer's loss, and report the trainable parameters left without a gradient."""
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}))
    prepare_model(model, cfg.model, cfg.training.lora)
    batch = _first_micro_batch(cfg)
    ids = batch.get("input_ids")
    size = (
        f"{ids.shape[0]} x {ids.shape[1]} tokens" if isinstance(ids, torch.Tensor) and ids.dim() == 2 else ""
    )
    groups, trainable = probe_gradients(model, batch, cfg.model.loss_cfg)
    how = (
        f"probed with the first micro-batch ({size + ', ' if size else ''}CPU, fp32, random init, 1 process)"
    )
    return describe_probe(groups, trainable, how)


def run_check(
    cfg: MMConfig, world_size: int, *, quiet: bool = False, probe_grads: bool = False, as_json: bool = False
) -> None:
    """Validate ``cfg`` for ``world_size`` ranks; print the plan unless ``quiet``. Raises MMError.

    ``probe_grads`` (``mm check --grad-probe``) also runs :func:`grad_probe` (a real forward and
    backward on the CPU: as costly as the model is large). ``as_json`` (``mm check --json``) prints one
    JSON object instead of the lines: the build plan, the parameter counts and the memory estimate."""
    out: Callable[..., None] = (lambda *a: None) if quiet or as_json else print
    check_supported(cfg)
    import_plugins(cfg.training.plugin)
    sizes = resolve_sizes(cfg.parallel, world_size)
    data_register.get(cfg.data.dataset_param.dataset_type)
    if cfg.data.eval_dataset_param is not None:  # (its data is verified by run_preflight below)
        data_register.get(cfg.data.eval_dataset_param.dataset_type)
    if cfg.data.dataloader_param.collate_param.name:
        collator_register.get(cfg.data.dataloader_param.collate_param.name)
    optimizer_register.get(cfg.training.optimizer)
    task = task_class(cfg.training.task)
    # every model the task builds (task_class checked it is a Task subclass)
    blocks = task.model_blocks(cfg) if isinstance(task, type) and issubclass(task, Task) else {MAIN: None}
    run_preflight(cfg, out)  # every path the run reads: data, tokenizer/processor, weights, training.load
    model, plan = plan_on_meta(cfg, sizes)
    moments = optimizer_plugin(cfg.training.optimizer).states_per_param
    mem = estimate_breakdown(
        model,
        plan,
        tokens_per_micro_batch(cfg.data, cfg.training.micro_batch_size),
        moments,
        detect_device_type(),
    )

    tcfg = cfg.training
    out(
        f"layout      : {sizes.layout} (world {sizes.world_size}: dp_replicate={sizes.dp_replicate}, "
        f"dp_shard={sizes.dp_shard}, cp={sizes.cp})"
    )
    out(f"model       : {cfg.model.model_id} -> {type(model).__name__}")
    total, trainable = _numel(model), _numel(model, trainable_only=True)
    out(f"parameters  : {total:,} total, {trainable:,} trainable, {total - trainable:,} frozen")
    for line in describe_frozen(model, plan.prepared.frozen, plan.prepared.lora):
        out(line)
    for line in grad_probe(cfg) if probe_grads else [NOT_PROBED]:
        out(line)
    out(f"model plan  : {type(model).__name__} (defaults for plans the YAML leaves out)")
    for line in plan.model_plan.describe():
        out(line)
    out(f"fsdp units  : from {plan.fsdp.key}")
    for pat, hits in plan.fsdp.matched.items():
        shown = ", ".join(hits[:3]) + (f", ... ({len(hits)} modules)" if len(hits) > 3 else "")
        out(f"  {pat:<32} -> {shown}")
    for group, note in plan.edges.notes:  # the embedding and the final norm + head (model plan)
        out(f"  {group:<32} -> {note}")
    out("  (root)                           -> the remaining parameters")
    _print_expert_parallel(model, plan, out)
    if plan.context is not None:
        out(plan.context.describe())
    out(f"model facts : {plan.facts.describe()}")
    if plan.prepared.lora:
        out(f"lora        : adapters on {len(plan.prepared.lora)} modules (training.lora.target_modules)")
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
    for line in describe_features(plan.memory, cfg.parallel.fsdp_plan):
        out(line)
    if plan.compile is not None:  # the trainer's plan, with its checks
        out(f"compile     : {plan.compile.describe()}")
    out(f"loss        : {cfg.model.loss_cfg.loss_type}; {plan.chunked.note}")
    out(
        f"memory/rank : {mem.total / GiB:.3f} GiB estimated peak = model states (params "
        f"{mem.params / GiB:.3f}, grads {mem.grads / GiB:.3f}, optimizer {mem.optimizer / GiB:.3f}) + "
        f"gathered units {mem.gathered / GiB:.3f} + activations {mem.activations / GiB:.3f} + backward "
        f"transient {mem.transient / GiB:.3f} (see docs/memory.md)"
    )
    for part in model_parts(model, plan.unit_groups, sizes.fsdp, moments):
        frozen_note = f", {part.params - part.trainable:,} frozen" if part.trainable < part.params else ""
        out(
            f"  {part.name:<30} {part.params:>14,} params{frozen_note}, {part.units} FSDP unit(s), "
            f"states {part.states / 2**20:,.1f} MiB/rank"
        )
    lines = describe_optimizer(model, tcfg, plan.model_plan)
    out(f"optimizer   : {lines[0]}")
    for line in lines[1:]:
        out(line)
    out(f"task        : {cfg.training.task}, models {', '.join(blocks)} (the worker logs the same lines)")
    built: dict[str, Any] = {}
    for name, block in blocks.items():
        m, p = (model, plan) if block is None else plan_on_meta(cfg, sizes, block)
        built[name] = plan_json(p)
        for line in build_lines(cfg, m, p):
            out(line)
    if as_json and not quiet:
        report = {
            "layout": sizes.layout,
            "world_size": sizes.world_size,
            "model": cfg.model.model_id,
            "parameters": {"total": total, "trainable": trainable, "frozen": total - trainable},
            "plan": plan_json(plan),
            "models": built,
            "memory_per_rank_bytes": {**vars(mem), "total": mem.total},
            "optimizer": lines,
        }
        print(json.dumps(report, indent=1))
