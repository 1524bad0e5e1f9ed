"""``mm check`` for expert parallelism: the expert-parallel modules and the experts of each rank are shown;
impossible settings stop with errors that name the YAML key."""

from __future__ import annotations

from _mm import mm
from test_ep_parity import moe_config


def test_check_shows_expert_placement(tmp_path):
    cfg = moe_config(tmp_path)
    out = mm("check", str(cfg), "parallel.expert_parallel_size=2", "--world-size", "4").stdout
    assert "expert par. : ep=2 x efsdp=2, from default ep plan of Qwen3MoeForTraining" in out
    assert "model.layers.0.mlp.experts, model.layers.1.mlp.experts" in out
    assert "ep rank 0: experts 0-3 of 8  (global ranks 0, 2)" in out
    assert "ep rank 1: experts 4-7 of 8  (global ranks 1, 3)" in out


def test_bad_expert_settings_are_refused(tmp_path):
    cfg = moe_config(tmp_path)
    bad = mm("check", str(cfg), "parallel.expert_parallel_size=3", "--world-size", "6", check=False)
    assert bad.returncode == 2
    assert "parallel.expert_parallel_size: got 3; model.layers.0.mlp.experts has 8 experts" in bad.stderr
    bad = mm(
        "check", str(cfg), "parallel.expert_parallel_size=2",
        "parallel.ep_plan.apply_modules=[model.layers.{*}.mlp]", "--world-size", "4", check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "is not a fused experts module" in bad.stderr
    bad = mm("check", str(cfg), "parallel.ep_plan.dispatcher=mc2", "--world-size", "4", check=False)
    assert bad.returncode == 2 and "parallel.ep_plan.dispatcher: got 'mc2'" in bad.stderr
