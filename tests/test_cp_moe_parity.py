"""Context parallel with expert parallel: Ulysses 2 x EP 2 (2 ranks: the experts are split over the same two
ranks that share each sequence) on a tiny Qwen3-MoE in fp32 trains what one process would, router
load-balancing loss included. 10 steps, global batch 8 packed sequences of 31 tokens (padded for CP);
loss, aux loss and gradient norm agree within 1e-5 relative at every step."""

from __future__ import annotations

import pytest
from _mm import assert_close_series, train_layouts
from test_ep_parity import moe_config

STEPS = 10
SEQ = 31
COMMON = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",
    "training.save=null",
    "training.seed=5",
    "training.lr=3e-3",
    "training.lr_warmup_ratio=0.2",
    "training.clip_grad=0.5",
    f"data.dataset_param.basic_parameters.seq_len={SEQ}",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.micro_batch_size=4",
    "training.gradient_accumulation_steps=2",
]
LAYOUTS = [
    ("single", 1, []),
    ("ulysses2_ep2", 2, ["parallel.ulysses_parallel_size=2", "parallel.expert_parallel_size=2"]),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = moe_config(tmp_path_factory.mktemp("cfg"))
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, COMMON)


def test_ulysses_with_expert_parallel_matches_single_process(runs):
    ref, got = runs["single"], runs["ulysses2_ep2"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "aux_loss", "grad_norm"):
        assert_close_series([r[key] for r in ref], [r[key] for r in got], 1e-5, f"ulysses2_ep2 {key}")
    assert [r["tokens"] for r in got] == [8 * SEQ] * STEPS
