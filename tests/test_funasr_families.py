"""Fun-ASR-Nano and Paraformer train the same model on 2 FSDP ranks as in 1 process: gloo, fp32, 3 steps, an
``asr_manifest`` of clips of several lengths through mm-data-audio's ``fun-asr-nano`` format and the ``audio``
collator. Losses and gradient norms agree within 1e-5 relative. A fast check first: the format's rows are
exactly the audio rows each tiny model consumes.

Fun-ASR-Nano (``per_token_loss``) runs 4 samples per micro-batch in 1 process and 2 per rank on 2 ranks, 2
micro-batches per step.

Paraformer (``loss_type: raw``: funasr's own loss, a mean over samples) runs one sample per micro-batch, 2 per
step: 2 micro-batches in 1 process, 1 per rank on 2 ranks, without gradient clipping, so both layouts compute
bitwise the same thing. It has to: funasr's CIF predictor scales its weights to sum exactly to the transcript
length and fires the last token only if that float32 sum reaches it, so a difference in the last bit (another
micro-batch shape, another summation order of gradients, a clipping factor one ulp apart) flips that token's
acoustic embedding between a frame and zeros (about 2% of the loss). Each layout is deterministic; they just
cannot be compared at 1e-5 unless every sample sees the same arithmetic. Several clips per micro-batch would
also pad them differently, and the CIF convolution reads the encoder output one frame past a clip's end.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _funasr import make_funasr_assets
from _mm import assert_close_series, train_layouts

STEPS = 3
FAMILIES = {
    "fun_asr_nano": (
        ["training.gradient_accumulation_steps=2"],
        [("single", 1, ["training.micro_batch_size=4"]), ("fsdp2", 2, ["training.micro_batch_size=2"])],
    ),
    "paraformer": (
        ["training.micro_batch_size=1", "training.clip_grad=null"],
        [
            ("single", 1, ["training.gradient_accumulation_steps=2"]),
            ("fsdp2", 2, ["training.gradient_accumulation_steps=1"]),
        ],
    ),
}


def _params() -> list:
    skip = pytest.mark.skipif(
        importlib.util.find_spec("funasr") is None,
        reason="funasr (mm-models-funasr[paraformer]) not installed",
    )
    return [pytest.param(f, marks=skip if f == "paraformer" else ()) for f in sorted(FAMILIES)]


@pytest.fixture(scope="module", params=_params())
def assets(request, tmp_path_factory):
    family = request.param
    return family, make_funasr_assets(tmp_path_factory.mktemp(f"{family}_assets"), family)


def test_format_rows_are_the_rows_each_model_consumes(assets):
    import yaml

    from mm_core.config.schema import ModelConfig
    from mm_core.models import ModelHub
    from mm_data_audio.collators import AudioCollator
    from mm_data_audio.manifest import ASRManifestDataset

    family, path = assets
    cfg = yaml.safe_load(path.read_text())
    params = cfg["data"]["dataset_param"]
    dataset = ASRManifestDataset(params["basic_parameters"], params["preprocess_parameters"])
    batch = AudioCollator({"collator_id": "audio"}, dataset)([dataset[i] for i in range(4)])
    rows = batch["input_features_mask"].sum(1)
    assert rows.tolist() == [7, 12, 18, 8]  # 0.4, 0.7, 1.1, 0.5 s
    assert int((batch["input_ids"] == dataset.audio_token_id).sum()) == int(rows.sum())
    model = ModelHub.build(ModelConfig(**cfg["model"]))
    for key in ("sample_id", "skipped_samples"):
        batch.pop(key)
    out = model(**batch)
    assert torch.isfinite(out.loss)
    if family == "fun_asr_nano":
        assert out.audio_hidden_states.shape[0] == int(rows.sum())


@pytest.mark.skipif(importlib.util.find_spec("funasr") is None, reason="funasr not installed")
def test_lfr_rows_are_funasr_front_end_rows():
    """The format's LFR stacking is the one of funasr's WavFrontend (what Paraformer was trained on)."""
    from mm_data_audio.formats.fun_asr import FunAsrNanoFormat
    from mm_models_funasr._funasr import paraformer_class

    paraformer_class()  # imports funasr without its side effects
    from funasr.frontends.wav_frontend import apply_lfr

    fmt = FunAsrNanoFormat({})
    for frames in range(1, 40):
        bank = torch.randn(frames, 80, generator=torch.Generator().manual_seed(frames))
        assert torch.equal(fmt.lfr(bank), apply_lfr(bank.clone(), 7, 6)), frames


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    family, cfg = assets
    common, layouts = FAMILIES[family]
    return family, train_layouts(
        tmp_path_factory, cfg, layouts, [f"training.train_iters={STEPS}", *common], 180
    )


@pytest.mark.slow
def test_family_matches_single_process(runs):
    family, got = runs
    ref = got["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for name in sorted(set(got) - {"single"}):
        for key in ("loss", "grad_norm"):
            a, b = [r[key] for r in ref], [r[key] for r in got[name]]
            assert_close_series(a, b, 1e-5, f"{family} {name} {key}")
        assert [r["tokens"] for r in ref] == [r["tokens"] for r in got[name]]
