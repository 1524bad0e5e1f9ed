"""Paraformer behind mm's adapter: without funasr the package imports and the model is a ConfigError naming
the extra; with funasr (these tests skip otherwise) a tiny Paraformer builds from funasr's config.yaml (on the
meta device too), its plans match real modules, the adapter turns mm's batch into funasr's arguments
(front-end offset and CMVN, transcripts from the labelled positions) and funasr's result into ``.loss`` and
stats, refuses what it cannot map, and its weights round-trip through ``save_pretrained`` and funasr's
``model.pt``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from mm_core.config.schema import ModelConfig, TrainingConfig
from mm_core.errors import ConfigError, DataError
from mm_core.models import ModelHub, plan_of
from mm_core.optim.muon import muon_plan
from mm_core.parallel.apply import materialize_meta
from mm_parallel.patterns import match_modules

HAS_FUNASR = importlib.util.find_spec("funasr") is not None
needs_funasr = pytest.mark.skipif(
    not HAS_FUNASR, reason="funasr (mm-models-funasr[paraformer]) not installed"
)
VOCAB = 40
DIM = 560
#: a tiny Paraformer as funasr's config.yaml writes one (CTC on, glancing sampler off, no dropout)
CONFIG = {
    "model": "Paraformer",
    "model_conf": {
        "ctc_weight": 0.3,
        "lsm_weight": 0.1,
        "length_normalized_loss": False,
        "predictor_weight": 1.0,
        "predictor_bias": 1,
        "sampling_ratio": 0.0,
    },
    "vocab_size": VOCAB,
    "encoder": "SANMEncoder",
    "encoder_conf": {
        "output_size": 32,
        "attention_heads": 2,
        "linear_units": 64,
        "num_blocks": 2,
        "dropout_rate": 0.0,
        "positional_dropout_rate": 0.0,
        "attention_dropout_rate": 0.0,
        "input_layer": "pe",
        "pos_enc_class": "SinusoidalPositionEncoder",
        "normalize_before": True,
        "kernel_size": 5,
        "sanm_shfit": 0,
        "selfattention_layer_type": "sanm",
    },
    "decoder": "ParaformerSANMDecoder",
    "decoder_conf": {
        "attention_heads": 2,
        "linear_units": 64,
        "num_blocks": 2,
        "dropout_rate": 0.0,
        "positional_dropout_rate": 0.0,
        "self_attention_dropout_rate": 0.0,
        "src_attention_dropout_rate": 0.0,
        "att_layer_num": 2,
        "kernel_size": 5,
        "sanm_shfit": 0,
    },
    "predictor": "CifPredictorV2",
    "predictor_conf": {"idim": 32, "threshold": 1.0, "l_order": 1, "r_order": 1, "tail_threshold": 0.45},
    "frontend": "WavFrontend",
    "frontend_conf": {"fs": 16000, "n_mels": 80, "lfr_m": 7, "lfr_n": 6, "cmvn_file": "/trained/here/am.mvn"},
}


def write_folder(root: Path, **changes: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump({**CONFIG, **changes}, sort_keys=False))
    shift = " ".join(f"{-8.0 - 0.01 * i:.3f}" for i in range(DIM))
    scale = " ".join(f"{0.25 + 0.001 * i:.4f}" for i in range(DIM))
    (root / "am.mvn").write_text(
        f"<Nnet>\n<AddShift> {DIM} {DIM}\n<LearnRateCoef> 0 [ {shift} ]\n"
        f"<Rescale> {DIM} {DIM}\n<LearnRateCoef> 0 [ {scale} ]\n</Nnet>\n"
    )
    return root


def args(folder: Path, **kw: object) -> ModelConfig:
    return ModelConfig(model_id="paraformer", model_name_or_path=str(folder), **{"from_scratch": True, **kw})


def batch() -> dict[str, torch.Tensor]:
    """Three samples, one clip each (12, 9, 12 valid rows); labelled transcript positions among others."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 12, DIM, generator=g) - 8.0
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    labels = torch.full((3, 10), -100)
    labels[0, 4:7] = torch.tensor([5, 6, 7])
    labels[1, 6:8] = torch.tensor([8, 9])
    labels[2, 3:9] = torch.tensor([10, 11, 12, 13, 14, 15])
    return {
        "input_ids": torch.zeros(3, 10, dtype=torch.long),
        "labels": labels,
        "input_features": feats,
        "input_features_mask": mask,
    }


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    return write_folder(tmp_path / "paraformer")


def test_without_funasr_the_package_imports_and_the_model_names_the_extra(folder: Path) -> None:
    probe = textwrap.dedent(
        f"""
        import sys
        sys.modules["funasr"] = None  # import funasr raises ImportError, as when it is not installed
        import mm_models_funasr, mm_models_funasr.paraformer
        from mm_core.config.schema import ModelConfig
        from mm_core.errors import ConfigError
        from mm_core.models import ModelHub
        try:
            args = ModelConfig(model_id="paraformer", model_name_or_path={str(folder)!r}, from_scratch=True)
            ModelHub.build(args)
        except ConfigError as exc:
            print(exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "model.model_id: paraformer wraps the funasr package" in proc.stdout
    assert "pip install 'mm-models-funasr[paraformer]' (funasr==1.4.16)" in proc.stdout


@needs_funasr
def test_default_plans_match_modules(folder: Path) -> None:
    model = ModelHub.build(args(folder))
    plan = plan_of(model)
    units = sorted(n for names in match_modules(model, list(plan.fsdp_units)).values() for n in names)
    assert units == [
        "model.decoder.decoders.0",
        "model.decoder.decoders.1",
        "model.decoder.decoders3.0",
        "model.encoder.encoders.0",
        "model.encoder.encoders0.0",
    ]
    split = {d.name: d for d in muon_plan(model, TrainingConfig(train_iters=1), plan).decisions}
    for name in (
        "model.encoder.encoders0.0.self_attn.fsmn_block.weight",
        "model.decoder.decoders.1.self_attn.fsmn_block.weight",
        "model.predictor.cif_conv1d.weight",
        "model.predictor.cif_output.weight",
        "model.decoder.embed.0.weight",
        "model.decoder.output_layer.weight",
        "model.ctc.ctc_lo.weight",
    ):
        assert not split[name].use_muon, name
    assert split["model.encoder.encoders0.0.self_attn.fsmn_block.weight"].shape == (32, 1, 5)
    assert split["model.encoder.encoders.0.self_attn.linear_q_k_v.weight"].use_muon
    assert split["model.decoder.decoders.0.src_attn.linear_q.weight"].use_muon


@needs_funasr
def test_meta_init_and_the_front_end(folder: Path) -> None:
    model = ModelHub.build(args(folder), meta=True)
    materialize_meta(model, torch.device("cpu"), init=True)  # raises on any NaN left
    assert float(model.cmvn_shift[1]) == pytest.approx(-8.01) and float(model.cmvn_scale[0]) == 0.25
    b = batch()
    speech = model.speech(b["input_features"], b["input_features_mask"])
    offset = 2 * torch.log(torch.tensor(32768.0))  # funasr scales waveforms to the int16 range
    want = (b["input_features"][0, 0] + offset + model.cmvn_shift) * model.cmvn_scale
    assert torch.allclose(speech[0, 0], want, atol=1e-5)
    assert not speech[1, 9:].any()
    text, lengths = model.transcripts(b["labels"])
    assert lengths.tolist() == [3, 2, 6]
    assert text.tolist()[1] == [8, 9, -1, -1, -1, -1]


@needs_funasr
def test_forward_returns_funasr_loss_and_stats(folder: Path) -> None:
    model = ModelHub.build(args(folder))
    out = model(**batch(), use_cache=False)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss) and out.loss._base is None
    want = 0.3 * out.loss_ctc + 0.7 * out.loss_att + out.loss_pre  # funasr's CTC/attention/predictor mix
    assert torch.allclose(out.loss.detach(), want, rtol=1e-5)
    assert int(out.weight) == 3 and 0.0 <= float(out.acc) <= 1.0
    out.loss.backward()
    assert all(
        p.grad is not None for n, p in model.named_parameters() if not n.startswith("model.decoder.embed")
    )
    sampler = ModelHub.build(args(folder, config_overrides={"model_conf": {"sampling_ratio": 0.75}}))
    sampler(**batch()).loss.backward()  # the glancing sampler (a second decoder pass) trains the embedding
    assert sampler.model.decoder.embed[0].weight.grad is not None


@needs_funasr
def test_refusals(folder: Path, tmp_path: Path) -> None:
    model = ModelHub.build(args(folder))
    b = batch()
    with pytest.raises(DataError, match="have 80 values per row but the model's input_size is 560"):
        model(**{**b, "input_features": b["input_features"][..., :80]})
    with pytest.raises(DataError, match="2 clips for 3 samples"):
        model(
            **{
                **b,
                "input_features": b["input_features"][:2],
                "input_features_mask": b["input_features_mask"][:2],
            }
        )
    with pytest.raises(DataError, match="label id 40 is outside the model's vocabulary"):
        model(**{**b, "labels": b["labels"].masked_fill(b["labels"] == 15, VOCAB)})
    unlabelled = b["labels"].clone()
    unlabelled[1] = -100
    with pytest.raises(DataError, match=r"samples \[1\] of the micro-batch have no labelled"):
        model(**{**b, "labels": unlabelled})
    with pytest.raises(ConfigError, match="needs a folder with funasr's config.yaml"):
        ModelHub.build(ModelConfig(model_id="paraformer", from_scratch=True))
    with pytest.raises(ConfigError, match="could not build Paraformer"):
        ModelHub.build(args(folder, config_overrides={"encoder": "NoSuchEncoder"}))
    with pytest.raises(ConfigError, match="builds funasr's Paraformer only"):
        ModelHub.build(args(folder, config_overrides={"model": "SenseVoiceSmall"}))
    with pytest.raises(ConfigError, match="holds no model.safetensors or model.pt"):
        ModelHub.build(args(folder, from_scratch=False))


@needs_funasr
def test_weights_round_trip(folder: Path, tmp_path: Path) -> None:
    model = ModelHub.build(args(folder)).eval()
    with torch.no_grad():
        want = model(**batch()).loss
    export = tmp_path / "export"
    model.save_pretrained(export)
    assert sorted(p.name for p in export.iterdir()) == ["am.mvn", "config.yaml", "model.safetensors"]
    loaded = ModelHub.build(args(export, from_scratch=False)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch()).loss, want)
    # funasr's release layout: model.pt with funasr's names (no safetensors)
    release = write_folder(tmp_path / "release")
    torch.save(model.model.state_dict(), release / "model.pt")
    with pytest.raises(ConfigError, match="holds funasr's model.pt only, which meta-device init cannot read"):
        ModelHub.build(args(release, from_scratch=False), meta=True)
    loaded = ModelHub.build(args(release, from_scratch=False)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch()).loss, want)
    from safetensors.torch import load_file

    from mm_models_funasr.paraformer import convert_funasr_weights

    converted = load_file(str(convert_funasr_weights(release)))
    meta = ModelHub.build(args(release, from_scratch=False), meta=True)  # safetensors now: accepted
    assert {k for k, _ in meta.named_parameters()} == set(converted)
    assert torch.equal(converted["model.ctc.ctc_lo.weight"], model.model.ctc.ctc_lo.weight)
    bad = write_folder(tmp_path / "bad")
    torch.save({"encoder.nothing": torch.zeros(1)}, bad / "model.pt")
    with pytest.raises(ConfigError, match="lacks tensors for this Paraformer"):
        ModelHub.build(args(bad, from_scratch=False))
