"""``training.save_async`` on 2 ranks: saves overlap training, ``latest`` names only completed checkpoints,
the process waits for the last one, ``save_total_limit`` prunes, and a resume from an asynchronously written
checkpoint continues bit-identically."""

from __future__ import annotations

from _mm import QUICKSTART, mm, read_metrics

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


def test_async_saves_complete_prune_and_resume_exactly(tmp_path):
    save = tmp_path / "ckpt"
    proc = mm("train", str(QUICKSTART), *COMMON, "training.save_async=true", "training.save_interval=2",
              "training.save_total_limit=2", f"training.save={save}", f"training.output_dir={tmp_path / 'a'}",
              "--nproc-per-node", "2")  # fmt: skip
    out = proc.stdout + proc.stderr
    for step in (2, 4, 6):
        assert f"saved checkpoint {save}/step_{step} (asynchronously)" in out
    assert read_latest(save).name == "step_6"  # the exit waited for the last save
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step_4", "step_6"]
    mm("train", str(QUICKSTART), *COMMON, f"training.load={save / 'step_4'}", "training.save=null",
       f"training.output_dir={tmp_path / 'b'}", "--nproc-per-node", "2")  # fmt: skip
    ref = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "a")}
    resumed = read_metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [ref[5], ref[6]]
