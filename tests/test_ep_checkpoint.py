"""A DCP checkpoint saved by an expert-parallel run loads into another expert-parallel size: trained 2 steps
with EP=2 on 4 ranks, then loaded (model and optimizer) with EP=2, EP=4 and into 1 process without EP; all
three give the same logits on a fixed batch. The training and the EP=2 and EP=4 loads run in one launch of 4
processes, the 1-process load and a fresh (not loaded) model in one launch of 1 (see :mod:`_launch`); the
loads are :func:`write_logits` calls."""

from __future__ import annotations

from pathlib import Path

import torch
from _launch import Call, run_in_one_launch
from _mm import REPO
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


#: the logits written: EP=2 and EP=4 on 4 ranks, 1 process, and a fresh model on 1 process
NAMES = ("ep2", "ep4", "one", "fresh")


def write_logits(cfg_path: str, out: str, overrides: list[str]) -> None:
    """Call item: build the run of ``cfg_path`` (loading the checkpoint named in the overrides) and save the
    logits of a fixed batch on rank 0."""
    from mm_core.config import load_config
    from mm_core.train.trainer import Trainer

    trainer = Trainer(load_config(cfg_path, overrides)).setup()
    try:
        trainer.model.eval()
        ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, use_cache=False).logits
        if trainer.state.is_main:
            torch.save(logits, out)
    finally:
        # not trainer.close(): that destroys the launch's process group, which the later items use
        if trainer.saver is not None:
            trainer.saver.close()


def _logits_call(cfg: Path, tmp: Path, name: str, overrides: list[str]) -> Call:
    args = [*COMMON, *overrides, f"training.output_dir={tmp / name}"]
    return Call(name, "test_ep_checkpoint:write_logits", (str(cfg), str(tmp / f"{name}.pt"), args))


def test_checkpoint_reshards_across_expert_parallel_sizes(tmp_path):
    cfg = moe_config(tmp_path)
    ckpt = tmp_path / "ckpt"
    train = [*COMMON, "training.train_iters=2", "training.save_interval=2", f"training.save={ckpt}",
             f"training.output_dir={tmp_path / 'train'}", "parallel.expert_parallel_size=2"]  # fmt: skip
    load = [f"training.load={ckpt / 'step_2'}", "training.save=null", "training.train_iters=3"]
    four = [
        ("train", str(cfg), train),
        _logits_call(cfg, tmp_path, "ep2", [*load, "parallel.expert_parallel_size=2"]),
        _logits_call(cfg, tmp_path, "ep4", [*load, "parallel.expert_parallel_size=4"]),
    ]
    run_in_one_launch(4, four, REPO, timeout=600)
    single = [
        _logits_call(cfg, tmp_path, "one", load),
        _logits_call(cfg, tmp_path, "fresh", ["training.save=null", "training.train_iters=3"]),
    ]
    run_in_one_launch(1, single, REPO, timeout=300)
    ep2, ep4, one, fresh = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in NAMES)
    assert ep2.shape == (2, 32, 4096)
    torch.testing.assert_close(ep4, ep2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one, ep2, rtol=1e-5, atol=1e-6)
    assert (fresh - ep2).abs().max() > 1e-3  # the trained weights were really loaded
