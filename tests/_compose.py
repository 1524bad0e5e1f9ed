"""Run several short trainings, one after the other, in the same N gloo processes (one process-group start-up
for all of them), each from its own config file and overrides. The processes come from :mod:`_launch`'s
forkserver.

``run_sequence(n, [(name, config, overrides), ...], out)`` returns, per run, the metrics records of rank 0
plus ``head``: the chunked-loss head's class (``NoneType`` without one) and ``calls``: how many times the
module named by ``COUNTED`` ran its forward on rank 0 (a recomputed module runs it again in backward, so
this shows recompute really took place). Runs execute in order, so a later run may load a checkpoint an
earlier one saved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.multiprocessing as mp
from _launch import START_METHOD, enter_rank, free_port
from _mm import REPO

COUNTED = "model.layers.0.self_attn"
Run = tuple[str, str, list[str]]


def _worker(rank: int, world: int, port: int, runs: list[Run], out: str, env: dict[str, str]) -> None:
    enter_rank(rank, world, port, env)
    import torch
    import torch.distributed as dist

    from mm_core.config.loader import load_config
    from mm_core.train.trainer import Trainer

    torch.set_num_threads(1)
    os.chdir(REPO)  # the quickstart's paths are relative to the repository root
    results = {}
    try:
        for name, config, overrides in runs:
            cfg = load_config(config, [*overrides, f"training.output_dir={out}/{name}"])
            trainer = Trainer(cfg, config).setup()
            calls: list[None] = []
            counted = dict(trainer.model.named_modules())[COUNTED]
            handle = counted.register_forward_pre_hook(lambda *_, seen=calls: seen.append(None))
            records = trainer.train()
            handle.remove()
            # ChunkedLossHead (FSDP2's subclass of it when the head is a unit of its own), or NoneType: the
            # loss took full logits
            from mm_parallel.memory.chunked_loss import ChunkedLossHead

            chunked = getattr(trainer.task, "chunked_head", None)
            head = "ChunkedLossHead" if isinstance(chunked, ChunkedLossHead) else type(chunked).__name__
            results[name] = {"records": records, "calls": len(calls), "head": head}
        if rank == 0:
            Path(out, "results.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_sequence(world: int, runs: list[Run], out: str | Path) -> dict[str, dict]:
    args = (world, free_port(), runs, str(out), dict(os.environ))
    mp.start_processes(_worker, args=args, nprocs=world, start_method=START_METHOD, join=True)
    return json.loads(Path(out, "results.json").read_text(encoding="utf-8"))
