"""Fail loudly, lose nothing — the training loop, end to end on 2 gloo ranks.

What the ``mm train`` command itself shows (a crash printed once, a one-line error and its exit status) runs
through ``mm train``; runs that succeed are ``mm train`` workers' runs in one launch of 2 processes per test
(:mod:`_launch`), their log lines kept by calls around the run.

- every documented forward output kind (ModelOutput, SimpleNamespace, dataclass, dict) trains a model whose
  embedding and head sit at the root, with the same losses and gradient norms as a ModelOutput;
- a crash inside a plugin's forward is printed once by the launcher: type, message, the plugin's frames;
- ``per_token_loss`` with a model that needs labels, or that returns no logits, stops with one line;
- a non-finite loss stops the run (exit 2, the step named) and ``latest`` stays on the last good checkpoint;
  ``training.skip_nonfinite_steps`` skips such steps instead and counts them;
- a resumed run honours a changed lr, and a longer ``train_iters``, from its first step, with a notice.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _launch import Call, Item, captured, read_captured, run_in_one_launch
from _mm import REPO, quickstart_text_data, read_metrics

from mm_core.checkpoint import read_latest
from mm_core.config.schema import TrainingConfig
from mm_core.optim.scheduler import lr_factor


def write_config(tmp_path: Path, model: dict, **training) -> Path:
    cfg = {
        "parallel": {"fully_shard_parallel_size": "auto"},
        "data": quickstart_text_data(32),
        "model": {"from_scratch": True, **model},
        "training": {
            "micro_batch_size": 2,
            "train_iters": 3,
            "lr": 1.0e-3,
            "log_interval": 1,
            "progress_bar": False,
            "plugin": ["_plugin_models"],
            "output_dir": str(tmp_path / "out"),
            **training,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def mm_train(
    config: Path, *overrides: str, nproc: int = 2, timeout: float = 300
) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mm_core.cli",
            "train",
            str(config),
            *overrides,
            "--nproc-per-node",
            str(nproc),
        ],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch(tmp_path: Path, items: list[Item], timeout: float = 300) -> None:
    """``items`` on 2 processes started once, in ``tmp_path`` (as ``mm train`` in a config's folder);
    ``timeout`` per run."""
    runs = [item for item in items if not isinstance(item, Call)]
    run_in_one_launch(2, items, tmp_path, timeout * len(runs))


def model(output: str = "model_output", **options) -> dict:
    return {"model_id": "test_root_lm", "config_overrides": {"output": output, **options}}


@pytest.mark.slow
def test_every_output_kind_trains_like_a_model_output(tmp_path: Path) -> None:
    kinds = ("model_output", "namespace", "dataclass", "dict")
    for kind in kinds:
        (tmp_path / kind).mkdir()
    launch(tmp_path, [(kind, str(write_config(tmp_path / kind, model(kind))), []) for kind in kinds])
    series = {}
    for kind in kinds:
        series[kind] = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / kind / "out")]
    assert len(series["model_output"]) == 3
    for kind, values in series.items():
        assert values == series["model_output"], kind


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_crash_in_a_plugin_is_printed_once_with_its_traceback(tmp_path: Path, nproc: int) -> None:
    proc = mm_train(write_config(tmp_path, model(crash=True)), nproc=nproc)
    assert proc.returncode == 1
    err = proc.stderr
    assert "mm: worker rank" in err and "failed: ValueError: plugin exploded in forward" in err, err[-3000:]
    assert "_plugin_models.py" in err and 'raise ValueError("plugin exploded in forward")' in err, err[-3000:]
    # one report (the traceback's last line and the summary line), not one per rank
    assert err.count("ValueError: plugin exploded in forward") == 2, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_block", "needle"),
    [
        ({"model_id": "test_labels_lm"}, "failed without them (TypeError"),
        (model("loss_only"), "returned none"),
    ],
    ids=["needs-labels", "no-logits"],
)
def test_per_token_loss_with_a_model_that_computes_its_own_loss(tmp_path: Path, model_block, needle) -> None:
    proc = mm_train(write_config(tmp_path, model_block))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mm: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "model.loss_cfg.loss_type" in lines[0] and "raw" in lines[0] and needle in lines[0], lines[0]
    if model_block["model_id"] == "test_labels_lm":  # and loss_type: raw trains it on its own loss
        raw = ("raw", str(write_config(tmp_path, model_block)), ["model.loss_cfg.loss_type=raw"])
        launch(tmp_path, [raw])
        assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path / "out"))


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = write_config(tmp_path, model(nan_after=2), train_iters=4, save=str(ckpt), save_interval=1)
    proc = mm_train(cfg)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("mm: error")]
    assert len(line) == 1 and "training stopped at step 3: the loss is nan" in line[0], proc.stderr[-3000:]
    assert "step_2" in line[0]  # names the last good checkpoint
    assert read_latest(ckpt).name == "step_2"
    assert not (ckpt / "step_3").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]


@pytest.mark.slow
def test_skip_nonfinite_steps_skips_and_counts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, model(nan_after=2), train_iters=4, skip_nonfinite_steps=2)
    launch(tmp_path, captured(tmp_path / "skip.log", [("skip", str(cfg), [])]))
    records = read_metrics(tmp_path / "out")
    assert [r["skipped_nonfinite_steps"] for r in records] == [0, 0, 1, 2]
    log = read_captured(tmp_path / "skip.log")
    assert "skipped the update (1 of training.skip_nonfinite_steps: 2)" in log, log[-3000:]
    # a third one is over the limit
    proc = mm_train(cfg, "training.train_iters=5", "training.overwrite_output_dir=true")
    assert proc.returncode == 2 and "already skipped 2" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_resume_applies_a_changed_schedule_from_the_first_resumed_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    schedule = {"lr_decay_style": "cosine", "lr_min": 1.0e-4, "lr_warmup_ratio": 0.25}
    cfg = write_config(tmp_path, model(), train_iters=4, save=str(ckpt), save_interval=2, **schedule)
    # then resume from step 2 with a lower lr and a longer run: step 3 already uses both
    resumed_dir = tmp_path / "resumed"
    resume = [
        f"training.load={ckpt / 'step_2'}",
        "training.save=null",
        "training.lr=5.0e-4",
        "training.train_iters=8",
        f"training.output_dir={resumed_dir}",
    ]
    resumed = captured(tmp_path / "resumed.log", [("resumed", str(cfg), resume)])
    launch(tmp_path, [("first", str(cfg), []), *resumed])
    first = {r["step"]: r for r in read_metrics(tmp_path / "out")}
    log = read_captured(tmp_path / "resumed.log")
    assert "resume: training.lr was 0.001 in the checkpoint, now 0.0005" in log, log[-3000:]
    assert "resume: training.train_iters was 4 in the checkpoint, now 8" in log
    records = {r["step"]: r for r in read_metrics(resumed_dir)}
    new = TrainingConfig(train_iters=8, lr=5.0e-4, **schedule)
    for step in (3, 4, 5):
        assert records[step]["lr"] == pytest.approx(5.0e-4 * lr_factor(step - 1, new), rel=1e-12), step
    assert records[3]["lr"] != first[3]["lr"]
