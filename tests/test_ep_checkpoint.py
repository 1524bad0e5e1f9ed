"""A DCP checkpoint saved by an expert-parallel run loads into another expert-parallel size: trained 2 steps
with EP=2 on 4 ranks, then loaded (model and optimizer) with EP=2, EP=4 and into 1 process without EP; all
three give the same logits on a fixed batch. Also run as a script: the worker that loads and writes logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _mm import REPO, mm
from test_ep_parity import moe_config

COMMON = [
    "training.log_interval=1",
    "training.seed=11",
    "training.lr=3e-3",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=1",
    "training.gradient_accumulation_steps=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
]


def _worker(cfg_path: str, out: str, overrides: list[str]) -> None:
    """Build the run of ``cfg_path`` (loading the checkpoint named in the overrides) and save the logits of a
    fixed batch on rank 0."""
    from mm_core.config import load_config
    from mm_core.train.trainer import Trainer

    trainer = Trainer(load_config(cfg_path, overrides)).setup()
    trainer.model.eval()
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, use_cache=False).logits
    if trainer.state.is_main:
        torch.save(logits, out)
    trainer.close()


def _logits(cfg: Path, tmp: Path, name: str, nproc: int, overrides: list[str]) -> torch.Tensor:
    out = tmp / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "tests"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [__file__, str(cfg), str(out), *COMMON, *overrides, f"training.output_dir={tmp / name}"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return torch.load(out, weights_only=True)


def test_checkpoint_reshards_across_expert_parallel_sizes(tmp_path):
    cfg = moe_config(tmp_path)
    ckpt = tmp_path / "ckpt"
    mm(
        "train", str(cfg), *COMMON, "training.train_iters=2", "training.save_interval=2",
        f"training.save={ckpt}", f"training.output_dir={tmp_path / 'train'}",
        "parallel.expert_parallel_size=2", "--nproc-per-node", "4",
    )  # fmt: skip
    load = [f"training.load={ckpt / 'step_2'}", "training.save=null", "training.train_iters=3"]
    ep2 = _logits(cfg, tmp_path, "ep2", 4, [*load, "parallel.expert_parallel_size=2"])
    ep4 = _logits(cfg, tmp_path, "ep4", 4, [*load, "parallel.expert_parallel_size=4"])
    one = _logits(cfg, tmp_path, "one", 1, load)
    fresh = _logits(cfg, tmp_path, "fresh", 1, ["training.save=null", "training.train_iters=3"])
    assert ep2.shape == (2, 32, 4096)
    torch.testing.assert_close(ep4, ep2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one, ep2, rtol=1e-5, atol=1e-6)
    assert (fresh - ep2).abs().max() > 1e-3  # the trained weights were really loaded


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3:])
