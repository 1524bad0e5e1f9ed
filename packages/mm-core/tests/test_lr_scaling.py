"""``training.lr_scaling_plan``: the multipliers really change the update of the parameters they match, in
AdamW and in Muon (its Muon and AdamW groups alike), the schedule keeps every group's ratio, the first
matching pattern wins, and a pattern that does nothing is an error naming the key."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _tiny import QWEN3
from transformers import Qwen3Config, Qwen3ForCausalLM

from mm_core.config.schema import TrainingConfig
from mm_core.errors import ConfigError
from mm_core.optim import build_adamw, build_scheduler, lr_factor
from mm_core.optim.lr_scaling import check_applied, clean_path, resolve_lr_scaling, unscaled_lr
from mm_core.optim.muon import make_muon

PLAN = {"model.embed_tokens": 0.0, "model.layers.0": 0.25, "model.layers.{*}.mlp.*.weight": 3.0}


def tiny(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**QWEN3, tie_word_embeddings=False))


def expected_scale(name: str) -> float:
    """The multiplier :data:`PLAN` gives ``name`` (first match wins)."""
    if name.startswith("model.embed_tokens."):
        return 0.0
    if name.startswith("model.layers.0."):
        return 0.25
    if name.startswith("model.layers.") and ".mlp." in name and name.endswith(".weight"):
        return 3.0
    return 1.0


def step_deltas(build: Any, cfg: TrainingConfig) -> dict[str, torch.Tensor]:
    """One optimizer step of a fresh tiny model with fixed gradients: each parameter's change."""
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer = build(model, cfg)
    check_applied(optimizer, cfg)
    optimizer.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("optimizer", "build", "extra"),
    [
        ("adamw", build_adamw, {}),
        ("muon", make_muon, {"muon": {"ns_dtype": "fp32", "adamw_lr": 3e-3}}),
    ],
)
def test_multipliers_scale_the_update(optimizer: str, build: Any, extra: dict[str, Any]) -> None:
    common = {"train_iters": 3, "optimizer": optimizer, "lr": 1e-2, "weight_decay": 0.1, **extra}
    plain = step_deltas(build, TrainingConfig(**common))
    scaled = step_deltas(build, TrainingConfig(**common, lr_scaling_plan=PLAN))
    seen = set()
    for name, delta in plain.items():
        scale = expected_scale(name)
        seen.add(scale)
        assert delta.abs().max() > 0, name
        torch.testing.assert_close(
            scaled[name], scale * delta, rtol=1e-4, atol=1e-6, msg=name
        )  # fp32 rounding of p + delta
    assert seen == {0.0, 0.25, 3.0, 1.0}


def test_muon_groups_both_kinds_are_scaled() -> None:
    cfg = TrainingConfig(
        train_iters=3, optimizer="muon", lr=0.02, lr_scaling_plan=PLAN, muon={"adamw_lr": 2e-3}
    )
    optimizer = make_muon(tiny(), cfg)
    kinds = {(g["use_muon"], g["lr_scale"]): g["lr"] for g in optimizer.param_groups}
    assert kinds[(True, 0.25)] == pytest.approx(0.005)  # layer 0's matrices
    assert kinds[(False, 0.25)] == pytest.approx(5e-4)  # layer 0's norms
    assert kinds[(True, 3.0)] == pytest.approx(0.06)
    assert kinds[(False, 0.0)] == 0.0  # the embedding (AdamW inside Muon)
    assert kinds[(False, 1.0)] == pytest.approx(2e-3)


def test_schedule_keeps_each_groups_ratio() -> None:
    cfg = TrainingConfig(
        train_iters=6,
        lr=1e-2,
        lr_min=1e-3,
        lr_warmup_ratio=0.3,
        lr_decay_style="cosine",
        lr_scaling_plan=PLAN,
    )
    model = tiny()
    optimizer = build_adamw(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    assert {g["lr_scale"] for g in optimizer.param_groups} == {0.0, 0.25, 3.0, 1.0}
    for step in range(6):
        for g in optimizer.param_groups:
            assert g["lr"] == pytest.approx(cfg.lr * g["lr_scale"] * lr_factor(step, cfg)), step
        assert optimizer.param_groups[0]["lr_scale"] == 0.0  # the embedding comes first
        assert unscaled_lr(optimizer) == pytest.approx(cfg.lr * lr_factor(step, cfg))  # what is logged
        optimizer.step()
        scheduler.step()


def test_first_match_wins_and_the_counts() -> None:
    scaling = resolve_lr_scaling(tiny(), {"model.layers.0": 0.5, "model.layers.{*}": 2.0})
    names, numel = scaling.taken["model.layers.{*}"]
    assert names and all(n.startswith("model.layers.1.") for n in names)
    model = tiny()
    layer1 = sum(p.numel() for p in model.model.layers[1].parameters())
    assert numel == layer1
    lines = scaling.describe({"model.layers.0": 0.5, "model.layers.{*}": 2.0})
    assert lines[0].startswith("  lr x0.5  model.layers.0: ")
    assert lines[1].startswith(f"  lr x2  model.layers.{{*}}: {len(names)} tensors ({layer1:,} elements)")
    assert lines[2].startswith("  lr x1  (no pattern): ")


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"model.layer.{*}": 0.5}, "pattern 'model.layer.{*}' matches no trainable parameter"),
        (
            {"model.layers.{*}": 0.5, "model.layers.1.mlp": 2.0},
            "pattern 'model.layers.1.mlp' matches only parameters that an earlier pattern took "
            "('model.layers.{*}'; the first match wins)",
        ),
        ({"model.layers.{3-1}": 0.5}, "range {3-1} is empty"),
    ],
)
def test_a_pattern_that_does_nothing_is_an_error(plan: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match="^training.lr_scaling_plan: ") as info:
        build_adamw(tiny(), TrainingConfig(train_iters=1, lr_scaling_plan=plan))
    assert message in str(info.value)


def test_frozen_parameters_are_not_matched() -> None:
    model = tiny()
    model.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match="matches no trainable parameter"):
        resolve_lr_scaling(model, {"model.embed_tokens": 0.1})


def test_an_optimizer_that_ignores_the_plan_is_refused() -> None:
    cfg = TrainingConfig(train_iters=1, lr_scaling_plan={"lm_head": 0.5}, optimizer="my_sgd")
    optimizer = torch.optim.SGD(tiny().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="the optimizer 'my_sgd' does not apply learning-rate multipliers"):
        check_applied(optimizer, cfg)


def test_wrapper_components_are_dropped() -> None:
    assert clean_path("model.layers.0._checkpoint_wrapped_module.mlp._orig_mod.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    model = tiny()
    wrapped = torch.nn.Module()
    wrapped._orig_mod = copy.deepcopy(model)  # what torch.compile's wrapper looks like
    scaling = resolve_lr_scaling(wrapped, {"lm_head": 0.5})
    assert scaling.taken["lm_head"][0] == ["lm_head.weight"]
