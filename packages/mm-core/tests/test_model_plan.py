"""The model-plan contract (``mm_core.models.plan``): one frozen ``ModelPlan`` per model class, read by every
consumer through ``plan_of``; legacy ``mm_*`` class attributes still work; optimizer plugins carry their own
clipping policy, ``mm check`` summary and state size; Muon exclusions use mm's one pattern language."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from mm_core.config.loader import validate_config
from mm_core.config.schema import TrainingConfig
from mm_core.errors import ConfigError
from mm_core.models import BaseModel, ModelPlan, plan_of
from mm_core.optim import (
    BuiltOptimizer,
    OptimizerPlugin,
    build_optimizer,
    describe_optimizer,
    optimizer_plugin,
)
from mm_core.optim.muon import muon_plan
from mm_core.parallel.estimate import estimate_breakdown
from mm_core.parallel.plan import resolve_build
from mm_core.parallel.state import ParallelSizes
from mm_core.registry import optimizer_register
from mm_core.tasks.building import build_settings
from mm_parallel.moe import ExpertParallelExperts


class _Adapter(ExpertParallelExperts):
    """An expert adapter a model may name in its plan."""


def _init_hook(model: nn.Module) -> None:
    model.hooked = True


class Block(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, 4, bias=False)
        self.mlp = nn.Linear(hidden, hidden)


class Planned(nn.Module, BaseModel):
    """A custom model declaring every field of its plan in one place."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("blocks.{*}",),
        recompute_units=("blocks.{0-1}",),
        expert_modules=("blocks.{*}.mlp",),
        expert_adapter=_Adapter,
        cp_split_module="blocks",
        cp_packed_inputs=(("features", "feature_mask"),),
        muon_exclude_modules=("blocks.{*}.gate",),
        init_weights=_init_hook,
    )

    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(8)

    @classmethod
    def _from_config(cls, args: Any) -> Planned:
        return cls()

    @classmethod
    def from_pretrained(cls, args: Any) -> Planned:
        return cls()


class Unplanned(Planned):
    mm_plan: ClassVar[ModelPlan] = ModelPlan()


def _cfg(**training: Any) -> Any:
    raw: dict[str, Any] = {
        "data": {"dataset_param": {"dataset_type": "text_pretrain"}},
        "model": {"model_id": "qwen3", "recompute": True},
        "training": {"train_iters": 1, **training},
    }
    return validate_config(raw)


def test_plan_is_frozen_typed_and_validated() -> None:
    plan = ModelPlan(fsdp_units=["a.{*}"], cp_split_module="a", cp_packed_inputs={"x": "m"})  # type: ignore[arg-type]
    assert plan.fsdp_units == ("a.{*}",) and plan.cp_packed_inputs == (("x", "m"),)
    assert plan.cp_packed == {"x": "m"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fsdp_units = ()  # type: ignore[misc]
    assert hash(plan) == hash(
        ModelPlan(fsdp_units=("a.{*}",), cp_split_module="a", cp_packed_inputs=(("x", "m"),))
    )
    with pytest.raises(ValueError, match=r"ModelPlan.recompute_units: pattern 'layers.\{x\}'"):
        ModelPlan(recompute_units=("layers.{x}",))
    with pytest.raises(TypeError, match="ModelPlan.fsdp_units: give a tuple"):
        ModelPlan(fsdp_units="layers.{*}")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cp_packed_inputs needs cp_split_module"):
        ModelPlan(cp_packed_inputs=(("x", "m"),))
    with pytest.raises(TypeError, match="expert_adapter.*ExpertParallelExperts"):
        ModelPlan(expert_adapter=nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="init_weights"):
        ModelPlan(init_weights="reset")  # type: ignore[arg-type]
    assert ModelPlan(rms_norm_classes=["LlamaRMSNorm"]).rms_norm_classes == ("LlamaRMSNorm",)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rms_norm_classes: give a tuple of class names"):
        ModelPlan(rms_norm_classes="LlamaRMSNorm")  # type: ignore[arg-type]


def test_plan_of_reads_the_declared_plan_or_defaults() -> None:
    assert plan_of(Planned()) is Planned.mm_plan and plan_of(Planned) is Planned.mm_plan
    # a model that declares nothing (any object: HF model, plain module, a stand-in) gets the defaults
    for model in (nn.Linear(2, 2), SimpleNamespace(config=None), Unplanned()):
        assert plan_of(model) == ModelPlan()
    lines = Planned.mm_plan.describe()
    assert lines[0].split() == ["fsdp_units", "blocks.{*}"]
    assert "(adapter _Adapter)" in lines[2] and "packed features by feature_mask" in lines[3]
    assert lines[-1].split()[-1].endswith("_init_hook")

    class Bad(nn.Module):
        mm_plan = {"fsdp": ["x"]}

    with pytest.raises(ConfigError, match="Bad.mm_plan: expected an mm_core.models.ModelPlan, got dict"):
        plan_of(Bad())


_ONE = ParallelSizes(world_size=1, dp_replicate=1, dp_shard=1)


def test_every_consumer_reads_the_declared_plan() -> None:
    model, cfg = Planned(), _cfg()
    plan = resolve_build(model, build_settings(cfg), _ONE)
    assert plan.fsdp.key == "default plan of Planned" and list(plan.fsdp.matched) == ["blocks.{*}"]
    assert plan.experts.key == "default ep plan of Planned"
    assert plan.memory.recompute == ("blocks.0", "blocks.1")
    split = muon_plan(model, cfg.training, plan_of(model))
    assert {d.name for d in split.decisions if not d.use_muon and "excluded module" in d.reason} == {
        f"blocks.{i}.gate.weight" for i in range(3)
    }
    # a model without a plan: no default units, so a recompute YAML without modules is an error naming it
    with pytest.raises(
        ConfigError, match=r"Unplanned declares no default plan \(ModelPlan.recompute_units\)"
    ):
        resolve_build(Unplanned(), build_settings(cfg), _ONE)
    no_recompute = cfg.model.model_copy(update={"recompute": False})
    unplanned = resolve_build(Unplanned(), build_settings(cfg, no_recompute), _ONE)
    assert unplanned.fsdp.key == "default plan of Unplanned" and not unplanned.fsdp.matched
    assert "blocks.0.gate.weight" in muon_plan(Unplanned(), cfg.training, plan_of(Unplanned())).muon_names


def test_optimizer_plugins_carry_their_clipping_policy_and_summary() -> None:
    model = Planned()
    adamw = build_optimizer(model, _cfg().training, plan_of(model))
    assert isinstance(adamw, BuiltOptimizer) and isinstance(adamw.optimizer, torch.optim.AdamW)
    assert adamw.clip_scale_only is None  # a bare factory: clipping scales every gradient
    assert describe_optimizer(model, _cfg().training, plan_of(model)) == [
        f"adamw over {len(list(model.parameters()))} tensors ({sum(p.numel() for p in model.parameters()):,} "
        "elements)"
    ]
    muon_cfg = _cfg(optimizer="muon", muon={"ns_dtype": "fp32"}).training
    assert build_optimizer(model, muon_cfg, plan_of(model)).clip_scale_only is None  # clip_muon_params: true
    off = _cfg(optimizer="muon", muon={"clip_muon_params": False}).training
    built = build_optimizer(model, off, plan_of(model))
    adamw_ids = {id(p) for g in built.optimizer.param_groups if not g["use_muon"] for p in g["params"]}
    assert built.clip_scale_only is not None
    assert {id(p) for p in model.parameters() if built.clip_scale_only(p)} == adamw_ids
    assert id(model.blocks[0].attn.weight) not in adamw_ids and id(model.blocks[0].gate.weight) in adamw_ids
    head = describe_optimizer(model, muon_cfg, plan_of(model))[0]
    assert head.startswith("muon ") and "adamw" in head
    assert optimizer_plugin("muon").states_per_param == 1 and optimizer_plugin("adamw").states_per_param == 2


def test_a_registered_optimizer_plugin_is_used_through_its_hooks_only() -> None:
    seen: list[ModelPlan] = []

    def build(model: nn.Module, cfg: TrainingConfig, plan: ModelPlan) -> torch.optim.Optimizer:
        seen.append(plan)
        return torch.optim.SGD(model.parameters(), lr=cfg.lr)

    plugin = OptimizerPlugin(
        build=build,
        clip_policy=lambda opt, cfg: lambda p: p.ndim == 1,
        describe=lambda model, cfg, plan: ["sgd-ish, one line", "  and a second"],
        states_per_param=0,
    )
    optimizer_register.register("plan_test_sgd")(plugin)
    try:
        cfg = _cfg(optimizer="plan_test_sgd")
        model = Planned()
        built = build_optimizer(model, cfg.training, plan_of(model))
        assert seen == [Planned.mm_plan] and isinstance(built.optimizer, torch.optim.SGD)
        assert built.clip_scale_only is not None and built.clip_scale_only(model.norm.bias)
        assert not built.clip_scale_only(model.embed.weight)
        assert describe_optimizer(model, cfg.training, plan_of(model)) == [
            "sgd-ish, one line",
            "  and a second",
        ]
        moments = optimizer_plugin(cfg.training.optimizer).states_per_param
        assert (
            estimate_breakdown(model, resolve_build(model, build_settings(cfg), _ONE), 0, moments).optimizer
            == 0
        )
    finally:
        optimizer_register.unregister("plan_test_sgd")


def test_muon_exclusions_use_the_one_pattern_language() -> None:
    model = Planned()
    cfg = _cfg(optimizer="muon", muon={"exclude": ["blocks.{*}.*.weight", "blocks.{2-2}.mlp"]}).training
    split = muon_plan(model, cfg, ModelPlan())
    reasons = {d.name: d.reason for d in split.decisions}
    assert split.muon_names == []  # every block matrix is excluded by the two patterns
    assert reasons["blocks.0.attn.weight"] == "excluded by pattern 'blocks.{*}.*.weight'"
    assert reasons["blocks.2.mlp.bias"] == "in excluded module blocks.2.mlp"
    # ``*`` stays inside one component (unlike fnmatch): it does not reach the weights under blocks.N
    with pytest.raises(ConfigError, match=r"training.muon.exclude: pattern 'blocks.\*.weight' matches no"):
        muon_plan(model, _cfg(muon={"exclude": ["blocks.*.weight"]}).training, ModelPlan())
    with pytest.raises(
        ConfigError, match=r"training.muon.exclude: .*'blocks.{\*}.atn.weight'.*blocks.0.attn"
    ):
        muon_plan(model, _cfg(muon={"exclude": ["blocks.{*}.atn.weight"]}).training, ModelPlan())
    with pytest.raises(ConfigError, match=r"training.muon.exclude: pattern 'blocks.\{x\}'.*braces"):
        muon_plan(model, _cfg(muon={"exclude": ["blocks.{x}"]}).training, ModelPlan())
