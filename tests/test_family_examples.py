"""The three single-family examples end to end at toy size, their training runs sharing one launch of 2 gloo
processes: ``examples/qwen3_5_digits`` (dense Qwen3.5 on the handwritten digits), ``examples/
fun_asr_nano_digits`` (Fun-ASR-Nano on the committed spoken-digits clips, no espeak-ng) and ``examples/
ltx2_moving_digits`` (LTX-2 on a moving-digits latent store of 8 clips with a VAE trained 2 steps). Each runs
its own ``config.yaml`` on 2 FSDP ranks (the data paths pointed at the toy assets, a smaller batch, fewer
steps), its loss falls (the mean of the last steps below the first step's), the checkpoint is exported with
``mm convert dcp-to-hf``, and the example's evaluation runs on the export: the digits' exact-match accuracy,
the held-out CER of the spoken digits, a sampled clip and its scores."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _mm import REPO, mm_here, read_metrics

EXAMPLES = REPO / "examples"
SPOKEN_SAMPLE = EXAMPLES / "spoken_digits" / "sample"
#: example -> training steps: the fewest whose loss falls clearly at the toy sizes below
STEPS = {"qwen3_5_digits": 12, "fun_asr_nano_digits": 12, "ltx2_moving_digits": 12}


def _load(example: str, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``examples/<example>/<name>.py`` as a module, its folder on ``sys.path`` (for its neighbours)."""
    folder = EXAMPLES / example
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(f"{example}_{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _overrides(example: str, assets: dict[str, Path], root: Path) -> list[str]:
    if example == "qwen3_5_digits":
        build = assets[example]
        paths = [
            f"data.dataset_param.basic_parameters.dataset_dir={build / 'data'}",
            f"data.dataset_param.preprocess_parameters.model_name_or_path={build / 'processor'}",
            f"model.model_name_or_path={build / 'model'}",
            "training.micro_batch_size=4",
        ]
    elif example == "fun_asr_nano_digits":
        build = assets[example]
        paths = [
            f"data.dataset_param.basic_parameters.dataset_dir={SPOKEN_SAMPLE}",
            "data.dataset_param.basic_parameters.dataset=manifest.jsonl",
            f"data.dataset_param.preprocess_parameters.model_name_or_path={build / 'processor'}",
            f"model.model_name_or_path={build / 'model'}",
            "training.micro_batch_size=2",
        ]
    else:
        paths = [
            f"data.dataset_param.basic_parameters.dataset={assets[example] / 'store'}",
            "training.micro_batch_size=2",
        ]
    steps = STEPS[example]
    return [
        *paths,
        f"training.train_iters={steps}",
        f"training.save={root / example / 'ckpt'}",
        f"training.save_interval={steps}",
        f"training.output_dir={root / example / 'run'}",
        "training.progress_bar=false",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from _launch import run_in_one_launch

    root = tmp_path_factory.mktemp("family_examples")
    with pytest.MonkeyPatch.context() as monkeypatch:
        digits = _load("qwen3vl_digits", "build_data", monkeypatch)
        spoken = _load("spoken_digits", "build_data", monkeypatch)
        moving = _load("moving_digits_t2v", "build_data", monkeypatch)
        assets = {
            "qwen3_5_digits": digits.build(root / "qwen3_5_build", family="qwen3_5"),
            "fun_asr_nano_digits": spoken.build_assets(root / "fun_asr_nano_build", "fun_asr_nano"),
            "ltx2_moving_digits": moving.build(root / "moving_build", per_image=1, vae_steps=2, max_images=8),
        }
    items = [(ex, str(EXAMPLES / ex / "config.yaml"), _overrides(ex, assets, root)) for ex in STEPS]
    run_in_one_launch(2, items, REPO, timeout=600)
    return {"root": root, "assets": assets}


def _trained(runs: dict[str, Any], example: str) -> tuple[list[dict], Path]:
    """The run's metrics (a falling loss checked) and its exported Hugging Face / diffusers folder."""
    out = runs["root"] / example
    metrics = read_metrics(out / "run")
    steps = STEPS[example]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    losses = [r["loss"] for r in metrics]
    assert all(math.isfinite(x) and x > 0 for x in losses), losses
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], f"{example}: the loss does not fall: {losses}"
    hf = out / "hf"
    proc = mm_here("convert", "dcp-to-hf", str(out / "ckpt"), str(hf))
    assert proc.returncode == 0, proc.stderr
    return metrics, hf


@pytest.mark.slow
def test_qwen3_5_digits(runs, monkeypatch, capsys):
    _, hf = _trained(runs, "qwen3_5_digits")
    build = runs["assets"]["qwen3_5_digits"]
    argv = ["evaluate.py", "--build", str(build), "--model", str(hf), "--limit", "8"]
    monkeypatch.setattr(sys, "argv", argv)
    _load("qwen3vl_digits", "evaluate", monkeypatch).main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["test_images"] == 8 and 0 <= result["exact_match_accuracy"] <= 1


@pytest.mark.slow
def test_fun_asr_nano_digits(runs, monkeypatch, capsys, tmp_path):
    _, hf = _trained(runs, "fun_asr_nano_digits")
    out, manifest = tmp_path / "cer.json", SPOKEN_SAMPLE / "manifest.jsonl"
    argv = ["evaluate.py", "--build", str(runs["assets"]["fun_asr_nano_digits"]), "--model", str(hf)]
    monkeypatch.setattr(sys, "argv", [*argv, "--manifest", str(manifest), "--json", str(out)])
    _load("spoken_digits", "evaluate", monkeypatch).main()
    results = json.loads(out.read_text(encoding="utf-8"))
    lines = manifest.read_text(encoding="utf-8").splitlines()
    assert results["clips"] == len(lines) == 12
    assert results["cer"] >= 0 and 0 <= results["exact_match"] <= 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cer"] == results["cer"]


@pytest.mark.slow
def test_ltx2_moving_digits(runs, monkeypatch, tmp_path):
    _, hf = _trained(runs, "ltx2_moving_digits")
    config = json.loads((hf / "config.json").read_text(encoding="utf-8"))
    assert config["_class_name"] == "LTX2VideoTransformer3DModel"
    build, out = runs["assets"]["ltx2_moving_digits"], tmp_path / "samples"
    argv = ["--build", str(build), "--model", str(hf), "--captions", "a 3 moving left", "--per-caption", "1"]
    results = _load("moving_digits_t2v", "sample", monkeypatch).main(
        [*argv, "--steps", "2", "--out", str(out)]
    )
    assert results["clips"] == 1 and results["steps"] == 2
    assert 0 <= results["digit_frame_accuracy"] <= 1 and results["direction_accuracy"] in (0.0, 1.0)
    for name in ("strip.png", "samples.gif", "results.json"):
        assert (out / name).is_file(), name
