"""Every layout trains what one process would: 1 process, FSDP 2, FSDP 2 with CPU offload, DDP 2 and HSDP 2x2
(with hook_modules, prefetch and pregather) on the quickstart model in fp32, 10 steps, the same global batch
of 8 sequences. Losses and gradient norms agree within 1e-5.

Every layout builds the model on the meta device (``training.init_model_with_meta_device: auto``, the
default) and initialises it shard by shard; the seeded per-parameter draws make the initial weights the same
on every layout, which the equal first-step losses show."""

from __future__ import annotations

import pytest
from _mm import QUICKSTART, assert_close_series, train_layouts

STEPS = 10
COMMON = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",
    "training.save=null",
    "training.seed=7",
    "training.lr_warmup_ratio=0.2",
    "data.dataset_param.basic_parameters.seq_len=128",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
]
# (name, processes, overrides): global batch = micro x accumulation x data-parallel ranks = 8 everywhere
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]),
    ("fsdp2", 2, ["training.micro_batch_size=2", "training.gradient_accumulation_steps=2"]),
    (  # FSDP2's CPU offload: the meta-built shards are materialised on the host
        "fsdp2_offload",
        2,
        [
            "training.micro_batch_size=2",
            "training.gradient_accumulation_steps=2",
            "parallel.fsdp_plan.cpu_offload=true",
        ],
    ),
    (
        "ddp2",
        2,
        [
            "training.micro_batch_size=2",  # accumulation: the replicas all-reduce after the last micro-batch
            "training.gradient_accumulation_steps=2",
            "parallel.fully_shard_parallel_size=1",
        ],
    ),
    (  # HSDP with the guide's gathering plan: hook groups, prefetch of the next layer, pregather
        "hsdp2x2_hooks",
        4,
        [
            "training.micro_batch_size=1",
            "training.gradient_accumulation_steps=2",
            "parallel.fully_shard_parallel_size=2",
            "parallel.fsdp_plan.hook_modules=[model.layers.{*}]",
            "parallel.fsdp_plan.num_to_forward_prefetch=1",
            "parallel.fsdp_plan.num_to_backward_prefetch=1",
            "parallel.fsdp_plan.pregather=true",
        ],
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_layouts(tmp_path_factory, QUICKSTART, LAYOUTS, COMMON)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS[1:]])
def test_layout_matches_single_process(runs, layout):
    ref, got = runs["single"], runs[layout]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close_series([r["loss"] for r in ref], [r["loss"] for r in got], 1e-5, f"{layout} loss")
    assert_close_series(
        [r["grad_norm"] for r in ref], [r["grad_norm"] for r in got], 1e-5, f"{layout} grad_norm"
    )
    assert all(r["tokens"] == 8 * 128 for r in got)


def test_loss_falls(runs):
    losses = [r["loss"] for r in runs["single"]]
    assert losses[-1] < losses[0] - 0.5
