"""Qwen3.5 and Qwen3.5-MoE (vision-language) build from tiny configs, their per-tower plans match real
modules, and a text-only training forward runs the idle vision tower so every FSDP unit is used."""

from __future__ import annotations

import pytest
import torch

from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub, plan_of
from mm_parallel.patterns import match_modules

TEXT = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "vocab_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}


@pytest.mark.parametrize("model_id", ["qwen3_5", "qwen3_5_moe"])
def test_tiny_vl_model_builds_plans_match_and_trains_text_only(model_id):
    text = dict(TEXT)
    if model_id == "qwen3_5_moe":  # experts replace the dense MLP
        del text["intermediate_size"]
        text.update(MOE)
    args = ModelConfig(
        model_id=model_id, from_scratch=True, config_overrides={"text_config": text, "vision_config": VISION}
    )
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
