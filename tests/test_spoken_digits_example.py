"""The spoken-digits example (``examples/spoken_digits``) end to end on its committed clips, without
espeak-ng: its processor and tiny Qwen3-ASR config from ``build_data.build_assets``, a few steps of its own
``config.yaml`` on 2 FSDP ranks (gloo) over ``sample/manifest.jsonl``, the checkpoint exported with
``mm convert dcp-to-hf`` and transcribed by ``evaluate.py``, which must report a CER for every clip.
Also: the committed sample is what its README says (16 kHz FLAC, digit transcripts, training and held-out
voices, small), and evaluate.py's character error rate counts edits."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from types import ModuleType

import pytest
from _mm import REPO, mm, read_metrics

EXAMPLE = REPO / "examples" / "spoken_digits"
SAMPLE = EXAMPLE / "sample"
STEPS = 3


def _load(name: str) -> ModuleType:
    """One of the example's scripts as a module (their names are not unique across examples)."""
    spec = importlib.util.spec_from_file_location(f"spoken_digits_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_committed_sample_matches_its_description():
    import soundfile as sf  # type: ignore[import-untyped]

    build_data = _load("build_data")
    lines = [json.loads(t) for t in (SAMPLE / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(x["text"], x["voice"], x["speed"], x["pitch"]) for x in lines] == list(build_data.SAMPLE)
    for line in lines:
        info = sf.info(str(SAMPLE / line["audio"]))
        assert (info.format, info.samplerate, info.channels) == ("FLAC", 16000, 1), line["audio"]
        assert 0.3 < info.duration < 3.0, line["audio"]
        assert line["text"].isdigit() and line["language"] == "English"
    held_out = set(build_data.voices(build_data.TEST_ACCENTS, build_data.TEST_VARIANTS))
    heard = set(build_data.voices(build_data.TRAIN_ACCENTS, build_data.TRAIN_VARIANTS))
    assert not held_out & heard
    voices = {x["voice"] for x in lines}
    assert voices & held_out and voices & heard and voices <= held_out | heard
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) < 300_000


def test_character_error_rate_counts_edits():
    evaluate = _load("evaluate")
    assert evaluate.levenshtein("371", "371") == 0
    assert evaluate.levenshtein("371", "391") == 1  # substitution
    assert evaluate.levenshtein("371", "31") == 1  # deletion
    assert evaluate.levenshtein("", "4013") == 4
    assert evaluate.levenshtein("kitten", "sitting") == 3
    assert evaluate.hypothesis("language English<asr_text>905") == "905"
    assert evaluate.hypothesis("905") == "905"


@pytest.mark.slow
def test_example_trains_on_two_ranks_and_evaluates(tmp_path, monkeypatch, capsys):
    assets = _load("build_data").build_assets(tmp_path / "build")
    run, ckpt, hf = tmp_path / "run", tmp_path / "ckpt", tmp_path / "hf"
    mm(
        "train",
        str(EXAMPLE / "config.yaml"),
        f"data.dataset_param.basic_parameters.dataset_dir={SAMPLE}",
        "data.dataset_param.basic_parameters.dataset=manifest.jsonl",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={assets / 'processor'}",
        f"model.model_name_or_path={assets / 'model'}",
        f"training.train_iters={STEPS}",
        "training.micro_batch_size=2",
        "training.log_interval=1",
        f"training.save={ckpt}",
        f"training.save_interval={STEPS}",
        f"training.output_dir={run}",
        "--nproc-per-node",
        "2",
        timeout=240,
    )
    metrics = read_metrics(run)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in metrics)
    mm("convert", "dcp-to-hf", str(ckpt), str(hf))

    out = tmp_path / "cer.json"
    manifest = SAMPLE / "manifest.jsonl"
    argv = [
        "evaluate.py",
        "--build",
        str(assets),
        "--model",
        str(hf),
        "--manifest",
        str(manifest),
        "--json",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    _load("evaluate").main()  # in this process: the script's own command line, without a second start-up
    results = json.loads(out.read_text(encoding="utf-8"))
    lines = manifest.read_text(encoding="utf-8").splitlines()
    assert results["clips"] == len(lines) == 12
    assert results["characters"] == sum(len(json.loads(t)["text"]) for t in lines)
    assert results["cer"] >= 0 and 0 <= results["exact_match"] <= 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cer"] == results["cer"]
