"""Tiny model configurations shared by the package suites and the cross-package tests (importable from both:
pytest.ini puts ``tests`` on ``pythonpath``). Each is a plain dict of Hugging Face config fields, without the
vocabulary size where the tests size it to their own tokenizer; a test adds or overrides the fields it needs
with ``{**TINY, "field": value}``."""

from __future__ import annotations

from typing import Any

#: Qwen3, 2 decoder layers, grouped-query attention (2 query heads, 1 key/value head)
QWEN3: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}

#: Qwen3-MoE over the quickstart tokenizer's 4096 tokens: 2 layers of 8 experts, top-2, tied embeddings
QWEN3_MOE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}

#: Qwen3.5's text model: 3 Gated DeltaNet (linear attention) layers, then a full-attention one
QWEN3_5_TEXT: dict[str, Any] = {
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
#: what Qwen3.5-MoE's text model adds (it has no dense ``intermediate_size``): 4 experts top-2, 1 shared
QWEN3_5_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}
#: Qwen3.5's vision tower: 2 blocks
QWEN3_5_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 32,
}


def qwen3_5_overrides(model_id: str) -> dict[str, Any]:
    """``model.config_overrides`` of a tiny ``qwen3_5``, ``qwen3_5_moe`` or ``qwen3_5_moe_text``."""
    text = dict(QWEN3_5_TEXT)
    if model_id != "qwen3_5":
        del text["intermediate_size"]
        text.update(QWEN3_5_MOE)
    return text if model_id == "qwen3_5_moe_text" else {"text_config": text, "vision_config": QWEN3_5_VISION}


#: Kimi K2.5's text model (DeepSeek-V3): 3 decoder layers, the first dense; 4 routed experts top-2 and 1
#: shared expert; multi-head latent attention with a q LoRA rank, qk head dim 4 + 4 = v head dim 8.
#: ``head_dim`` is DeepSeek-V3's rotary dim and must follow ``qk_rope_head_dim`` (the config derives it only
#: at construction).
KIMI_K25_TEXT: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
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
}
#: Kimi K2.5's vision tower: 2 layers over 14-pixel patches, a 4 x 4 position-embedding grid
KIMI_K25_VISION: dict[str, Any] = {
    "patch_size": 14,
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
}

#: MiniMax-M3's text model: a full-attention layer, then a sparse one (lightning indexer: blocks of 4 tokens,
#: 2 kept per query); layer 0 dense, layer 1 4 routed experts top-2 (clamped activation) and a shared expert
MINIMAX_M3_TEXT: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 16,
    "dense_intermediate_size": 32,
    "shared_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_block_size": 4,
    "index_topk_blocks": 2,
    "index_local_blocks": 1,
    "layer_types": ["full_attention", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
#: MiniMax-M3's vision tower: 2 layers
MINIMAX_M3_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}

#: Step3p7's text model: layer 0 dense, layer 1 4 routed experts top-2 (SwiGLU clamp 7) and a shared expert
STEP3P7_TEXT: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "mlp_layer_types": ["dense", "sparse"],
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "share_expert_dim": 16,
    "swiglu_limits": [0, 7.0],
    "sliding_window": 512,  # required by transformers' mask code although every layer is full
}
#: Step3p7's vision tower: 2 layers over 4-pixel patches of a 32 x 32 view
STEP3P7_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "mlp_ratio": 2.0,
    "image_size": 32,
    "patch_size": 4,
}
