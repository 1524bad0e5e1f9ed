"""Kimi K2.5 builds from a tiny config (on the meta device too), its default plans match real modules (experts
only in the MoE layers), mm's expert-parallel adapter computes what its fused experts compute, a forward with
an image returns a finite loss, the idle-vision-tower rule changes no loss and gives every vision parameter
a (zero) gradient, and the router loss is refused."""

from __future__ import annotations

import pytest
import torch
from _tiny import KIMI_K25_TEXT, KIMI_K25_VISION
from transformers import Kimi_K25ForConditionalGeneration
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3MoE

from mm_core.config.schema import LossConfig, ModelConfig
from mm_core.errors import ConfigError
from mm_core.models import ModelHub, plan_of
from mm_core.parallel.apply import materialize_meta
from mm_core.parallel.experts import router_aux_for
from mm_models_kimi.kimi_k25 import PROJECTOR, VISION_TOWER
from mm_parallel.moe import ExpertParallelExperts, swap_experts
from mm_parallel.patterns import match_modules

IMAGE, VIDEO, START, END, CONTENT = 120, 121, 122, 123, 124
#: the tiny Kimi K2.5 of _tiny (3 decoder layers, the first dense; MLA; 4 routed experts and a shared one)
TEXT = {**KIMI_K25_TEXT, "vocab_size": 128}
VISION = dict(KIMI_K25_VISION)
OVERRIDES = {
    "text_config": TEXT,
    "vision_config": VISION,
    "projection_hidden_size": 32,  # the projector's LayerNorm runs over the vision hidden size
    "image_token_id": IMAGE,
    "video_token_id": VIDEO,
    "vision_start_token_id": START,
    "vision_end_token_id": END,
}
ARGS = ModelConfig(model_id="kimi_k25", from_scratch=True, config_overrides=OVERRIDES)
EXPERTS = "model.language_model.layers.{*}.mlp.experts"


def batch_with_image() -> dict[str, torch.Tensor]:
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 image tokens after the 2x2 merge
    pixels = torch.randn(16, 3, 14, 14)
    text = torch.randint(0, 100, (2, 12))
    image = torch.tensor([START, 7, CONTENT, IMAGE, IMAGE, IMAGE, IMAGE, END])
    ids = torch.stack([torch.cat([image, text[0]]), torch.cat([text[1], text[1, :8]])])
    return {"input_ids": ids, "labels": ids, "pixel_values": pixels, "image_grid_thw": grid}


def test_default_plans_match_modules():
    model = ModelHub.build(ARGS)
    assert type(model).__name__ == "KimiK25ForTraining"
    plan = plan_of(model)
    units = match_modules(model, plan.fsdp_units)
    assert units["model.vision_tower.layers.{*}"] == [
        "model.vision_tower.layers.0",
        "model.vision_tower.layers.1",
    ]
    assert len(units["model.language_model.layers.{*}"]) == 3
    assert match_modules(model, plan.recompute_units) == units
    layers = model.model.language_model.layers
    assert type(layers[0].mlp) is DeepseekV3MLP  # first_k_dense_replace: dense, no experts
    assert all(type(layer.mlp) is DeepseekV3MoE for layer in layers[1:])
    experts = match_modules(model, plan.expert_modules)[EXPERTS]
    assert experts == [f"model.language_model.layers.{i}.mlp.experts" for i in (1, 2)]  # never shared_experts
    for name in experts:  # the fused layout mm's expert-parallel adapter takes
        module = model.get_submodule(name)
        assert tuple(module.gate_up_proj.shape) == (4, 2 * 16, 32)
        assert tuple(module.down_proj.shape) == (4, 32, 16)
    excluded = match_modules(model, plan.muon_exclude_modules)
    assert excluded["model.language_model.layers.{*}.mlp.gate"] == [
        f"model.language_model.layers.{i}.mlp.gate" for i in (1, 2)
    ]
    assert excluded["model.vision_tower.patch_embed"] == ["model.vision_tower.patch_embed"]
    assert excluded["model.mm_projector.pre_norm"] == ["model.mm_projector.pre_norm"]
    assert plan.cp_split_module == "model.language_model"
    model.get_submodule(plan.cp_split_module)


def test_expert_adapter_computes_what_the_fused_experts_compute():
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    experts = model.model.language_model.layers[1].mlp.experts
    adapter = ExpertParallelExperts.from_fused(experts)
    hidden = torch.randn(10, 32)
    index = torch.randint(0, 4, (10, 2))
    weights = torch.rand(10, 2)  # the router's weights: fp32, scaled by routed_scaling_factor
    torch.testing.assert_close(adapter(hidden, index, weights), experts(hidden, index, weights))
    # swapped into the model (no ep mesh): the same loss
    batch = batch_with_image()
    model.eval()
    with torch.no_grad():
        before = model(**batch).loss
        swapped = swap_experts(model, match_modules(model, [EXPERTS])[EXPERTS], None)
        assert len(swapped) == 2
        after = model(**batch).loss
    torch.testing.assert_close(after, before)


def test_forward_with_image_returns_finite_loss():
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    model.train()
    out = model(**batch_with_image())
    assert out.logits.shape == (2, 20, 128)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.model.mm_projector.out_proj.weight.grad.abs().sum() > 0
    moe = model.model.language_model.layers[1].mlp
    assert moe.experts.gate_up_proj.grad.abs().sum() > 0
    assert moe.shared_experts.up_proj.weight.grad.abs().sum() > 0
    assert moe.gate.weight.grad.abs().sum() > 0  # the router learns through the expert weights


def test_forward_with_an_image_from_the_kimi_format():
    formats = pytest.importorskip("mm_data_vlm.formats.kimi")
    from PIL import Image

    fmt = formats.KimiK25Format({"image_processor_type": "Kimi_K25ImageProcessor"}, None, None)
    picture = Image.fromarray(torch.randint(0, 256, (20, 30, 3), dtype=torch.uint8).numpy())
    pixels = fmt.pixels([picture])
    assert pixels["image_grid_thw"].tolist() == [[1, 2, 4]]  # 30x20 padded to 56x28
    rows = fmt.feature_rows(pixels)
    assert rows == fmt.placeholder(30, 20).count(fmt.image_token) == 2
    ids = torch.tensor([[START, 7, CONTENT] + [IMAGE] * rows + [END, 5, 6, 8]])
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    model.train()
    out = model(input_ids=ids, labels=ids, **pixels)
    assert torch.isfinite(out.loss)


def test_idle_vision_tower_changes_no_loss_and_gives_vision_gradients():
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    model.train()
    ids = torch.randint(0, 100, (2, 10))
    out = model(input_ids=ids, labels=ids)
    # the plain transformers forward: no idle tower, positions computed by the language model
    plain = Kimi_K25ForConditionalGeneration.forward(model, input_ids=ids, labels=ids)
    assert torch.equal(out.logits, plain.logits)
    assert out.loss.item() == plain.loss.item()
    out.loss.backward()  # the model's own loss (loss_type raw) carries the idle term too
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    for name, p in model.named_parameters():
        if name.startswith((VISION_TOWER + ".", PROJECTOR + ".")):
            assert torch.count_nonzero(p.grad) == 0, name


def test_idle_vision_tower_runs_only_in_training_with_grad(monkeypatch):
    model = ModelHub.build(ARGS)
    calls = []
    monkeypatch.setattr(model, "_idle_vision_tower", lambda: calls.append(1) or torch.zeros(()))
    ids = torch.randint(0, 100, (1, 6))
    model.eval()
    model(input_ids=ids)
    model.train()
    with torch.no_grad():
        model(input_ids=ids)
    model(**batch_with_image())
    assert calls == []
    model(input_ids=ids)
    assert calls == [1]


def test_meta_build_initialises_every_tensor():
    model = ModelHub.build(ARGS, meta=True)
    assert all(p.is_meta for p in model.parameters())
    names = match_modules(model, [EXPERTS])[EXPERTS]
    swap_experts(model, names, None)  # the adapters mm puts in for expert parallelism
    materialize_meta(model, torch.device("cpu"), init=True)  # raises naming any tensor left NaN
    adapters = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert len(adapters) == 2
    for layer in model.model.language_model.layers[1:]:
        for weight in (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert weight.std().item() == pytest.approx(0.02, rel=0.3)
    reference = dict(ModelHub.build(ARGS).named_buffers())  # rotary tables, time embeddings, router biases
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, reference[name], rtol=0, atol=0, msg=name)


def test_router_bias_is_a_buffer_and_the_router_loss_is_refused():
    model = ModelHub.build(ARGS)
    gate = model.model.language_model.layers[1].mlp.gate
    assert "e_score_correction_bias" in dict(gate.named_buffers())
    assert "e_score_correction_bias" not in dict(gate.named_parameters())
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        router_aux_for(model, LossConfig(router_aux_loss_coef=0.02))
    assert router_aux_for(model, LossConfig(router_aux_loss_coef=0.0)) is None
