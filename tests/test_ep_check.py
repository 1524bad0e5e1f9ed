"""``mm check`` for expert parallelism: the expert-parallel modules and the experts of each rank are shown;
impossible settings (and the guide's gathering keys used wrongly) stop with errors that name the YAML key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from _mm import REPO, mm
from test_ep_parity import moe_config

from mm_core.check import run_check
from mm_core.config import load_config
from mm_core.errors import ConfigError


def test_check_shows_expert_placement(tmp_path):
    cfg = moe_config(tmp_path)
    out = mm("check", str(cfg), "parallel.expert_parallel_size=2", "--world-size", "4").stdout
    assert "expert par. : ep=2 x efsdp=2, from default ep plan of Qwen3MoeForTraining" in out
    assert "model.layers.0.mlp.experts, model.layers.1.mlp.experts" in out
    assert "ep rank 0: experts 0-3 of 8  (global ranks 0, 2)" in out
    assert "ep rank 1: experts 4-7 of 8  (global ranks 1, 3)" in out


def test_bad_expert_settings_are_refused(tmp_path):
    cfg = moe_config(tmp_path)
    cases = [
        ["parallel.expert_parallel_size=3", "--world-size", "6"],
        ["parallel.expert_parallel_size=2", "parallel.ep_plan.apply_modules=[model.layers.{*}.mlp]",
         "--world-size", "4"],
        ["parallel.ep_plan.dispatcher=mc2", "--world-size", "4"],
    ]  # fmt: skip
    with ThreadPoolExecutor(max_workers=3) as pool:  # three independent one-process commands
        uneven, not_fused, mc2 = pool.map(lambda args: mm("check", str(cfg), *args, check=False), cases)
    assert uneven.returncode == 2
    assert "parallel.expert_parallel_size: got 3; model.layers.0.mlp.experts has 8 experts" in uneven.stderr
    assert not_fused.returncode == 2 and "is not a fused experts module" in not_fused.stderr
    assert mc2.returncode == 2 and "parallel.ep_plan.dispatcher: got 'mc2'" in mc2.stderr


def _check(cfg, *overrides: str, world: int = 4) -> None:
    """``mm check`` in this process (the same function the CLI calls), quiet."""
    run_check(load_config(cfg, list(overrides)), world, quiet=True)


def test_guide_gathering_and_efsdp_keys_are_checked(tmp_path):
    cfg = moe_config(tmp_path)
    ep2 = "parallel.expert_parallel_size=2"
    # the guide's values are accepted: every expert module over efsdp, hook groups at the decoder layers
    _check(
        cfg, ep2, "parallel.ep_plan.apply_efsdp_modules=[model.layers.{*}.mlp.experts]",
        "parallel.fsdp_plan.hook_modules=[model.layers.{*}]", "parallel.fsdp_plan.pregather=true",
        "parallel.ep_plan.dispatcher=allgather",
    )  # fmt: skip
    cases = [
        ([ep2, "parallel.ep_plan.apply_efsdp_modules=[model.layers.0.mlp.experts]"],
         r"apply_efsdp_modules: model\.layers\.1\.mlp\.experts is expert-parallel but not listed"),
        ([ep2, "parallel.ep_plan.apply_efsdp_modules=[model.layers.{*}.mlp]"],
         r"apply_efsdp_modules: model\.layers\.0\.mlp is not an expert-parallel module"),
        (["parallel.ep_plan.apply_efsdp_modules=[model.layers.{*}.mlp.experts]"],
         r"apply_efsdp_modules: .* expert parallelism is off"),
        ([ep2, "parallel.fsdp_plan.hook_modules=[model.layers.{*}.self_attn]"],
         r"hook_modules: model\.layers\.0\.self_attn holds no FSDP unit"),
        (["parallel.fsdp_plan.hook_modules=[model, model.layers.{*}]"],
         r"hook_modules: model\.layers\.0 is inside model; hook modules must not nest"),
        (["parallel.fsdp_plan.hook_modules=[model.layer.{*}]"], r"hook_modules: .*did you mean"),
    ]  # fmt: skip
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            _check(cfg, *overrides)


def test_moe_example_is_a_valid_expert_parallel_recipe(capsys):
    """examples/qwen3_moe/config.yaml passes every check of `mm train` for its 2 processes."""
    run_check(load_config(REPO / "examples" / "qwen3_moe" / "config.yaml", []), 2)
    out = capsys.readouterr().out
    assert "expert par. : ep=2 x efsdp=1" in out and "ep rank 1: experts 4-7 of 8" in out
    assert "hook groups : the FSDP units inside each of model.layers.{*}" in out
