"""Every model id with tiny assets here (the 19 of ``test_grouping``) builds on the meta device, shards over 2
gloo ranks, is initialised there (``training.init_model_with_meta_device: true``: every tensor NaN-filled
first, and any tensor the initialisation leaves NaN stops the run naming it) and trains 2 steps with a finite
loss and gradient norm. All runs share one launch of 2 processes (:mod:`_launch`).

Loading Hugging Face weights on meta, equal to a load without meta, is ``test_family_weight_names``'s."""

from __future__ import annotations

import math

import pytest
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
