"""Qwen3-VL with videos and images mixed (micro-batches hold samples with images, videos, both and neither):
the vision tower runs once per forward over the images and videos together, the model's output equals
transformers' own (which runs it once for each), and 2 FSDP ranks train the same model as 1 process: gloo,
fp32, 8 steps, losses and gradient norms within 1e-5 relative."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml
from _mm import assert_close_series, train_layouts
from _vlm import make_assets, make_moe_assets, make_qwen3_5_assets

STEPS = 8
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]),
    ("fsdp2", 2, ["training.micro_batch_size=2", "training.gradient_accumulation_steps=2"]),
]


def _batch(cfg: dict, indices: list[int]) -> dict:
    from mm_data_vlm.collators import VLMCollator
    from mm_data_vlm.sft import VLMSFTDataset

    param = cfg["data"]["dataset_param"]
    ds = VLMSFTDataset(
        param["basic_parameters"], param["preprocess_parameters"], SimpleNamespace(on_error="raise")
    )
    batch = VLMCollator({}, ds)([ds[i] for i in indices])
    return {k: v for k, v in batch.items() if k not in ("sample_id", "skipped_samples")}


@pytest.mark.parametrize("model_id", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_one_tower_pass_equals_transformers(tmp_path, model_id):
    from transformers import (
        AutoConfig,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    from mm_models_qwen.qwen3_5 import Qwen3_5ForTraining
    from mm_models_qwen.qwen3_vl import Qwen3VLForTraining
    from mm_models_qwen.qwen3_vl_moe import Qwen3VLMoeForTraining

    path = make_assets(tmp_path, n=8, videos=True)
    if model_id == "qwen3_5":
        path = make_qwen3_5_assets(tmp_path, model_id, n=8, videos=True)
        overrides = yaml.safe_load(path.read_text())["model"]["config_overrides"]
        config = AutoConfig.for_model("qwen3_5", **overrides)
        reference_cls, ours_cls = Qwen3_5ForConditionalGeneration, Qwen3_5ForTraining
    elif model_id == "qwen3_vl_moe":
        path = make_moe_assets(tmp_path, n=8, videos=True)
        config = AutoConfig.from_pretrained(tmp_path / "model")
        reference_cls, ours_cls = Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeForTraining
    else:
        config = AutoConfig.from_pretrained(tmp_path / "model")
        reference_cls, ours_cls = Qwen3VLForConditionalGeneration, Qwen3VLForTraining
    batch = _batch(yaml.safe_load(path.read_text()), [0, 1, 2, 3])
    assert {"pixel_values", "pixel_values_videos"} <= set(batch)  # images and videos in one micro-batch
    torch.manual_seed(0)
    reference = reference_cls(config).eval()
    ours = ours_cls(config).eval()
    ours.load_state_dict(reference.state_dict())
    passes = []
    ours.model.visual.register_forward_hook(lambda *args: passes.append(1))
    with torch.no_grad():
        expected = reference(**batch).logits
        got = ours(**batch).logits
    assert len(passes) == 1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = make_assets(tmp_path_factory.mktemp("vlm_video_assets"), videos=True)
    common = [f"training.train_iters={STEPS}", "data.dataset_param.basic_parameters.cutoff_len=160"]
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, common=common, timeout=150)


@pytest.mark.slow
def test_fsdp2_with_videos_and_images_matches_single_process(runs):
    ref, got = runs["single"], runs["fsdp2"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close_series([r["loss"] for r in ref], [r["loss"] for r in got], 1e-5, "fsdp2 loss")
    assert_close_series([r["grad_norm"] for r in ref], [r["grad_norm"] for r in got], 1e-5, "fsdp2 grad_norm")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in got]
    assert ref[-1]["loss"] < ref[0]["loss"]
