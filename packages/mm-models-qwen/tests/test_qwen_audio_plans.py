"""Qwen3-ASR (``qwen3_asr``) and Qwen3-Omni-MoE's thinker (``qwen3_omni_moe``) from tiny configs: the default
plans match real modules; a micro-batch without audio (or images) still runs every tower, in one order
whatever the micro-batch holds, and gives the idle tower zero gradients; the thinker's own 3-D positions
without an attention mask equal transformers' with one; meta-device init initialises every tensor; weights
load from and export to transformers' names (a whole Qwen3-Omni folder included)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ASRForConditionalGeneration
from transformers.models.qwen3_omni_moe import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub, plan_of
from mm_core.parallel.apply import materialize_meta
from mm_parallel.patterns import match_modules

AUDIO_PAD, IMAGE_PAD, VIDEO_PAD, AUDIO_START, AUDIO_END, VISION_START, VISION_END = range(120, 127)
AUDIO = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "downsample_hidden_size": 8,
    "output_dim": 32,
}
TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ASR = ModelConfig(
    model_id="qwen3_asr",
    from_scratch=True,
    config_overrides={
        "audio_config": AUDIO,
        "text_config": {**TEXT, "head_dim": 8},
        "audio_token_id": AUDIO_PAD,
    },
)
THINKER = {
    "audio_config": AUDIO,
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 14,
        "out_hidden_size": 32,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    },
    "text_config": {
        **TEXT,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
    },
    "audio_token_id": AUDIO_PAD,
    "image_token_id": IMAGE_PAD,
    "video_token_id": VIDEO_PAD,
    "audio_start_token_id": AUDIO_START,
    "vision_start_token_id": VISION_START,  # not a declared field, so only a config.json can carry it
}
UNITS = ("model.visual.blocks", "model.audio_tower.layers", "model.language_model.layers")
#: the token embedding, an FSDP unit of its own (the plan's input_embedding)
EMBED = "model.language_model.embed_tokens"


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> ModelConfig:
    path = tmp_path_factory.mktemp("thinker")
    Qwen3OmniMoeThinkerConfig(**THINKER).save_pretrained(path)
    return ModelConfig(model_id="qwen3_omni_moe", model_name_or_path=str(path), from_scratch=True)


def _clip(frames: int) -> dict[str, torch.Tensor]:
    """One clip of ``frames`` valid mel frames, padded to 200 (two encoder chunks)."""
    mask = torch.zeros(1, 200, dtype=torch.long)
    mask[0, :frames] = 1
    return {"input_features": torch.randn(1, 128, 200) * mask[:, None], "mask": mask}


def _tokens(frames: int) -> int:
    """Audio tokens of ``frames`` mel frames: 13 per full 100-frame chunk, the rest after three halvings."""
    full, rest = divmod(frames, 100)
    for _ in range(3):
        rest = -(-rest // 2)
    return 13 * full + rest


def test_default_plans_match_modules(omni):
    asr = ModelHub.build(ASR)
    assert type(asr).__name__ == "Qwen3ASRForTraining"
    plan = plan_of(asr)
    units = match_modules(asr, plan.fsdp_units)
    assert units == {
        "model.audio_tower.layers.{*}": ["model.audio_tower.layers.0", "model.audio_tower.layers.1"],
        "model.language_model.layers.{*}": ["model.language_model.layers.0", "model.language_model.layers.1"],
    }
    assert match_modules(asr, plan.recompute_units) == units
    stem = ["model.audio_tower.conv2d1", "model.audio_tower.conv2d2", "model.audio_tower.conv2d3"]
    assert match_modules(asr, plan.muon_exclude_modules) == {
        "model.audio_tower.conv2d*": stem,
        "model.audio_tower.conv_out": ["model.audio_tower.conv_out"],
    }
    assert (plan.cp_split_module, plan.output_head, plan.expert_modules) == (
        "model.language_model",
        "lm_head",
        (),
    )

    thinker = ModelHub.build(omni)
    assert type(thinker).__name__ == "Qwen3OmniMoeThinkerForTraining"
    plan = plan_of(thinker)
    units = match_modules(thinker, plan.fsdp_units)
    assert {p: len(v) for p, v in units.items()} == {f"{u}.{{*}}": 2 for u in UNITS}
    assert match_modules(thinker, plan.recompute_units) == units
    experts = match_modules(thinker, plan.expert_modules)["model.language_model.layers.{*}.mlp.experts"]
    for name in experts:  # the fused layout mm's expert-parallel adapter takes
        module = thinker.get_submodule(name)
        assert tuple(module.gate_up_proj.shape) == (4, 2 * 16, 32)
        assert tuple(module.down_proj.shape) == (4, 32, 16)
        assert callable(module.act_fn)
    excluded = match_modules(thinker, plan.muon_exclude_modules)
    assert len(excluded["model.language_model.layers.{*}.mlp.gate"]) == 2
    assert excluded["model.visual.patch_embed"] == ["model.visual.patch_embed"]
    assert excluded["model.audio_tower.conv2d*"] == stem
    assert plan.cp_split_module == "model.language_model"
    assert plan.cp_packed == {"deepstack_visual_embeds": "visual_pos_masks"}
    thinker.get_submodule(plan.cp_split_module)


def _unit_order(model: torch.nn.Module) -> list[str]:
    """Record the FSDP-unit modules (layers and the token embedding) in the order their forwards start
    (cleared by the caller)."""
    order: list[str] = []
    for name, module in model.named_modules():
        layer = any(name.startswith(u + ".") and name.count(".") == u.count(".") + 1 for u in UNITS)
        if layer or name == EMBED:
            module.register_forward_pre_hook(lambda m, a, n=name: order.append(n))
    return order


def _zero_grads(module: torch.nn.Module) -> bool:
    grads = [p.grad for p in module.parameters()]
    return all(g is not None for g in grads) and all(bool((g == 0).all()) for g in grads)


def test_asr_without_audio_runs_the_audio_tower_for_zero_gradients():
    torch.manual_seed(0)
    model = ModelHub.build(ASR).train()
    order = _unit_order(model)
    frames = 150
    clip = _clip(frames)
    ids = torch.randint(0, 100, (2, 30))
    ids[0, 2 : 2 + _tokens(frames)] = AUDIO_PAD
    out = model(input_ids=ids, input_features=clip["input_features"], input_features_mask=clip["mask"])
    out.logits.sum().backward()
    with_audio = list(order)
    assert model.model.audio_tower.layers[0].fc1.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    order.clear()
    out = model(input_ids=torch.randint(0, 100, (2, 30)))
    assert torch.isfinite(out.logits).all()
    out.logits.sum().backward()
    assert order == with_audio  # the same units, in the same order
    assert _zero_grads(model.model.audio_tower) and _zero_grads(model.model.multi_modal_projector)
    model.eval()
    order.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 8)))
    assert not any(n.startswith("model.audio_tower") for n in order)  # inference runs no idle tower


def _omni_batch(audio: bool, image: bool) -> dict[str, torch.Tensor]:
    """Two sequences of 40 tokens: the first holds a clip of 150 frames and/or a 4-token image."""
    torch.manual_seed(1)
    text = torch.randint(0, 100, (2, 40))
    first = [text[0, :3]]
    batch: dict[str, torch.Tensor] = {}
    if audio:
        clip = _clip(150)
        first.append(torch.tensor([AUDIO_START] + [AUDIO_PAD] * _tokens(150) + [AUDIO_END]))
        batch.update(input_features=clip["input_features"], feature_attention_mask=clip["mask"])
    if image:
        first.append(torch.tensor([VISION_START] + [IMAGE_PAD] * 4 + [VISION_END]))
        batch.update(pixel_values=torch.randn(16, 3 * 2 * 14 * 14), image_grid_thw=torch.tensor([[1, 4, 4]]))
    row = torch.cat(first + [text[0, 3:]])[:40]
    batch["input_ids"] = torch.stack([row, text[1]])
    return batch


def test_thinker_runs_every_tower_in_one_order_whatever_the_batch_holds(omni):
    torch.manual_seed(0)
    model = ModelHub.build(omni).train()
    order = _unit_order(model)
    orders = {}
    for audio, image in [(True, True), (True, False), (False, True), (False, False)]:
        model.zero_grad(set_to_none=True)
        order.clear()
        out = model(**_omni_batch(audio, image), output_router_logits=True, use_cache=False)
        assert torch.isfinite(out.logits).all()
        (out.logits.sum() + out.aux_loss).backward()
        orders[audio, image] = list(order)
        assert _zero_grads(model.model.audio_tower) is not audio
        assert _zero_grads(model.model.visual) is not image
        assert model.model.language_model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    first = orders[True, True]
    kinds = [n if n == EMBED else n.rsplit(".", 1)[0] for n in first]
    runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert runs == [UNITS[0], EMBED, UNITS[1], UNITS[2]]  # vision, the embedding, audio, the decoder
    assert all(o == first for o in orders.values()), orders


def test_thinker_positions_without_attention_mask_equal_transformers(omni):
    """mm's context parallelism sends no attention mask; the positions are then the 3-D ones all the same
    (padding at the end does not move the real tokens')."""
    model = ModelHub.build(omni).eval()
    batch = _omni_batch(True, True)
    mask = torch.ones_like(batch["input_ids"])
    mask[1, -5:] = 0
    ids = batch["input_ids"]
    ours = model._positions(ids, **{k: v for k, v in batch.items() if k != "input_ids"})
    theirs, _ = model.model.get_rope_index(
        ids, batch["image_grid_thw"], None, mask, False, batch["feature_attention_mask"].sum(-1)
    )
    real = mask.bool()
    assert torch.equal(ours[:, real], theirs[:, real])
    assert not torch.equal(ours[0], ours[1])  # the image's rows are 3-D
    with torch.no_grad():
        a = model(**batch).logits
        b = model(**batch, attention_mask=torch.ones_like(mask)).logits
    torch.testing.assert_close(a, b)


def test_meta_build_initialises_every_tensor(omni):
    for args in (ASR, omni):
        model = ModelHub.build(args, meta=True)
        assert all(p.is_meta for p in model.parameters())
        materialize_meta(model, torch.device("cpu"), init=True)  # raises naming any tensor left NaN
    layer = model.model.language_model.layers[0].mlp
    for weight in (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
        assert weight.std().item() == pytest.approx(0.02, rel=0.3)


def _state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_weights_load_from_and_export_to_transformers_names(omni, tmp_path):
    torch.manual_seed(0)
    official = Qwen3ASRForConditionalGeneration(ModelHub.build(ASR).config)
    official.save_pretrained(tmp_path / "asr")
    loaded = ModelHub.build(ModelConfig(model_id="qwen3_asr", model_name_or_path=str(tmp_path / "asr")))
    assert _state_equal(loaded.state_dict(), official.state_dict())
    loaded.save_pretrained(tmp_path / "asr_export")
    assert set(load_file(tmp_path / "asr_export" / "model.safetensors")) == set(
        load_file(tmp_path / "asr" / "model.safetensors")
    )

    # a whole Qwen3-Omni folder (config model_type qwen3_omni_moe, weights under thinker.) loads the thinker
    config = Qwen3OmniMoeThinkerConfig.from_pretrained(omni.model_name_or_path)
    whole = Qwen3OmniMoeForConditionalGeneration(
        Qwen3OmniMoeConfig(thinker_config=config.to_dict(), enable_audio_output=False)
    )
    whole.save_pretrained(tmp_path / "omni")
    assert all(k.startswith("thinker.") for k in load_file(tmp_path / "omni" / "model.safetensors"))
    loaded = ModelHub.build(ModelConfig(model_id="qwen3_omni_moe", model_name_or_path=str(tmp_path / "omni")))
    assert type(loaded.config) is Qwen3OmniMoeThinkerConfig
    assert _state_equal(loaded.state_dict(), whole.thinker.state_dict())
    loaded.save_pretrained(tmp_path / "thinker_export")
    back = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tmp_path / "thinker_export")
    assert _state_equal(back.state_dict(), whole.thinker.state_dict())
