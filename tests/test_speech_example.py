"""The CosyVoice3 speech example (``examples/speech_cosyvoice``): its committed sample and k-means speech
tokenizer (fast), and end to end at toy size (slow), without espeak-ng: ``build_data.build`` makes the
stores, tokenizers and model configs from the committed utterances, each stage's own YAML trains 2 steps on
2 FSDP ranks (gloo): the LM stage with ``mm train --nproc-per-node 2`` as ``train.sh`` runs it, the flow and
vocoder stages after it in one launch of 2 processes (``_launch``: each run as an ``mm train`` worker runs
it), every stage is exported as ``mm convert dcp-to-hf`` exports it, and ``synthesize.py`` speaks a held-out
sentence (2 flow steps) and measures every stage."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from types import ModuleType

import numpy as np
import pytest
from _launch import run_in_one_launch
from _mm import REPO, mm, read_metrics

EXAMPLE = REPO / "examples" / "speech_cosyvoice"
SAMPLE = EXAMPLE / "sample"
STEPS = 2
SPEECH_VOCAB = 16


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One of the example's scripts as a module; its directory on ``sys.path`` (build_data imports
    ``kmeans_tokenizer`` from beside it)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = importlib.util.spec_from_file_location(f"speech_cosyvoice_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_committed_sample_matches_its_description(monkeypatch):
    import soundfile as sf  # type: ignore[import-untyped]

    build_data = _load("build_data", monkeypatch)
    lines = [json.loads(t) for t in (SAMPLE / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(x["id"], x["digits"], x["split"]) for x in lines] == list(build_data.SAMPLE)
    for line in lines:
        info = sf.info(str(SAMPLE / line["audio"]))
        assert (info.format, info.samplerate, info.channels) == ("FLAC", 24000, 1), line["audio"]
        assert info.frames % 960 == 0 and 0.5 < info.duration < 3.0, line["audio"]
        assert line["text"] == build_data.words(line["digits"])
    assert {x["split"] for x in lines} == {"train", "test"}
    assert len({x["digits"] for x in lines}) == len(lines)  # a held-out text is never a training one
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) < 1_000_000


def test_kmeans_tokenizer_codes_frame_pairs(monkeypatch):
    kt = _load("kmeans_tokenizer", monkeypatch)
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 160)).astype(np.float32) * 5
    ids = rng.integers(0, 4, 50)
    mels = [(centres[ids] + rng.normal(size=(50, 160)) * 0.1).reshape(100, 80)]
    tok, mse = kt.KMeansSpeechTokenizer.fit(mels, 4, seed=0)
    codes = tok.encode(mels[0])
    assert codes.shape == (50,) and codes.dtype == np.int64 and mse < 0.05
    # the same clusters, whatever their numbering
    assert len(set(zip(codes.tolist(), ids.tolist()))) == 4
    assert np.abs(tok.decode(codes) - mels[0]).mean() < 0.1
    assert np.array_equal(tok.encode(tok.decode(codes)), codes)
    with pytest.raises(ValueError, match="T even"):
        kt.frame_pairs(np.zeros((3, 80)))
    with pytest.raises(ValueError, match="fewer centroids"):
        kt.KMeansSpeechTokenizer.fit(mels, 64, seed=0)


@pytest.mark.slow
def test_example_trains_every_stage_and_speaks_a_held_out_sentence(tmp_path, monkeypatch):
    import soundfile as sf

    from mm_core.convert import dcp_to_hf

    build_data = _load("build_data", monkeypatch)
    build = tmp_path / "build"
    info = build_data.build(build_data.read_sample(SAMPLE), build, SPEECH_VOCAB, seed=0)
    assert info["utterances"] == {"train": 9, "test": 3} and info["speech_vocab"] == SPEECH_VOCAB

    runs = tmp_path / "runs"

    def overrides(stage: str) -> list[str]:
        extra = [f"data.dataset_param.basic_parameters.dataset={build / 'store'}"]
        if stage == "lm":
            extra.append(f"data.dataset_param.preprocess_parameters.model_name_or_path={build / 'tokenizer'}")
        if stage != "vocoder":
            extra.append(f"model.model_name_or_path={build / 'models' / stage}")
        return [
            *extra,
            f"training.train_iters={STEPS}",
            "training.micro_batch_size=2",
            f"training.save={runs / stage / 'checkpoints'}",
            f"training.output_dir={runs / stage}",
            "training.progress_bar=false",
        ]

    # the first stage as a user runs it; the other two in one launch (the same worker, without the CLI)
    mm("train", str(EXAMPLE / "lm.yaml"), *overrides("lm"), "--nproc-per-node", "2", timeout=240)
    later = [(stage, str(EXAMPLE / f"{stage}.yaml"), overrides(stage)) for stage in ("flow", "vocoder")]
    run_in_one_launch(2, later, REPO, timeout=480)
    for stage in ("lm", "flow", "vocoder"):
        metrics = read_metrics(runs / stage)
        assert [r["step"] for r in metrics] == list(range(1, STEPS + 1)), stage
        assert all(math.isfinite(r["loss"]) for r in metrics), stage
        dcp_to_hf(runs / stage / "checkpoints", runs / stage / "hf")  # what `mm convert dcp-to-hf` does

    out = tmp_path / "out"
    synthesize = _load("synthesize", monkeypatch)
    results = synthesize.main(
        ["--build", str(build), "--runs", str(runs), "--out", str(out), "--flow-steps", "2"]
    )
    assert results == json.loads((out / "results.json").read_text(encoding="utf-8"))
    tokens = results["utterance"]["speech_tokens"]
    for name in ("heldout", "heldout_gt_tokens", "heldout_vocoder", "heldout_reference"):
        wave, rate = sf.read(str(out / f"{name}.wav"), dtype="float32")
        assert rate == 24000 and wave.ndim == 1 and len(wave) > 0 and np.isfinite(wave).all(), name
    assert results["files"]["heldout_gt_tokens"]["seconds"] == tokens * 960 / 24000
    assert results["generated"]["tokens"] * 960 / 24000 == results["files"]["heldout"]["seconds"]
    assert results["heldout_utterances"] == 3
    for key in ("flow_mel_l1_heldout", "vocoder_mel_l1_heldout", "tokens_to_wave_mel_l1_heldout"):
        assert set(results[key]) == {"untrained", "trained"}
        assert all(math.isfinite(v) and v > 0 for v in results[key].values()), key
    assert 0 <= results["lm_heldout"]["trained"]["accuracy"] <= 1
    assert results["training"]["vocoder"]["last_step"] == STEPS
