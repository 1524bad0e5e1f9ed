"""``training.save_async`` on 2 ranks: saves overlap training, ``latest`` names only completed checkpoints,
the process waits for the last one, ``save_total_limit`` prunes, and a resume from an asynchronously written
checkpoint continues bit-identically.

Both runs are ``mm train`` workers' runs in one launch of 2 processes (:mod:`_launch`); calls between them
keep the first run's log lines and the state of its checkpoint folder once it has returned."""

from __future__ import annotations

import json
import os
from pathlib import Path

from _launch import Call, captured, read_captured, run_in_one_launch
from _mm import QUICKSTART, REPO, read_metrics

from mm_core.checkpoint import read_latest

COMMON = [
    "training.log_interval=1",
    "training.seed=9",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "training.lr_warmup_ratio=0.25",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.train_iters=6",
]


def record_checkpoints(save: str, record: str) -> None:
    """On rank 0: write ``read_latest(save)`` and the listing of ``save`` to ``record`` (the folder as the
    finished run left it, before the next run reads it)."""
    if os.environ["RANK"] == "0":
        listing = sorted(p.name for p in Path(save).iterdir())
        state = {"latest": read_latest(Path(save)).name, "listing": listing}
        Path(record).write_text(json.dumps(state), encoding="utf-8")


def test_async_saves_complete_prune_and_resume_exactly(tmp_path):
    save = tmp_path / "ckpt"
    log, record = tmp_path / "a.log", tmp_path / "a_checkpoints.json"
    first = [*COMMON, "training.save_async=true", "training.save_interval=2", "training.save_total_limit=2",
             f"training.save={save}", f"training.output_dir={tmp_path / 'a'}"]  # fmt: skip
    resume = [*COMMON, f"training.load={save / 'step_4'}", "training.save=null",
              f"training.output_dir={tmp_path / 'b'}"]  # fmt: skip
    run_in_one_launch(
        2,
        [
            *captured(log, [("a", str(QUICKSTART), first)]),
            Call("record", f"{__name__}:record_checkpoints", (str(save), str(record))),
            ("b", str(QUICKSTART), resume),
        ],
        REPO,
        timeout=600,
    )
    out = read_captured(log)
    for step in (2, 4, 6):
        assert f"saved checkpoint {save}/step_{step} (asynchronously)" in out
    state = json.loads(record.read_text(encoding="utf-8"))
    assert state["latest"] == "step_6"  # the end of the run waited for the last save
    assert state["listing"] == ["latest", "step_4", "step_6"]
    ref = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "a")}
    resumed = read_metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [ref[5], ref[6]]
