"""Checkpoint speed: save and load seconds and MB/s, and the training stall of sync vs async saves.

For each model (the quickstart Qwen3, and a ~100M-parameter Qwen3 built from the same config with
``model.config_overrides``), on ``--nproc`` ranks with FSDP over all of them:

- save: a full checkpoint (model, AdamW state, scheduler, data position, RNG) with ``save_checkpoint``
- load: ``load_checkpoint`` of it into the live trainer
- stall: the training time lost to one save. Synchronous: the save call. Asynchronous: the time the save call
  blocks (copying the state to CPU memory) plus the extra time of the training steps that run while the
  background thread writes, measured against the same steps without a save in flight.

    python tools/bench/checkpoint.py --nproc 2 [--models quickstart,100m] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _ranks import set_rank_env, spawn_ranks

REPO = Path(__file__).resolve().parents[2]
MODELS = {
    "quickstart": [],
    "100m": [
        "model.config_overrides.hidden_size=768",
        "model.config_overrides.intermediate_size=2048",
        "model.config_overrides.num_hidden_layers=16",
        "model.config_overrides.num_attention_heads=12",
        "model.config_overrides.num_key_value_heads=4",
        "model.config_overrides.head_dim=64",
    ],
}


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.chdir(REPO)
    from mm_core.checkpoint import CheckpointSaver, load_checkpoint, save_checkpoint
    from mm_core.config import load_config
    from mm_core.train import Trainer

    root = Path(args.dir)
    base = [
        "training.progress_bar=false",
        "training.save=null",
        "training.micro_batch_size=1",
        "training.gradient_accumulation_steps=1",
        "data.dataset_param.basic_parameters.seq_len=64",
    ]
    for name in args.models.split(","):
        cfg = load_config(str(REPO / "examples/quickstart/config.yaml"), [*base, *MODELS[name]])
        trainer = Trainer(cfg).setup()
        n_params = sum(p.numel() for p in trainer.model.parameters())  # DTensor.numel() is the global size
        micro = [trainer._next_micro_batches() for _ in range(args.steps)]

        def steps(trainer=trainer, micro=micro) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for m in micro:
                trainer.train_step([dict(b) for b in m])
            dist.barrier()
            return time.perf_counter() - t0

        steps()  # warm-up, creates the optimizer state
        dist.barrier()
        t0 = time.perf_counter()
        path = save_checkpoint(root / name / "sync", 1, trainer.train_state)
        save_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        load_checkpoint(path, trainer.train_state)
        dist.barrier()
        load_s = time.perf_counter() - t0
        size = _dir_mb(path)

        base_s = statistics.median(steps() for _ in range(2))
        saver = CheckpointSaver(root / name / "async", async_save=True)
        dist.barrier()
        t0 = time.perf_counter()
        saver.save(1, trainer.train_state)
        block_s = time.perf_counter() - t0
        overlap_s = steps()  # training while the background thread writes
        t0 = time.perf_counter()
        saver.wait()
        dist.barrier()
        wait_s = time.perf_counter() - t0
        saver.close()
        if rank == 0:
            out[name] = {
                "params_m": n_params / 1e6,
                "mb": size,
                "save_s": save_s,
                "load_s": load_s,
                "async_block_s": block_s,
                "async_slowdown_s": max(0.0, overlap_s - base_s),
                "async_wait_s": wait_s,
                "step_s": base_s / len(micro),
            }
            shutil.rmtree(root / name, ignore_errors=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--models", default="quickstart,100m")
    parser.add_argument("--steps", type=int, default=4, help="training steps overlapped with the async save")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="mm-ckpt-bench-")
        args.dir = tmp
    try:
        out = spawn_ranks(_worker, args.nproc, args)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.nproc} ranks, FSDP, fp32 model + AdamW state; MB/s = checkpoint size / seconds")
    print("| model | params | checkpoint | save s | save MB/s | load s | load MB/s | sync stall s "
          "| async stall s (block + slowdown) | async write done after s | train step s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        r = out[name]
        save_mbs = r["mb"] / r["save_s"]
        print(
            f"| {name} | {r['params_m']:.1f}M | {r['mb']:.0f} MB | {r['save_s']:.2f} | {save_mbs:.0f} "
            f"| {r['load_s']:.2f} | {r['mb'] / r['load_s']:.0f} | {r['save_s']:.2f} "
            f"| {r['async_block_s'] + r['async_slowdown_s']:.2f} ({r['async_block_s']:.2f} + "
            f"{r['async_slowdown_s']:.2f}) | {r['async_wait_s']:.2f} | {r['step_s']:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
