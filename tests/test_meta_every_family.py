"""Every model id with tiny assets here (the 19 of ``test_grouping``) builds on the meta device, shards over 2
gloo ranks, is initialised there (``training.init_model_with_meta_device: true``: every tensor NaN-filled
first, and any tensor the initialisation leaves NaN stops the run naming it) and trains 2 steps with a finite
loss and gradient norm. All runs share one launch of 2 processes (:mod:`_launch`).

And each model's weights, saved as ``mm convert dcp-to-hf`` saves them, load into the model built on meta
and sharded (1 gloo rank, in this process) equal to a load without meta, for the ids
``test_family_weight_names`` does not cover on 2 ranks. Not yet: ``qwen3_omni_moe`` (an exported thinker
folder keeps its text weights under ``model.``; the per-rank reader does not map them to
``model.language_model.`` as transformers' own loading does, and the load stops naming the 24 tensors)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _launch import run_in_one_launch
from _mm import REPO, read_metrics
from test_grouping import FAMILIES

COMMON = [
    "training.train_iters=2",
    "training.log_interval=1",
    "training.save=null",
    "training.progress_bar=false",
    "training.micro_batch_size=1",
    "training.gradient_accumulation_steps=1",
    "training.init_model_with_meta_device=true",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "tools.tensorboard.enable=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    items, outs = [], {}
    for family, make in FAMILIES.items():
        cfg = make(tmp_path_factory.mktemp(family))
        outs[family] = tmp_path_factory.mktemp(f"{family}_meta")
        items.append((family, str(cfg), [*COMMON, f"training.output_dir={outs[family]}"]))
    run_in_one_launch(2, items, REPO, timeout=90 * len(items))
    for family, out in outs.items():  # the resolved config the run wrote: it did build on meta
        resolved = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
        assert resolved["training"]["init_model_with_meta_device"] is True, family
    return {family: read_metrics(out) for family, out in outs.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_initialises_on_meta_and_trains_on_two_ranks(family, runs):
    records = runs[family]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records), records


#: covered on 2 ranks by test_family_weight_names, or not loadable on meta yet (module docstring)
ELSEWHERE = {"qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "kimi_k25"}
ELSEWHERE |= {"minimax_m3_vl", "step3p7", "qwen3_omni_moe"}


def _save_weights(model: torch.nn.Module, source: str | None, folder: Path) -> None:
    """``model``'s weights in ``folder`` as mm convert dcp-to-hf writes them, beside its config folder."""
    from mm_core.convert import save_hf_weights

    if source and Path(source).is_dir():
        shutil.copytree(source, folder, dirs_exist_ok=True)
    save_hf_weights(model, folder)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - ELSEWHERE))
def test_family_loads_its_weights_on_meta_as_without(family, group, tmp_path):
    from mm_core.config import load_config
    from mm_core.convert import load_hf_weights
    from mm_core.models import ModelHub
    from mm_core.parallel.apply import check_initialised, materialize_meta, shard_model
    from mm_core.parallel.state import init_parallel_state
    from mm_core.tasks.building import build_settings, prepare_and_plan

    cfg = load_config(str(FAMILIES[family](tmp_path)))
    torch.manual_seed(0)
    _save_weights(ModelHub.build(cfg.model), cfg.model.model_name_or_path, tmp_path / "weights")
    cfg.model = cfg.model.model_copy(
        update={"model_name_or_path": str(tmp_path / "weights"), "from_scratch": False}
    )
    reference = ModelHub.build(cfg.model).state_dict()  # a load without meta
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    materialize_meta(model, state.device, init=False)  # NaN until loaded
    load_hf_weights(model, tmp_path / "weights")
    check_initialised(model)
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        assert torch.equal(full, reference[name]), name
