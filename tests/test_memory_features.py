"""Each memory feature on the quickstart model (fp32, FSDP over 2 gloo ranks) gives the per-step losses of
the plain run within 1e-6 relative: recompute (full and selective), activation offload, FSDP2 CPU offload,
forward/backward prefetch."""

from __future__ import annotations

import pytest
from _memory_runs import run_variants
from _mm import assert_close_series

VARIANTS = {
    "plain": [],
    "recompute": ["model.recompute=true"],
    "selective": [
        "model.recompute=true",
        "model.recompute_plan.recompute_granularity=selective",
        "model.recompute_plan.save_ops=[attention]",
    ],
    "offload": [
        "model.activation_offload=true",
        "model.activation_offload_plan.apply_modules=[model.layers.{*}]",
    ],
    "cpu_offload": ["parallel.fsdp_plan.cpu_offload=true"],
    "prefetch": [
        "parallel.fsdp_plan.num_to_forward_prefetch=1",
        "parallel.fsdp_plan.num_to_backward_prefetch=1",
    ],
}


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    return run_variants(2, VARIANTS, str(tmp_path_factory.mktemp("memory")))


@pytest.mark.slow
@pytest.mark.parametrize("feature", [k for k in VARIANTS if k != "plain"])
def test_feature_keeps_losses(losses, feature):
    ref = losses["plain"]
    assert len(ref) == 3 and ref[-1] < ref[0]
    assert_close_series(ref, losses[feature], 1e-6, feature)
