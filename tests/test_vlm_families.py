"""Kimi K2.5, MiniMax-M3-VL and Step 3.7 with images train the same model on 2 FSDP ranks, with expert
parallelism 2, and (where the family's attention allows it) with Ulysses 2 context parallelism as in 1
process: gloo, fp32, 3 steps, the records and images of the Qwen3-VL parity test (several image sizes, 0-2
images per sample) through each family's image format, tiny mixture-of-experts models (dense first layers,
shared experts, Step's and MiniMax's clamped expert activations, Kimi's multi-head latent attention with
values wider than queries, MiniMax's block-sparse attention with a frozen indexer). Losses and gradient
norms agree within 1e-5 relative. MiniMax-M3-VL's sparse attention is refused under context parallelism,
naming why."""

from __future__ import annotations

import pytest
from _mm import assert_close_series, mm, train_layouts
from _vlm import FAMILIES, make_family_assets

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4"]),
    ("fsdp2", 2, ["training.micro_batch_size=2"]),
    ("ep2", 2, ["training.micro_batch_size=2", "parallel.expert_parallel_size=2"]),
    ("ulysses2", 2, ["training.micro_batch_size=4", "parallel.ulysses_parallel_size=2"]),
]
#: families whose attention context parallelism cannot split, and what mm says
NO_CONTEXT_PARALLEL = {"minimax_m3_vl": "has layers of type ['minimax_m3_sparse']"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request, tmp_path_factory):
    family = request.param
    cfg = make_family_assets(tmp_path_factory.mktemp(f"{family}_assets"), family)
    layouts = [lay for lay in LAYOUTS if not (lay[0] == "ulysses2" and family in NO_CONTEXT_PARALLEL)]
    return family, cfg, train_layouts(tmp_path_factory, cfg, layouts, COMMON, timeout=180)


@pytest.mark.slow
def test_family_with_images_matches_single_process(runs):
    family, cfg, got = runs
    ref = got["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for name in sorted(set(got) - {"single"}):
        for key in ("loss", "grad_norm"):
            a, b = [r[key] for r in ref], [r[key] for r in got[name]]
            assert_close_series(a, b, 1e-5, f"{family} {name} {key}")
        assert [r["tokens"] for r in ref] == [r["tokens"] for r in got[name]]
    if family in NO_CONTEXT_PARALLEL:
        proc = mm("check", str(cfg), "parallel.ulysses_parallel_size=2", "--world-size", "2", check=False)
        assert proc.returncode != 0
        why = NO_CONTEXT_PARALLEL[family]
        assert f"parallel.ulysses_parallel_size: model '{family}' {why}" in proc.stderr
