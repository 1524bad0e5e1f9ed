"""Tiny video diffusion transformers train the same model on 2 FSDP ranks and with Ulysses 2 context
parallelism over the video tokens as in 1 process: gloo, fp32, 3 steps of 2 micro-batches, the flow-matching
loss on noise and noise levels drawn from each sample's seed. Losses and gradient norms agree within 1e-5
relative and the token counts are equal (each Ulysses rank counts its share: a model that did not split would
count the video tokens twice). The FSDP layout builds the model on the meta device and loads the diffusers
folder into the shards; the Ulysses layout recomputes the blocks (activation checkpointing around the
all-to-all attention).

- ``wan2_2``: latents of random clips encoded by a tiny VAE;
- ``ltx2``: random video and audio latents with two text embeddings and a text mask, the joint audio + video
  loss; under Ulysses the video tokens are split and the audio stream is computed whole on both ranks, with
  the video keys and values gathered for the video-to-audio attention.

Each FSDP run's last checkpoint is exported with ``mm convert dcp-to-hf`` into a folder diffusers loads."""

from __future__ import annotations

import pytest
from _mm import assert_close_series, train_layouts
from _video import LTX2_AUDIO, LTX2_VIDEO, assert_export_loads, make_ltx2_assets, make_video_assets

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
#: tokens per sample: Wan, 3 × 2 × 2 video tokens; LTX-2, F × H × W video tokens plus one per audio frame
TOKENS = {"wan2_2": 3 * 2 * 2, "ltx2": LTX2_VIDEO[1] * LTX2_VIDEO[2] * LTX2_VIDEO[3] + LTX2_AUDIO[1]}
ASSETS = {"wan2_2": make_video_assets, "ltx2": make_ltx2_assets}


@pytest.fixture(scope="module", params=sorted(ASSETS))
def runs(request, tmp_path_factory):
    """(family, metrics by layout, the checkpoint folder of the FSDP run)."""
    family = request.param
    cfg = ASSETS[family](tmp_path_factory.mktemp(f"{family}_assets"))
    ckpt = tmp_path_factory.mktemp(f"{family}_ckpt")
    save = [f"training.save={ckpt}", f"training.save_interval={STEPS}"]
    layouts = [(name, n, extra + save if name == "fsdp2" else extra) for name, n, extra in LAYOUTS]
    return family, train_layouts(tmp_path_factory, cfg, layouts, COMMON, timeout=180), ckpt


@pytest.mark.slow
def test_video_models_train_the_same_in_every_layout(runs):
    family, by_layout, _ = runs
    ref = by_layout["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    # LTX-2 also reports the two parts of its joint loss (ModelPlan.loss_parts)
    keys = ("loss", "grad_norm", "video_loss", "audio_loss") if family == "ltx2" else ("loss", "grad_norm")
    for name in ("fsdp2", "ulysses2"):
        for key in keys:
            a, b = [r[key] for r in ref], [r[key] for r in by_layout[name]]
            assert_close_series(a, b, 1e-5, f"{family} {name} {key}")
        # 2 micro-batches of 2 samples per step
        assert (
            [r["tokens"] for r in by_layout[name]]
            == [r["tokens"] for r in ref]
            == [4 * TOKENS[family]] * STEPS
        )
    assert ref[0]["loss"] != ref[1]["loss"]  # the steps see different samples and noise
    if family == "ltx2":  # loss = video_loss + audio_loss_weight (1) × audio_loss, per micro-batch
        for r in ref:
            assert r["loss"] == pytest.approx(r["video_loss"] + r["audio_loss"], rel=1e-6)


@pytest.mark.slow
def test_the_fsdp_checkpoint_exports_a_diffusers_folder(runs, tmp_path):
    family, _, ckpt = runs
    diffusers_class = {"wan2_2": "WanTransformer3DModel", "ltx2": "LTX2VideoTransformer3DModel"}[family]
    assert_export_loads(ckpt / f"step_{STEPS}", tmp_path / "transformer", diffusers_class)
