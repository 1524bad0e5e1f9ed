"""The moving-digits text-to-video example (``examples/moving_digits_t2v``): its clips, captions, held-out
split and judge (fast), and end to end at toy size (slow): ``build_data.build`` writes a store of a few clips
with a VAE trained 2 steps, the example's own ``config.yaml`` trains 2 steps on 2 FSDP ranks (gloo), the
checkpoint is exported with ``mm convert dcp-to-hf`` and ``sample.py`` samples one caption with 2 Euler steps
and writes its strip, GIF and scores."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from types import ModuleType

import numpy as np
import pytest
from _mm import REPO, mm, read_metrics

EXAMPLE = REPO / "examples" / "moving_digits_t2v"
STEPS = 2


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One of the example's scripts as a module; its directory on ``sys.path`` (they import
    ``moving_digits`` from beside them)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = importlib.util.spec_from_file_location(f"moving_digits_t2v_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_clips_captions_split_and_judge(monkeypatch):
    md = _load("moving_digits", monkeypatch)
    images, labels = md.load_digit_images()
    assert (md.FRAMES - 1) % 4 == 0 and md.CANVAS % 16 == 0
    for direction in md.DIRECTIONS:
        frames = md.render(images[0], direction, 5)
        assert frames.shape == (md.FRAMES, md.CANVAS, md.CANVAS, 3) and frames.dtype == np.uint8
        assert md.direction_of(frames) == direction
        ys, xs = zip(*md.positions(direction, 5))
        assert min(ys + xs) == 0 and max(ys + xs) == md.CANVAS - md.DIGIT  # edge to edge
    assert md.parse_caption(md.caption(3, "left")) == (3, "left")
    with pytest.raises(ValueError, match="direction"):
        md.parse_caption("a 3 moving sideways")

    train, held_out = md.split_images(len(images), 0)
    assert not set(train) & set(held_out) and len(train) + len(held_out) == len(images)
    specs = md.clip_specs(train, labels, 2, 0, held_out=False)
    trained_pairs = {(s.digit, s.direction) for s in specs}
    assert not trained_pairs & set(md.HELD_OUT_PAIRS)
    assert {d for d, _ in trained_pairs} == set(range(10)) and {w for _, w in trained_pairs} == set(
        md.DIRECTIONS
    )

    classifier = md.train_classifier(images[train], labels[train])
    test = md.clip_specs(held_out[:60], labels, 1, 1, held_out=True)
    clean = [md.render(images[s.image], s.direction, s.offset) for s in test]
    scores = md.judge(classifier, clean, [s.caption for s in test])
    assert scores["digit_frame_accuracy"] > 0.8 and scores["direction_accuracy"] == 1.0
    blank = [np.zeros_like(c) for c in clean]
    assert md.judge(classifier, blank, [s.caption for s in test])["direction_accuracy"] < 0.5


def test_committed_strip_is_small():
    strip = EXAMPLE / "samples_after_training.png"
    assert strip.is_file() and strip.stat().st_size < 100_000


@pytest.mark.slow
def test_example_builds_trains_on_two_ranks_and_samples(tmp_path, monkeypatch):
    build_data = _load("build_data", monkeypatch)
    build = build_data.build(tmp_path / "build", per_image=1, vae_steps=2, max_images=8)
    info = json.loads((build / "build_info.json").read_text(encoding="utf-8"))
    assert info["training_clips"] == 8 and (build / "store" / "index.jsonl").is_file()

    run, ckpt, hf = tmp_path / "run", tmp_path / "ckpt", tmp_path / "hf"
    mm(
        "train",
        str(EXAMPLE / "config.yaml"),
        f"data.dataset_param.basic_parameters.dataset={build / 'store'}",
        f"model.model_name_or_path={build / 'model'}",
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

    out, small = tmp_path / "samples", tmp_path / "readme.png"
    argv = ["--build", str(build), "--model", str(hf), "--captions", "a 3 moving left", "--per-caption", "1"]
    argv += ["--steps", "2", "--out", str(out), "--readme-strip", str(small)]
    results = _load("sample", monkeypatch).main(argv)
    assert results["clips"] == 1 and results["steps"] == 2
    assert 0 <= results["digit_frame_accuracy"] <= 1 and results["direction_accuracy"] in (0.0, 1.0)
    assert json.loads((out / "results.json").read_text(encoding="utf-8"))["clips"] == 1
    for path in (out / "strip.png", out / "samples.gif", small):
        assert path.is_file() and path.stat().st_size > 0, path
