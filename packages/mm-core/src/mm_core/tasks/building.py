"""Building a model of a task through the plan contract: the same path for the main model and for every
other model a task trains (a discriminator, a second stage), so each gets the run's parallel layout.

:func:`build_model` builds from a ``model:`` block (``ModelHub``: an ``mm.models`` plugin or a Hugging Face
class), on the meta device when ``training.init_model_with_meta_device`` is set, freezes
``model.freeze``, shards it with FSDP2 over the run's mesh (units, recompute, offload, expert parallelism
from the model's plan or the YAML) and fills its weights: from the checkpoint the run resumes from, else
from ``model.model_name_or_path``, else a fresh initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from mm_core.config.schema import MMConfig, ModelConfig
from mm_core.models.hub import ModelHub, has_weights
from mm_core.parallel.apply import apply_freeze, check_initialised, materialize_meta, shard_model
from mm_core.tasks.base import TaskContext


@dataclass
class BuiltModel:
    """A sharded model and its gathering plan (FSDP hook groups, prefetch; None when the YAML asks for
    none), whose ``pregather()`` may be called after each step (``parallel.fsdp_plan.pregather``)."""

    model: nn.Module
    gather_plan: Any


def config_for(ctx: TaskContext, model_cfg: ModelConfig | None) -> MMConfig:
    """The run's config for building ``model_cfg`` (None: the YAML's ``model:``). Another model of a task
    takes its FSDP units from its own plan (``parallel.fsdp_plan.apply_modules`` and ``ignored_modules``
    name the main model's modules), computes its own loss (no chunked loss) and gets no LoRA adapters."""
    cfg = ctx.cfg
    if model_cfg is None:
        return cfg
    fsdp = cfg.parallel.fsdp_plan.model_copy(update={"apply_modules": [], "ignored_modules": []})
    loss = model_cfg.loss_cfg.model_copy(update={"chunked_loss": False})
    lora = cfg.training.lora.model_copy(update={"enable": False})
    return cfg.model_copy(
        update={
            "model": model_cfg.model_copy(update={"loss_cfg": loss}),
            "parallel": cfg.parallel.model_copy(update={"fsdp_plan": fsdp}),
            "training": cfg.training.model_copy(update={"lora": lora}),
        }
    )


def build_model(ctx: TaskContext, model_cfg: ModelConfig | None = None) -> BuiltModel:
    """Build, freeze, shard and fill one model of the run (module docstring); ``model_cfg`` None builds the
    YAML's ``model:``."""
    cfg = config_for(ctx, model_cfg)
    mcfg = cfg.model
    meta = cfg.training.init_model_with_meta_device
    model = ModelHub.build(mcfg, meta=meta)
    apply_freeze(model, mcfg.freeze)
    if not meta:
        model.to(ctx.device)
    model, gather_plan = shard_model(model, cfg, ctx.state)
    if meta:
        weights_from_load = ctx.load_path is not None
        path = mcfg.model_name_or_path
        hf_weights = bool(not mcfg.from_scratch and path and has_weights(path))
        materialize_meta(model, ctx.device, init=not (weights_from_load or hf_weights))
        if hf_weights and not weights_from_load:
            from mm_core.convert import load_hf_weights

            assert path is not None  # hf_weights implies it
            load_hf_weights(model, path)
            check_initialised(model)
    model.train()
    return BuiltModel(model, gather_plan)
