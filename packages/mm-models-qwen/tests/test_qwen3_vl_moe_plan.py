"""Qwen3-VL-MoE builds from a tiny config (on the meta device too), its default plans match real modules, and
a forward with an image (which needs ``mm_token_type_ids``) returns a finite loss and router loss."""

from __future__ import annotations

import pytest
import torch

from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub, plan_of
from mm_core.parallel.apply import materialize_meta
from mm_parallel.patterns import match_modules

IMAGE, VIDEO, START, END = 120, 121, 122, 123
TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [1, 1, 2],
        "mrope_interleaved": True,
    },
}
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 14,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
ARGS = ModelConfig(
    model_id="qwen3_vl_moe",
    from_scratch=True,
    config_overrides={
        "text_config": TEXT,
        "vision_config": VISION,
        "image_token_id": IMAGE,
        "video_token_id": VIDEO,
        "vision_start_token_id": START,
        "vision_end_token_id": END,
    },
)


def test_default_plans_match_modules():
    model = ModelHub.build(ARGS)
    assert type(model).__name__ == "Qwen3VLMoeForTraining"
    plan = plan_of(model)
    units = match_modules(model, plan.fsdp_units)
    assert len(units["model.visual.blocks.{*}"]) == 2
    assert len(units["model.language_model.layers.{*}"]) == 2
    assert match_modules(model, plan.recompute_units) == units
    experts = match_modules(model, plan.expert_modules)["model.language_model.layers.{*}.mlp.experts"]
    for name in experts:  # the fused layout mm's expert-parallel adapter takes
        module = model.get_submodule(name)
        assert tuple(module.gate_up_proj.shape) == (4, 2 * 16, 32)
        assert tuple(module.down_proj.shape) == (4, 32, 16)
    excluded = match_modules(model, plan.muon_exclude_modules)
    assert len(excluded["model.language_model.layers.{*}.mlp.gate"]) == 2
    assert excluded["model.visual.patch_embed"] == ["model.visual.patch_embed"]


def test_meta_build_initialises_every_tensor():
    model = ModelHub.build(ARGS, meta=True)
    assert all(p.is_meta for p in model.parameters())
    materialize_meta(model, torch.device("cpu"), init=True)  # raises on any tensor left NaN
    router = model.model.language_model.layers[0].mlp.gate.weight
    assert router.std().item() == pytest.approx(0.02, rel=0.3)


def test_forward_with_image_returns_finite_loss():
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    model.train()
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 image tokens after the 2x2 merge
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    text = torch.randint(0, 100, (2, 12))
    image = torch.tensor([START, IMAGE, IMAGE, IMAGE, IMAGE, END])
    ids = torch.stack([torch.cat([image, text[0]]), torch.cat([text[1], text[1, :6]])])
    mm_types = (ids == IMAGE).long()
    out = model(
        input_ids=ids,
        labels=ids,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=mm_types,
        output_router_logits=True,
        use_cache=False,
    )
    assert out.logits.shape == (2, 18, 128)
    assert torch.isfinite(out.loss) and torch.isfinite(out.aux_loss)
    out.loss.backward()
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.model.language_model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_router_loss_reads_the_text_config():
    """A vision-language MoE keeps num_experts / num_experts_per_tok in its text config; a dense model has
    no router, so a router loss coefficient is refused for it."""
    from mm_core.config.schema import LossConfig
    from mm_core.errors import ConfigError
    from mm_core.parallel.experts import router_aux_for

    aux = router_aux_for(ModelHub.build(ARGS), LossConfig(router_aux_loss_coef=0.02))
    assert aux is not None and (aux.num_experts, aux.top_k, aux.coef) == (4, 2, 0.02)
    tiny = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    tiny.update(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    dense = ModelConfig(model_id="qwen3", from_scratch=True, config_overrides=tiny)
    with pytest.raises(ConfigError, match="has no router"):
        router_aux_for(ModelHub.build(dense), LossConfig(router_aux_loss_coef=0.02))
