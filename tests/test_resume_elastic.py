"""Elastic resume: a run saved on 2 ranks resumes on 1 and on 4 ranks.

The global batch is kept (2 ranks x 2 samples = 1 x 4 = 4 x 1), so the resumed steps read the very same
samples of the seeded global order as the 2-rank run, and — model and optimizer resharded by DCP, the LR
schedule and data position restored — give the same losses up to the order of floating-point reductions.
A data position that repeated or skipped samples, or optimizer state that did not reshard, would not.

Each run is one launch of its processes (see :mod:`_launch`); a resumed run's log records (what ``mm train``
prints) go to a file per rank (:func:`log_to`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO, assert_close_series, read_metrics

COMMON = [
    "training.log_interval=1",
    "training.seed=11",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.gradient_accumulation_steps=2",
    "training.lr_warmup_ratio=0.2",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.train_iters=6",
]

_LOG: list[logging.Handler] = []


def log_to(folder: str) -> None:
    """Call item: this rank's log records (as `mm train` prints them) also go to ``folder/rank<RANK>.log``."""
    handler = logging.FileHandler(Path(folder, f"rank{os.environ['RANK']}.log"), encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))  # mm train's worker format
    logging.getLogger().addHandler(handler)
    _LOG.append(handler)


def log_off() -> None:
    """Call item: stop what :func:`log_to` started."""
    while _LOG:
        handler = _LOG.pop()
        logging.getLogger().removeHandler(handler)
        handler.close()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("two")
    run = [*COMMON, "training.micro_batch_size=2", "training.save_interval=3", f"training.save={d / 'ckpt'}",
           f"training.output_dir={d}"]  # fmt: skip
    run_in_one_launch(2, [("two", str(QUICKSTART), run)], REPO, timeout=600)
    return d


@pytest.mark.parametrize("nproc,mbs", [(1, 4), (4, 1)])
def test_resume_on_other_world_size(two_ranks, tmp_path, nproc, mbs):
    logs, out = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    run = [*COMMON, f"training.micro_batch_size={mbs}", f"training.load={two_ranks / 'ckpt' / 'step_3'}",
           "training.save=null", f"training.output_dir={out}"]  # fmt: skip
    items = [
        Call("log_to", "test_resume_elastic:log_to", (str(logs),)),
        ("resume", str(QUICKSTART), run),
        Call("log_off", "test_resume_elastic:log_off"),
    ]
    run_in_one_launch(nproc, items, REPO, timeout=300)
    output = "".join((logs / f"rank{r}.log").read_text(encoding="utf-8") for r in range(nproc))
    assert f"resharded from 2 to {nproc} ranks" in output
    ref = {r["step"]: r for r in read_metrics(two_ranks)}
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["tokens"] for r in resumed] == [ref[s]["tokens"] for s in (4, 5, 6)]
    assert [r["lr"] for r in resumed] == [ref[s]["lr"] for s in (4, 5, 6)]
    assert_close_series([r["loss"] for r in resumed], [ref[s]["loss"] for s in (4, 5, 6)], 1e-5, "loss")
    assert_close_series(
        [r["grad_norm"] for r in resumed], [ref[s]["grad_norm"] for s in (4, 5, 6)], 1e-4, "grad_norm"
    )
