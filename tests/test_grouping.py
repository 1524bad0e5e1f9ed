"""A family's loss does not depend on how samples are grouped into micro-batches: for every registered model
id, 2 steps on 1 process with ``micro_batch_size: 2`` and with ``1`` × 2 accumulation steps, the same samples
in the same order (no shuffling; samples of different lengths, with and without images or audio where the
family takes them), fp32: per-step loss and gradient norm within 1e-5 relative. Qwen3.5's vision-language ids
(``qwen3_5``, ``qwen3_5_moe``) run on images: micro-batches mixing samples with 0, 1 and 2 images of different
sizes (:func:`_vlm.make_qwen3_5_assets`; their text-only runs of :data:`FAMILIES` are those of
``test_meta_every_family`` and ``test_cp_qwen3_5``). A test fails when a package registers an ``mm.models`` id
that no run here compares and :data:`NOT_COMPARED` does not list with a reason.

Paraformer is compared at step 1 only (loss and gradient norm: the same weights, the grouping alone differs):
funasr's CIF predictor fires a transcript's last token only when a float32 sum reaches its length exactly, so
the last-bit difference of gradients summed in another order can flip that token at step 2
(``packages/mm-models-funasr/README.md``).

CosyVoice3's vocoder (``cosyvoice3_hift``, with the discriminator ``cosyvoice3_hift_disc`` that its
``cosyvoice_vocoder`` task builds): samples of different lengths cannot share a micro-batch by the task's
design (it trains on equal crops, ``segment_samples``, and refuses a micro-batch of unequal lengths), so its
samples are 1920-sample crops of utterances of different lengths. Every loss the task logs is a mean over
samples (the TPR per sample: :mod:`mm_models_cosyvoice.vocoder_losses`, whose mean runs over the positions
ranked below the median: a count of those under it jumped where scores tied it, in one grouping only, and
moved the TPR by 6e-4), so none depends on the grouping by definition; what float rounding does to each
decides its tolerance (:data:`VOCODER_RTOL`, measured over training seeds 3-12):

- 1e-5: the generator's losses but TPR and the discriminator's loss at both steps (measured at most 8e-7), and
  the discriminator's gradient norm at step 1 (2e-6), on the same weights;
- 1e-4: the TPR loss (a mean of squared deviations of nearly equal scores, 6e-6) and the discriminator's
  gradient norm at step 2 (6e-6);
- 1e-3: the generator's gradient norm (1.05e-4). A sample's waveform computed in a batch of another size
  rounds differently, and the mel loss (of log spectra) amplifies that into the gradient: the same grouping on
  1 and on 2 threads moves this norm by up to 7e-5, the grouping moves it by 7e-5 at step 1 even with the
  discriminator's learning rate 0 (both models' weights equal), and by less than 3e-6 at step 1 with the mel
  loss's weight 0.

HiFTNet's own TPR, whose median and mean run over the whole micro-batch, fails here (measured: TPR 2.8e-3,
discriminator gradient norm 1.8e-5 at step 1).

The router's load-balancing loss is off (``router_aux_loss_coef: 0``): by its definition it is computed per
micro-batch, so it depends on the grouping (the loss compared here never includes it). Every run is one
training run in a single launch of 1 process (:mod:`_launch`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from _audio import make_audio_assets
from _cosyvoice import make_stage_configs, make_vocoder_config
from _funasr import make_funasr_assets
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, assert_close_series, read_metrics, registered_model_ids
from _tiny import QWEN3_MOE, qwen3_5_overrides
from _video import make_ltx2_assets, make_video_assets
from _vlm import make_assets, make_family_assets, make_moe_assets, make_qwen3_5_assets
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


#: model id -> a function writing its tiny assets under a folder and returning the YAML (also the runs of
#: test_meta_every_family, and test_cp_qwen3_5's Qwen3.5 on text)
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
#: the runs compared here, model id -> its assets: :data:`FAMILIES`, Qwen3.5's vision-language ids on images,
#: and CosyVoice3's vocoder
CASES: dict[str, Callable[[Path], Path]] = {
    **FAMILIES,
    **{m: (lambda root, m=m: make_qwen3_5_assets(root, m)) for m in ("qwen3_5", "qwen3_5_moe")},
    "cosyvoice3_hift": make_vocoder_config,
}
#: model ids a run builds besides its ``model:`` (a task's further models) -> that run
TASK_MODELS = {"cosyvoice3_hift_disc": "cosyvoice3_hift"}
#: registered model ids no run here compares -> why
NOT_COMPARED: dict[str, str] = {}
#: the vocoder task's metrics: the generator's loss and its parts, the discriminator's loss, both gradient
#: norms
VOCODER = ("loss", "loss_adv", "loss_fm", "loss_mel", "loss_tpr", "loss_f0", "loss_disc", "grad_norm",
           "grad_norm_discriminator")  # fmt: skip
#: (metric, step) -> the vocoder's relative tolerance where rounding alone passes 1e-5 (module docstring)
VOCODER_RTOL = {
    ("loss_tpr", 1): 1e-4,
    ("loss_tpr", 2): 1e-4,
    ("grad_norm_discriminator", 2): 1e-4,
    ("grad_norm", 1): 1e-3,
    ("grad_norm", 2): 1e-3,
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
    for family, make in CASES.items():
        cfg = make(tmp_path_factory.mktemp(family))
        for name, grouping in GROUPINGS.items():
            out = tmp_path_factory.mktemp(f"{family}_{name}")
            outs[family, name] = out
            extra = [*COMMON, *grouping, f"training.output_dir={out}"]
            items.append((f"{family} {name}", str(cfg), extra))
    run_in_one_launch(1, items, REPO, timeout=60 * len(items))
    return {f: {n: read_metrics(outs[f, n]) for n in GROUPINGS} for f in CASES}


def test_every_registered_model_id_is_compared_or_listed():
    registered = registered_model_ids()
    assert len(registered) >= 21, sorted(registered)
    compared = set(CASES) | set(TASK_MODELS)
    missing = registered - compared - set(NOT_COMPARED)
    assert not missing, f"registered ids no run here compares: add them to CASES or NOT_COMPARED: {missing}"
    assert not compared & set(NOT_COMPARED), "ids both compared and listed in NOT_COMPARED"
    assert (compared | set(NOT_COMPARED)) - registered == set(), "ids here that no package registers"
    assert all(NOT_COMPARED.values()), "every id of NOT_COMPARED needs its reason"


@pytest.mark.parametrize("family", sorted(set(CASES) - {"cosyvoice3_hift"}))
def test_loss_does_not_depend_on_micro_batch_grouping(family, runs):
    one, two = runs[family]["mbs2"], runs[family]["mbs1x2"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    if family == "paraformer":
        one, two = one[:1], two[:1]
    for key in ("loss", "grad_norm"):
        assert_close_series([r[key] for r in one], [r[key] for r in two], 1e-5, f"{family} {key}")


def test_vocoder_gan_does_not_depend_on_micro_batch_grouping(runs):
    one, two = runs["cosyvoice3_hift"]["mbs2"], runs["cosyvoice3_hift"]["mbs1x2"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in VOCODER:
            rtol = VOCODER_RTOL.get((key, a["step"]), 1e-5)
            assert a[key] == pytest.approx(b[key], rel=rtol, abs=0), f"vocoder step {a['step']} {key}"
