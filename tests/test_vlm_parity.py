"""Qwen3-VL with images trains the same model on 2 FSDP ranks, and with Ulysses 2 or ring 2 context
parallelism, as in 1 process: gloo, fp32, 10 steps, images of different sizes and 0-2 images per sample.
Under context parallelism the vision tower and the 3-D rotary positions see the whole sequence and the
language model's input is split, so image tokens live in every rank's shard. Losses and gradient norms agree
within 1e-5 relative."""

from __future__ import annotations

import pytest
from _mm import assert_close_series, train_layouts
from _vlm import make_assets

STEPS = 10
LAYOUTS = [
    # tools.peak_tflops: mfu in metrics.jsonl also on a CPU (it changes nothing else)
    (
        "single",
        1,
        ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2", "tools.peak_tflops=2"],
    ),
    ("fsdp2", 2, ["training.micro_batch_size=2", "training.gradient_accumulation_steps=2"]),
]
CONTEXT = {"ulysses2": "parallel.ulysses_parallel_size=2", "ring2": "parallel.ring_attention_size=2"}
LAYOUTS += [
    (name, 2, ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2", option])
    for name, option in CONTEXT.items()
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = make_assets(tmp_path_factory.mktemp("vlm_assets"))
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, timeout=120)


@pytest.mark.slow
def test_fsdp2_with_images_matches_single_process(runs):
    ref, got = runs["single"], runs["fsdp2"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close_series([r["loss"] for r in ref], [r["loss"] for r in got], 1e-5, "fsdp2 loss")
    assert_close_series([r["grad_norm"] for r in ref], [r["grad_norm"] for r in got], 1e-5, "fsdp2 grad_norm")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in got]


@pytest.mark.slow
def test_throughput_and_mfu_are_logged(runs):
    for r in runs["single"]:
        assert r["tflops_per_s"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_s"] / 2, rel=1e-12), r
    assert all(r["tflops_per_s"] > 0 and "mfu" not in r for r in runs["fsdp2"])


@pytest.mark.slow
def test_loss_falls(runs):
    losses = [r["loss"] for r in runs["single"]]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONTEXT))
def test_context_parallel_with_images_matches_single_process(runs, name):
    ref, got = runs["single"], runs[name]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close_series([r["loss"] for r in ref], [r["loss"] for r in got], 1e-5, f"{name} loss")
    assert_close_series(
        [r["grad_norm"] for r in ref], [r["grad_norm"] for r in got], 1e-5, f"{name} grad_norm"
    )
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in got]
