"""A tiny Wan2.2 on 2 FSDP ranks resumes exactly (its export is checked in ``test_video_parity``).

6 samples, 2 per step: 3 steps per epoch. "6 steps straight" and "2 steps, stop, resume for 4" give identical
losses and gradient norms, across the epoch boundary (each sample's noise seed depends on the epoch, which mm
hands the dataset again on resume). Both runs, one after the other, are one launch of 2 processes (see
:mod:`_launch`)."""

from __future__ import annotations

import pytest
from _launch import run_in_one_launch
from _mm import REPO, read_metrics
from _video import make_video_assets

COMMON = ["training.micro_batch_size=1", "training.train_iters=6", "training.seed=11"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight run's output folder and the resumed run's."""
    root = tmp_path_factory.mktemp("video_resume")
    cfg = make_video_assets(root, n=6)
    out, resumed = root / "straight", root / "resumed"
    straight = [*COMMON, "training.save_interval=2", f"training.save={out / 'ckpt'}",
                f"training.output_dir={out}"]  # fmt: skip
    resume = [*COMMON, f"training.load={out / 'ckpt' / 'step_2'}", "training.save=null",
              f"training.output_dir={resumed}"]  # fmt: skip
    run_in_one_launch(2, [("straight", str(cfg), straight), ("resumed", str(cfg), resume)], REPO, timeout=360)
    return out, resumed


@pytest.mark.slow
def test_resume_is_exact_across_an_epoch(runs):
    out, resumed_dir = runs
    ref = {r["step"]: r for r in read_metrics(out)}
    resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    for r in resumed:
        assert (r["loss"], r["grad_norm"]) == (ref[r["step"]]["loss"], ref[r["step"]]["grad_norm"]), r["step"]
    # epoch 1 (steps 4-6) reads the samples of epoch 0 again, with other noise: other losses
    assert {ref[s]["loss"] for s in (1, 2, 3)}.isdisjoint({ref[s]["loss"] for s in (4, 5, 6)})
