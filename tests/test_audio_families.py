"""Qwen3-ASR and Qwen3-Omni-MoE's thinker with audio train the same model on 2 ranks as in 1 process: gloo,
fp32, 3 steps of 2 micro-batches, the tiny assets of ``_audio.py`` (tones over noise of 0.3-1.7 s through each
family's audio format, 0-2 clips per sample and, for Qwen3-Omni, 0-1 images: audio and image tokens in one
sequence; micro-batches without audio or without images on one rank but not the other, so the idle towers
run). Qwen3-ASR: FSDP2. Qwen3-Omni-MoE (4 fused experts, top-2, router load-balancing loss on): FSDP2, and
Ulysses 2 context parallelism with expert parallelism 2 over the same two ranks. Losses, router losses and
gradient norms agree within 1e-5 relative, token counts exactly."""

from __future__ import annotations

import pytest
from _audio import make_audio_assets
from _mm import assert_close_series, train_layouts

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
SINGLE = ("single", 1, ["training.micro_batch_size=4"])
FSDP2 = ("fsdp2", 2, ["training.micro_batch_size=2"])
LAYOUTS = {
    "qwen3_asr": [SINGLE, FSDP2],
    "qwen3_omni_moe": [
        SINGLE,
        FSDP2,
        # one run for both: the experts split over the 2 ranks that also split the sequence
        (
            "ulysses2_ep2",
            2,
            [
                "training.micro_batch_size=4",
                "parallel.ulysses_parallel_size=2",
                "parallel.expert_parallel_size=2",
            ],
        ),
    ],
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    family = request.param
    cfg = make_audio_assets(tmp_path_factory.mktemp(f"{family}_assets"), family)
    return family, train_layouts(tmp_path_factory, cfg, LAYOUTS[family], COMMON, timeout=180)


@pytest.mark.slow
def test_family_with_audio_matches_single_process(runs):
    family, got = runs
    ref = got["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    keys = ("loss", "grad_norm", "aux_loss") if family == "qwen3_omni_moe" else ("loss", "grad_norm")
    for name in sorted(set(got) - {"single"}):
        for key in keys:
            a, b = [r[key] for r in ref], [r[key] for r in got[name]]
            assert_close_series(a, b, 1e-5, f"{family} {name} {key}")
        assert [r["tokens"] for r in ref] == [r["tokens"] for r in got[name]]
