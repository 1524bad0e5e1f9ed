"""Run several short trainings in the same N gloo processes (one process-group start-up for all of them):
``run_variants(n, {name: [overrides]})`` returns, per variant, the per-step losses seen by rank 0."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import torch.multiprocessing as mp
from _mm import QUICKSTART

BASE = [
    "training.train_iters=3",
    "training.log_interval=1",
    "training.save=null",
    "training.seed=7",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "data.dataset_param.basic_parameters.seq_len=64",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
]


def _worker(rank: int, world: int, port: int, variants: dict[str, list[str]], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    from mm_core.config.loader import load_config
    from mm_core.train.trainer import Trainer

    torch.set_num_threads(1)
    os.chdir(Path(QUICKSTART).parents[2])  # the quickstart's paths are relative to the repository root
    results = {}
    try:
        for name, overrides in variants.items():
            cfg = load_config(QUICKSTART, [*BASE, *overrides, f"training.output_dir={out}/{name}"])
            records = Trainer(cfg, str(QUICKSTART)).setup().train()
            results[name] = [r["loss"] for r in records]
        if rank == 0:
            Path(out, "losses.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variants(
    world: int, variants: dict[str, list[str]], out: str | None = None
) -> dict[str, list[float]]:
    out = out or tempfile.mkdtemp(prefix="mm-memory-")
    mp.start_processes(
        _worker, args=(world, _free_port(), variants, out), nprocs=world, start_method="spawn", join=True
    )
    return json.loads(Path(out, "losses.json").read_text(encoding="utf-8"))
