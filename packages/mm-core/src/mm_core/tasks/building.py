"""Building a model of a task through the plan contract: the same path for the main model and for every
other model a task trains (a discriminator, a second stage), so each gets the run's parallel layout.

:func:`build_model` builds from a ``model:`` block (``ModelHub``: an ``mm.models`` plugin or a Hugging Face
class), on the meta device unless ``training.init_model_with_meta_device`` resolves to false (``auto``,
the default: on meta whenever the model can be filled there, :func:`~mm_core.parallel.apply.meta_init`),
freezes ``model.freeze``, shards it with FSDP2 over the run's mesh (units, recompute, offload, expert
parallelism from the model's plan or the YAML) and fills its weights: from the checkpoint the run resumes
from, else from ``model.model_name_or_path``, else a fresh initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mm_core.config.schema import LoraConfig, MMConfig, ModelConfig, ParallelConfig
from mm_core.errors import ConfigError
from mm_core.models.device_kernels import use_device_kernels
from mm_core.models.hub import ModelHub, has_weights
from mm_core.models.special_tokens import resize_embeddings, vocabulary_size
from mm_core.parallel.apply import (
    check_initialised,
    materialize_meta,
    meta_init,
    prepare_model,
    shard_model,
)
from mm_core.parallel.plan import BuildPlan, BuildSettings, resolve_build
from mm_core.parallel.state import ParallelSizes
from mm_core.parallel.summary import describe_build, tokens_per_micro_batch
from mm_core.tasks.base import MAIN, TaskContext


@dataclass
class BuiltModel:
    """A sharded model, the build plan it was sharded by, and its gathering plan (FSDP hook groups,
    prefetch; None when the YAML asks for none), whose ``pregather()`` may be called after each step
    (``parallel.fsdp_plan.pregather``)."""

    model: nn.Module
    gather_plan: Any
    plan: BuildPlan


def build_settings(cfg: MMConfig, model_cfg: ModelConfig | None = None) -> BuildSettings:
    """The config parts the build of ``model_cfg`` reads (None: the YAML's ``model:``, the main model).
    Another model of a task takes its FSDP units from its own plan (``parallel.fsdp_plan.apply_modules``
    and ``ignored_modules`` name the main model's modules), computes its own loss (no chunked loss) and gets
    no LoRA adapters."""
    main = model_cfg is None
    return BuildSettings(
        cfg.parallel, cfg.model if model_cfg is None else model_cfg, cfg.training.compile, main
    )


def built_on_meta(cfg: MMConfig, settings: BuildSettings) -> bool:
    """Whether the model of ``settings`` is built on the meta device
    (:func:`~mm_core.parallel.apply.meta_init` of ``training.init_model_with_meta_device``)."""
    return meta_init(cfg.training.init_model_with_meta_device, settings.model, lora_of(cfg, settings))[0]


def lora_of(cfg: MMConfig, settings: BuildSettings) -> LoraConfig | None:
    """``training.lora`` for the main model; None (no adapters) for another model of a task."""
    return cfg.training.lora if settings.main else None


def materialize_device(parallel: ParallelConfig, device: torch.device) -> torch.device:
    """Where the shards of a model built on the meta device are allocated: on the host with
    ``parallel.fsdp_plan.cpu_offload`` (FSDP2's CPU offload keeps sharded parameters there and moves each
    unit to ``device`` only while it computes), else on the run's ``device``."""
    return torch.device("cpu") if parallel.fsdp_plan.cpu_offload else device


def prepare_and_plan(
    model: nn.Module, cfg: MMConfig, settings: BuildSettings, sizes: ParallelSizes
) -> BuildPlan:
    """``model.freeze`` and LoRA (the main model only), then the build plan: the steps a worker takes before
    sharding, which ``mm check`` takes too."""
    prepared = prepare_model(
        model, settings.model, lora_of(cfg, settings), meta_init=built_on_meta(cfg, settings)
    )
    return resolve_build(model, settings, sizes, prepared)


def build_model(ctx: TaskContext, model_cfg: ModelConfig | None = None) -> BuiltModel:
    """Build, freeze, shard and fill one model of the run (module docstring); ``model_cfg`` None builds the
    YAML's ``model:``."""
    settings = build_settings(ctx.cfg, model_cfg)
    mcfg = settings.model
    meta = built_on_meta(ctx.cfg, settings)
    model = ModelHub.build(mcfg, meta=meta)
    if settings.main and mcfg.special_tokens:
        path = mcfg.model_name_or_path
        if meta and ctx.load_path is None and not mcfg.from_scratch and path and has_weights(path):
            raise ConfigError(
                "model.special_tokens with training.init_model_with_meta_device: true and weights from "
                f"model.model_name_or_path ({path}): the new embedding rows take the mean of the loaded "
                "ones, which needs the whole model; set training.init_model_with_meta_device: auto or false"
            )
        note = resize_embeddings(model, vocabulary_size(ctx.cfg), mean_init=not meta)
        if note:
            ctx.build_log.append(note)
    plan = prepare_and_plan(model, ctx.cfg, settings, ctx.state.sizes)
    switched = use_device_kernels(model, ctx.device.type)  # Ascend: RMSNorm through torch_npu's fused kernel
    if switched:
        ctx.build_log.append(
            f"kernels: {len(switched)} RMSNorm modules ({', '.join(plan.model_plan.rms_norm_classes)}) use "
            f"mm_parallel.kernels' rms_norm on {ctx.device.type}"
        )
    if not meta:
        model.to(ctx.device)
    model, gather_plan = shard_model(model, plan, ctx.state)
    if meta:
        weights_from_load = ctx.load_path is not None
        path = mcfg.model_name_or_path
        hf_weights = bool(not mcfg.from_scratch and path and has_weights(path))
        materialize_meta(
            model,
            materialize_device(plan.settings.parallel, ctx.device),
            init=not (weights_from_load or hf_weights),
            model_plan=plan.model_plan,
            seed=ctx.cfg.training.seed,
        )
        if hf_weights and not weights_from_load:
            from mm_core.convert import load_hf_weights

            assert path is not None  # hf_weights implies it
            load_hf_weights(model, path)
            check_initialised(model)
    model.train()
    ctx.build_log.extend(build_lines(ctx.cfg, model, plan))
    return BuiltModel(model, gather_plan, plan)


def build_lines(cfg: MMConfig, model: nn.Module, plan: BuildPlan) -> list[str]:
    """:func:`~mm_core.parallel.summary.describe_build` of one model of the run: named ``model`` (the main
    one) or by its ``model_id``."""
    from mm_core.optim.factory import optimizer_plugin

    name = MAIN if plan.settings.main else plan.settings.model.model_id
    tokens = tokens_per_micro_batch(cfg.data, cfg.training.micro_batch_size)
    moments = optimizer_plugin(cfg.training.optimizer).states_per_param
    setting = cfg.training.init_model_with_meta_device
    why = meta_init(setting, plan.settings.model, lora_of(cfg, plan.settings))[1]
    return [*describe_build(name, model, plan, tokens, moments), f"build {name}: {why}"]
