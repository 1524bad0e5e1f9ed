"""The Qwen3.5-MoE language model (``qwen3_5_moe_text``: linear + full attention, routed experts and a gated
shared expert) trains the same with EP=2 on 2 ranks as in 1 process: 3 steps, fp32, router loss on."""

from __future__ import annotations

from _mm import assert_close_series, train_layouts
from test_ep_parity import COMMON, moe_config

MODEL = {
    "model_id": "qwen3_5_moe_text",
    "from_scratch": True,
    "config_overrides": {
        "vocab_size": 4096,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
    },
    "loss_cfg": {"loss_type": "per_token_loss", "router_aux_loss_coef": 0.02},
}


def test_qwen3_5_moe_text_expert_parallel_matches_single_process(tmp_path_factory):
    cfg = moe_config(tmp_path_factory.mktemp("cfg"), MODEL)
    common = [c for c in COMMON if not c.startswith("training.train_iters")] + ["training.train_iters=3"]
    layouts = [
        ("single", 1, ["training.micro_batch_size=2"]),
        ("ep2", 2, ["training.micro_batch_size=1", "parallel.expert_parallel_size=2"]),
    ]
    runs = train_layouts(tmp_path_factory, cfg, layouts, common)
    for key in ("loss", "aux_loss", "grad_norm"):
        a, b = [r[key] for r in runs["single"]], [r[key] for r in runs["ep2"]]
        assert_close_series(a, b, 1e-5, f"qwen3_5_moe_text {key}")
