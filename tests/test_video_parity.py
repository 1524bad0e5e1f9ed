"""A tiny Wan2.2 (``wan2_2``) trains the same model on 2 FSDP ranks and with Ulysses 2 context parallelism
over the video tokens as in 1 process: gloo, fp32, 3 steps of 2 micro-batches, latents of random clips
encoded by a tiny VAE, the flow-matching loss on noise and noise levels drawn from each sample's seed.
Losses and gradient norms agree within 1e-5 relative and the video-token counts are equal (each Ulysses
rank counts its half of the tokens: a model that did not split would count them twice). The FSDP layout
builds the model on the meta device and loads the diffusers folder into the shards; the Ulysses layout
recomputes the blocks (activation checkpointing around the all-to-all attention)."""

from __future__ import annotations

import pytest
from _mm import assert_close_series, train_layouts
from _video import make_video_assets

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=2"]),
    ("fsdp2", 2, ["training.micro_batch_size=1", "training.init_model_with_meta_device=true"]),
    (
        "ulysses2",
        2,
        ["training.micro_batch_size=2", "parallel.ulysses_parallel_size=2", "model.recompute=true"],
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = make_video_assets(tmp_path_factory.mktemp("video_assets"))
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, COMMON, timeout=180)


@pytest.mark.slow
def test_wan_trains_the_same_in_every_layout(runs):
    ref = runs["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for name in ("fsdp2", "ulysses2"):
        for key in ("loss", "grad_norm"):
            a, b = [r[key] for r in ref], [r[key] for r in runs[name]]
            assert_close_series(a, b, 1e-5, f"wan2_2 {name} {key}")
        # 2 micro-batches of 2 clips of 3 x 2 x 2 video tokens per step
        assert [r["tokens"] for r in runs[name]] == [r["tokens"] for r in ref] == [48] * STEPS
    assert ref[0]["loss"] != ref[1]["loss"]  # the steps see different samples and noise
