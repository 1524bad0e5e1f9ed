"""A sigmoid-routed mixture-of-experts language model as a third-party plugin writes it, loaded through
``training.plugin: [_plugin_moe]``: transformers' DeepSeek-V3 (the routing of Kimi K2.5's language model:
sigmoid scores, top-k chosen with the ``e_score_correction_bias`` buffer) with mm's plans, text only."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import DeepseekV3ForCausalLM

from mm_core.models import ModelPlan, TransformersExperts, init_expert_adapters
from mm_core.registry import model_register

#: a tiny DeepSeek-V3 over the quickstart tokenizer's 4096 tokens: a dense first layer, then 3 MoE layers of
#: 4 routed experts (top-2) and a shared one, multi-head latent attention
TINY_DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "head_dim": 4,
    "v_head_dim": 8,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


@model_register.register("test_deepseek_v3")
class DeepseekV3ForTraining(TransformersExperts, DeepseekV3ForCausalLM):
    """``DeepseekV3ForCausalLM``: one FSDP unit per decoder layer, its fused experts expert-parallel."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("model.layers.{*}",),
        recompute_units=("model.layers.{*}",),
        expert_modules=("model.layers.{*}.mlp.experts",),
        muon_exclude_modules=("model.layers.{*}.mlp.gate",),
        output_head="lm_head",
        input_embedding="model.embed_tokens",
        output_norm="model.norm",
        init_weights=init_expert_adapters,
        router_loss_refusal="routes by sigmoid scores plus a balancing bias",
    )
