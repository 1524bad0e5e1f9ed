"""``examples/qwen3vl_moving_digits`` at toy size: the clips move the way their answer says, and the
example's evaluation runs the whole video path (records, PyAV, Qwen3-VL video processor, the model's
``pixel_values_videos``) on a few held-out clips. The training run itself is the README's command (minutes
on CPU), not a test; training with videos on 2 ranks is ``tests/test_vlm_video_parity.py``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from _mm import REPO

FOLDER = REPO / "examples" / "qwen3vl_moving_digits"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(FOLDER))
    spec = importlib.util.spec_from_file_location(f"qwen3vl_moving_digits_{name}", FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_clips_move_the_way_the_answer_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mm_data_vlm.videos import load_frames, probe_video

    build = _load("build_data", monkeypatch)
    out = build.build(tmp_path / "build", limit=24)
    records = json.loads((out / "data" / "train.json").read_text())
    records += json.loads((out / "data" / "test.json").read_text())
    assert len(records) == 24 and {r["messages"][1]["content"] for r in records} <= set(build.DIRECTIONS)
    for record in records:
        path = out / "data" / record["videos"][0]
        header = probe_video(path)
        assert (header.frames, header.width, header.height) == (build.FRAMES, build.CANVAS, build.CANVAS)
        frames = load_frames(path, header, list(range(header.frames))).astype(np.float64).sum(-1)
        # each frame is the one before it moved STEP pixels one way (wrapping around): the way that fits best
        # (H.264 is lossy) is the answer, for every pair of frames
        for before, after in zip(frames[:-1], frames[1:]):
            error = {
                name: np.abs(np.roll(before, (dy * build.STEP, dx * build.STEP), axis=(0, 1)) - after).mean()
                for name, (dy, dx) in build.MOVES.items()
            }
            assert min(error, key=lambda name: error[name]) == record["messages"][1]["content"]

    evaluate = _load("evaluate", monkeypatch)
    from transformers import AutoConfig

    from mm_models_qwen.qwen3_vl import Qwen3VLForTraining

    torch.manual_seed(0)
    model = Qwen3VLForTraining._from_config(AutoConfig.from_pretrained(out / "model"), dtype=torch.float32)
    accuracy, n = evaluate.accuracy(model, out, limit=3)
    assert n == 3 and 0.0 <= accuracy <= 1.0
