"""Qwen3.5 and Qwen3.5-MoE (vision-language) build from tiny configs, their per-tower plans match real
modules, and a text-only training forward runs the idle vision tower so every FSDP unit is used."""

from __future__ import annotations

import pytest
import torch
from _tiny import qwen3_5_overrides

from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub, plan_of
from mm_parallel.patterns import match_modules


@pytest.mark.parametrize("model_id", ["qwen3_5", "qwen3_5_moe"])
def test_tiny_vl_model_builds_plans_match_and_trains_text_only(model_id):
    args = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=qwen3_5_overrides(model_id))
    torch.manual_seed(0)
    model = ModelHub.build(args)
    matched = match_modules(model, plan_of(model).fsdp_units)
    assert len(matched["model.language_model.layers.{*}"]) == 4
    assert len(matched["model.visual.blocks.{*}"]) == 2
    model.train()
    ids = torch.randint(0, 128, (2, 16))
    out = model(input_ids=ids, use_cache=False)
    assert out.logits.shape == (2, 16, 128)
    out.logits.float().logsumexp(-1).mean().backward()
    # the idle vision tower contributes a (zero) gradient, so FSDP's vision units ran on this rank too
    assert model.model.visual.blocks[0].attn.qkv.weight.grad is not None
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # the model's own loss (loss_type raw)
    assert model.model.visual.blocks[0].attn.qkv.weight.grad is not None
