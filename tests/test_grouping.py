"""A family's loss does not depend on how samples are grouped into micro-batches: for each model id with tiny
assets here, 2 steps on 1 process with ``micro_batch_size: 2`` and with ``1`` × 2 accumulation steps, the same
samples in the same order (no shuffling; samples of different lengths, with and without images or audio
where the family takes them: Qwen3.5's vision-language ids on text, their towers idle), fp32: per-step loss
and gradient norm within 1e-5 relative. Not here: CosyVoice3's vocoder (``cosyvoice3_hift`` with its
discriminator), trained by its own task on fixed-length segments.

Paraformer is compared at step 1 only (loss and gradient norm: the same weights, the grouping alone differs):
funasr's CIF predictor fires a transcript's last token only when a float32 sum reaches its length exactly,
so the last-bit difference of gradients summed in another order can flip that token at step 2
(``packages/mm-models-funasr/README.md``).

The router's load-balancing loss is off (``router_aux_loss_coef: 0``): by its definition it is computed per
micro-batch, so it depends on the grouping (the loss compared here never includes it). Every run is one
training run in a single launch of 1 process (:mod:`_launch`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from _audio import make_audio_assets
from _cosyvoice import make_stage_configs
from _funasr import make_funasr_assets
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, assert_close_series, read_metrics
from _tiny import QWEN3_MOE, qwen3_5_overrides
from _video import make_ltx2_assets, make_video_assets
from _vlm import make_assets, make_family_assets, make_moe_assets
from test_tts_parity import make_tts_assets


def _text(model: dict | None = None) -> Callable[[Path], Path]:
    """The quickstart recipe (its tokenizer; ``model`` instead of its dense Qwen3 when given) on lines of the
    Python reference of different lengths (``reference_lines`` of ``_plugin_datasets``, the ``sft``
    collator: a micro-batch of two pads the shorter one)."""

    def make(root: Path) -> Path:
        raw = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
        if model is not None:
            raw["model"] = model
            raw["parallel"]["fsdp_plan"].pop("apply_modules", None)  # the model's own plan
        raw["data"]["dataset_param"] = {
            "dataset_type": "reference_lines",
            "basic_parameters": {"num_samples": 16, "cutoff_len": 48},
            "preprocess_parameters": {"model_name_or_path": str(QUICKSTART.parent / "tokenizer")},
        }
        raw["data"]["dataloader_param"]["collate_param"] = {"collator_id": "sft"}
        raw["training"]["plugin"] = ["_plugin_datasets"]
        path = root / "text.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        return path

    return make


def _scratch(model_id: str, overrides: dict) -> dict:
    """A tiny ``model_id`` over the quickstart tokenizer's 4096 tokens (the text model's, for a VLM)."""
    if "text_config" in overrides:
        overrides = {**overrides, "text_config": {**overrides["text_config"], "vocab_size": 4096}}
    else:
        overrides = {**overrides, "vocab_size": 4096}
    return {"model_id": model_id, "from_scratch": True, "config_overrides": overrides}


#: model id -> a function writing its tiny assets under a folder and returning the YAML
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "qwen3": _text(),
    "qwen3_moe": _text(_scratch("qwen3_moe", QWEN3_MOE)),
    **{m: _text(_scratch(m, qwen3_5_overrides(m))) for m in ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text")},
    "qwen3_vl": lambda root: make_assets(root),
    "qwen3_vl_moe": lambda root: make_moe_assets(root),
    **{f: (lambda root, f=f: make_family_assets(root, f)) for f in ("kimi_k25", "minimax_m3_vl", "step3p7")},
    **{f: (lambda root, f=f: make_audio_assets(root, f)) for f in ("qwen3_asr", "qwen3_omni_moe")},
    **{f: (lambda root, f=f: make_funasr_assets(root, f)) for f in ("fun_asr_nano", "paraformer")},
    "qwen3_tts": make_tts_assets,
    "cosyvoice3_lm": lambda root: make_stage_configs(root)["lm"],
    "cosyvoice3_flow": lambda root: make_stage_configs(root)["flow"],
    "wan2_2": make_video_assets,
    "ltx2": make_ltx2_assets,
}
COMMON = [
    "training.train_iters=2",
    "training.log_interval=1",
    "training.save=null",
    "training.progress_bar=false",
    "training.seed=3",
    "data.dataloader_param.shuffle=false",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "model.loss_cfg.router_aux_loss_coef=0",
    "tools.tensorboard.enable=false",
]
GROUPINGS = {
    "mbs2": ["training.micro_batch_size=2", "training.gradient_accumulation_steps=1"],
    "mbs1x2": ["training.micro_batch_size=1", "training.gradient_accumulation_steps=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    items, outs = [], {}
    for family, make in FAMILIES.items():
        cfg = make(tmp_path_factory.mktemp(family))
        for name, grouping in GROUPINGS.items():
            out = tmp_path_factory.mktemp(f"{family}_{name}")
            outs[family, name] = out
            extra = [*COMMON, *grouping, f"training.output_dir={out}"]
            items.append((f"{family} {name}", str(cfg), extra))
    run_in_one_launch(1, items, REPO, timeout=60 * len(items))
    return {f: {n: read_metrics(outs[f, n]) for n in GROUPINGS} for f in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_does_not_depend_on_micro_batch_grouping(family, runs):
    one, two = runs[family]["mbs2"], runs[family]["mbs1x2"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    if family == "paraformer":
        one, two = one[:1], two[:1]
    for key in ("loss", "grad_norm"):
        assert_close_series([r[key] for r in one], [r[key] for r in two], 1e-5, f"{family} {key}")
