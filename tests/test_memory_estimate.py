"""The activation part of ``mm check``'s memory estimate counts what autograd really keeps, and the memory
plans fail with errors that name the YAML key."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _mm import QUICKSTART, REPO
from torch.autograd.graph import saved_tensors_hooks

from mm_core.config.loader import load_config
from mm_core.errors import ConfigError
from mm_core.models.hub import ModelHub
from mm_core.parallel.estimate import estimate_activations
from mm_core.parallel.memory import apply_chunked_loss
from mm_core.parallel.plan import BuildPlan, resolve_build
from mm_core.parallel.state import ParallelSizes
from mm_core.parallel.summary import tokens_per_micro_batch
from mm_core.tasks.building import build_settings
from mm_core.train.loss import loss_sum, shift_labels

SEQ, MICRO = 64, 2


def _cfg(*overrides: str):
    os.chdir(REPO)
    return load_config(
        QUICKSTART,
        [
            f"data.dataset_param.basic_parameters.seq_len={SEQ}",
            f"training.micro_batch_size={MICRO}",
            *overrides,
        ],
    )


def _plan(model, cfg) -> BuildPlan:
    return resolve_build(model, build_settings(cfg), ParallelSizes(world_size=1, dp_replicate=1, dp_shard=1))


def _estimate(model, cfg) -> tuple[float, float]:
    return estimate_activations(
        model, _plan(model, cfg), tokens_per_micro_batch(cfg.data, cfg.training.micro_batch_size)
    )


def _measure(model, ids, forward_loss) -> int:
    """Bytes autograd keeps after the forward and loss (not the parameters): saved tensors, plus what the
    chunked loss keeps on its node (the gradients it computed in the forward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = forward_loss(ids)
    kept = getattr(loss.grad_fn, "grads", None) or ()
    return sum(saved.values()) + sum(t.untyped_storage().nbytes() for t in kept if t is not None)


@pytest.mark.parametrize("chunked", [False, True])
def test_activation_estimate_equals_saved_tensors(chunked):
    cfg = _cfg(f"model.loss_cfg.chunked_loss={str(chunked).lower()}")
    torch.manual_seed(0)
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}))
    ids = torch.randint(0, model.config.vocab_size, (MICRO, SEQ))
    estimated, transient = _estimate(model, cfg)
    head = apply_chunked_loss(model, _plan(model, cfg).chunked)
    assert (head is not None) == chunked

    def forward_loss(ids):
        if head is None:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            return loss_sum(out.logits, shift_labels(ids), "per_token_loss")
        with head.computing_loss(shift_labels(ids)):
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    measured = _measure(model, ids, forward_loss)
    # the estimate leaves out only the rotary tables and the token ids: under 1% (measured 0.2% under)
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)
    assert transient > 0
    if not chunked:
        return
    meta = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=True)
    every_layer = "model.recompute_plan.apply_modules=[model.layers.{*}]"
    full, _ = _estimate(meta, _cfg("model.recompute=true", every_layer))
    assert _plan(meta, _cfg("model.recompute=true", every_layer)).memory.recompute == tuple(
        f"model.layers.{i}" for i in range(model.config.num_hidden_layers)
    )
    selective = "model.recompute_plan.recompute_granularity=selective"
    sel, _ = _estimate(meta, _cfg("model.recompute=true", every_layer, selective))
    assert full < sel < 0.5 * estimated


#: a tiny hybrid decoder: 3 Gated DeltaNet layers (query/key heads repeated to 6 value heads of another width)
#: and 1 gated full-attention layer
HYBRID_TEXT = {
    "hidden_size": 40,
    "num_hidden_layers": 4,
    "vocab_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}
HYBRID = {
    "qwen3_5": {
        "text_config": {**HYBRID_TEXT, "intermediate_size": 64},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 40},
    },
    "qwen3_5_moe_text": {**HYBRID_TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24},
}  # fmt: skip


@pytest.mark.parametrize("model_id", sorted(HYBRID))
def test_hybrid_decoder_estimate_equals_saved_tensors(model_id):
    """Qwen3.5's Gated DeltaNet + gated attention layers (dense MLP, and experts with a shared expert), in
    bf16 as the guide's layout computes: the estimate counts each tensor autograd keeps, with its dtype (the
    norms and the delta rule in fp32). 100 tokens: the delta rule pads them to two chunks of 64."""
    tokens = 100
    cfg = _hybrid_cfg(model_id, tokens)
    torch.manual_seed(0)
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True})).to(torch.bfloat16)
    estimated, transient = _estimate(model, cfg)
    head = apply_chunked_loss(model, _plan(model, cfg).chunked)
    assert head is not None
    ids = torch.randint(0, HYBRID_TEXT["vocab_size"], (1, tokens))

    def forward_loss(ids):
        with head.computing_loss(shift_labels(ids)):
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    measured = _measure(model, ids, forward_loss)
    # left out: the rotary tables, the token ids (under 1% here; measured: dense 16 bytes, MoE 0.2% under)
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)
    # under full recompute each layer keeps its input (100 x 40 bf16) and one layer's tensors come back
    meta = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=True)
    full, full_transient = _estimate(meta, _hybrid_cfg(model_id, tokens, "model.recompute=true"))
    assert 4 * tokens * 40 * 2 < full < 0.2 * estimated
    assert full_transient == 2 * transient  # the largest layer (a Gated DeltaNet one), and its gradients
    # Ulysses 2: a rank holds half the tokens (in attention all of them for half the heads: the same bytes)
    recompute = _hybrid_cfg(model_id, tokens, "model.recompute=true", "parallel.ulysses_parallel_size=2")
    sizes = ParallelSizes(world_size=2, dp_replicate=1, dp_shard=1, ulysses=2)
    cp_plan = resolve_build(meta, build_settings(recompute), sizes)
    half = _estimate(meta, _hybrid_cfg(model_id, tokens // 2, "model.recompute=true"))
    assert estimate_activations(meta, cp_plan, tokens) == half


def _hybrid_cfg(model_id: str, tokens: int, *overrides: str):
    return _cfg(
        f"data.dataset_param.basic_parameters.seq_len={tokens}",
        "training.micro_batch_size=1",
        f"model.model_id={model_id}",
        "model.model_name_or_path=null",
        f"model.config_overrides={json.dumps(HYBRID[model_id])}",
        "parallel.fsdp_plan.apply_modules=[]",
        "parallel.fsdp_plan.param_dtype=bf16",
        *overrides,
    )


def test_memory_plans_resolve_defaults_and_refuse_bad_values():
    cfg = _cfg("model.recompute=true")
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=True)
    feats = _plan(model, cfg).memory
    assert feats.recompute == tuple(f"model.layers.{i}" for i in range(4)) and feats.recompute_mode == "full"
    with pytest.raises(ConfigError, match=r"model\.recompute_plan\.use_reentrant: got true"):
        _plan(model, _cfg("model.recompute=true", "model.recompute_plan.use_reentrant=true"))
    with pytest.raises(
        ConfigError, match=r"model\.recompute_plan\.apply_modules: pattern 'model\.layer\.\{\*\}'"
    ):
        _plan(model, _cfg("model.recompute=true", "model.recompute_plan.apply_modules=[model.layer.{*}]"))
    bad_op = _cfg("model.recompute=true", "model.recompute_plan.recompute_granularity=selective",
                  "model.recompute_plan.save_ops=[softmax]")  # fmt: skip
    with pytest.raises(ConfigError, match=r"model\.recompute_plan\.save_ops: unknown op 'softmax'"):
        _plan(model, bad_op)
    both = _cfg("model.recompute=true", "model.activation_offload=true")
    with pytest.raises(ConfigError, match="either recomputed or offloaded"):
        _plan(model, both)
    split = _cfg(
        "model.recompute=true",
        "model.recompute_plan.apply_modules=[model.layers.{0-1}]",
        "model.activation_offload=true",
        "model.activation_offload_plan.apply_modules=[model.layers.{2-3}]",
    )
    feats = _plan(model, split).memory
    assert feats.offload == ("model.layers.2", "model.layers.3")


def test_estimate_of_a_model_with_towers_is_its_language_model_s():
    """A vision-language model's activation estimate is that of its language model (the text config's
    sizes; recomputed tower blocks do not count as decoder layers), and ``model_parts`` lists each tower."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from mm_core.parallel.estimate import model_parts

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    text.update(num_key_value_heads=2, head_dim=16, vocab_size=320)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    vision.update(deepstack_visual_indexes=[1])
    with torch.device("meta"):
        vlm = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(
                text_config={**text, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
                vision_config=vision,
            )
        )
        lm = Qwen3ForCausalLM(Qwen3Config(**text))
    recompute = ["model.visual.blocks.0", "model.visual.blocks.1", "model.language_model.layers.0"]
    recomputed = f"model.recompute_plan.apply_modules=[{', '.join(recompute)}]"
    no_units = "parallel.fsdp_plan.apply_modules=[]"  # the quickstart's name the text model's layers
    got = _estimate(vlm, _cfg("model.recompute=true", recomputed, no_units))
    assert _plan(vlm, _cfg("model.recompute=true", recomputed, no_units)).memory.recompute == tuple(recompute)
    assert got[0] > 0
    assert got == _estimate(
        lm, _cfg("model.recompute=true", "model.recompute_plan.apply_modules=[model.layers.0]")
    )
    parts = {p.name: p for p in model_parts(vlm, [(n,) for n in recompute], 2, 2)}
    assert set(parts) == {"model.visual", "model.language_model", "lm_head"}
    assert parts["model.visual"].units == 2 and parts["model.language_model"].units == 1
    assert sum(p.params for p in parts.values()) == sum(p.numel() for p in vlm.parameters())
    assert (
        parts["model.visual"].states == 4 * 4 * parts["model.visual"].params / 2
    )  # params, grads, 2 moments
