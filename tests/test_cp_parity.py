"""Context parallelism trains what one process would: Ulysses 2, ring 2, Ulysses 2 x ring 2 and ring 2 x
FSDP 2 against one process, on a tiny dense Qwen3 in fp32, 10 steps, the same global batch of 8 packed
sequences. Losses and gradient norms agree within 1e-5 relative at every step.

The model has 4 query heads and 1 key/value head (grouped-query attention with fewer key/value heads than
the Ulysses size), and sequences of 61 tokens, which no layout divides, so every layout pads; the packed
text has document boundaries inside sequences, so the block-diagonal causal mask is exercised."""

from __future__ import annotations

import pytest
from _mm import QUICKSTART, assert_close_series, train_layouts

STEPS = 10
SEQ = 61
COMMON = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",
    "training.save=null",
    "training.seed=7",
    "training.lr_warmup_ratio=0.2",
    f"data.dataset_param.basic_parameters.seq_len={SEQ}",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "model.config_overrides={hidden_size: 64, head_dim: 16, num_attention_heads: 4, num_key_value_heads: 1, "
    "intermediate_size: 128, num_hidden_layers: 2}",
]
# (name, processes, overrides): global batch = micro x accumulation x data-parallel ranks = 8 everywhere
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]),
    (
        "ulysses2",
        2,
        [
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "parallel.ulysses_parallel_size=2",
        ],
    ),
    (
        "ring2",
        2,
        [
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "parallel.ring_attention_size=2",
        ],
    ),
    (
        "ulysses2_ring2",
        4,
        [
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "parallel.ulysses_parallel_size=2",
            "parallel.ring_attention_size=2",
        ],
    ),
    (
        "ring2_fsdp2",
        4,
        [
            "training.micro_batch_size=2",
            "training.gradient_accumulation_steps=2",
            "parallel.ring_attention_size=2",
        ],
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_layouts(tmp_path_factory, QUICKSTART, LAYOUTS, COMMON)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS[1:]])
def test_context_parallel_matches_single_process(runs, layout):
    ref, got = runs["single"], runs[layout]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close_series([r["loss"] for r in ref], [r["loss"] for r in got], 1e-5, f"{layout} loss")
    assert_close_series(
        [r["grad_norm"] for r in ref], [r["grad_norm"] for r in got], 1e-5, f"{layout} grad_norm"
    )
    # tokens count real tokens only: the padding context parallelism adds is not counted
    assert [r["tokens"] for r in got] == [8 * SEQ] * STEPS


def test_loss_falls(runs):
    losses = [r["loss"] for r in runs["single"]]
    assert losses[-1] < losses[0] - 0.3
