"""Framework overhead: mm's training step vs a minimal hand-written FSDP2 loop, side by side.

Both run on the same model (the quickstart Qwen3 unless overridden), the same micro-batches and the same
mesh, in the same processes, alternating in rounds so that machine noise hits both alike. Prints tokens/s
of each and the ratio (mm / minimal; 1.00 = no overhead).

    python tools/bench/overhead.py --nproc 2 --rounds 5 --steps 4 [key=value overrides for the config]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _ranks import set_rank_env, spawn_ranks

REPO = Path(__file__).resolve().parents[2]


def _minimal_step(model, optimizer, micro_batches, clip):
    """What a user would write by hand: HF loss per micro-batch, backward, clip, step."""
    for batch in micro_batches:
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            use_cache=False,
        )
        (out.loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.chdir(REPO)
    from torch.distributed.fsdp import fully_shard

    from mm_core.config import load_config
    from mm_core.data import move_to_device
    from mm_core.models import ModelHub
    from mm_core.train import Trainer

    cfg = load_config(args.config, ["training.progress_bar=false", "training.save=null", *args.overrides])
    trainer = Trainer(cfg, args.config).setup()
    micro = [trainer._next_micro_batches() for _ in range(args.steps)]

    # the minimal loop: same model class and weights, same mesh, same FSDP units, plain AdamW
    torch.manual_seed(cfg.training.seed)
    model = ModelHub.build(cfg.model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=trainer.state.fsdp_mesh)
    fully_shard(model, mesh=trainer.state.fsdp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, foreach=True)
    plain = [
        [move_to_device({k: v for k, v in b.items()}, trainer.state.device) for b in step] for step in micro
    ]

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.steps):
            fn(i)
        dist.barrier()
        return time.perf_counter() - t0

    tokens_per_step = sum(b["input_ids"].numel() for b in micro[0]) * world
    timed(lambda i: trainer.train_step([dict(b) for b in micro[i]]))  # warm-up both
    timed(lambda i: _minimal_step(model, optimizer, plain[i], cfg.training.clip_grad))
    mm_t, min_t = [], []
    for _ in range(args.rounds):
        mm_t.append(timed(lambda i: trainer.train_step([dict(b) for b in micro[i]])))
        min_t.append(timed(lambda i: _minimal_step(model, optimizer, plain[i], cfg.training.clip_grad)))
    if rank == 0:
        out["mm"] = [args.steps * tokens_per_step / t for t in mm_t]
        out["minimal"] = [args.steps * tokens_per_step / t for t in min_t]
        out["layout"] = trainer.state.sizes.layout
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(REPO / "examples/quickstart/config.yaml"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per timed block")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = spawn_ranks(_worker, args.nproc, args)
    mm_tps, min_tps = statistics.median(out["mm"]), statistics.median(out["minimal"])
    print(f"layout: {out['layout']}, {args.rounds} alternating rounds of {args.steps} steps, median tokens/s")
    print("| loop | tokens/s (median) | per round |")
    print("|---|---:|---|")
    print(f"| mm train_step | {mm_tps:,.0f} | {', '.join(f'{x:,.0f}' for x in out['mm'])} |")
    print(f"| minimal FSDP2 loop | {min_tps:,.0f} | {', '.join(f'{x:,.0f}' for x in out['minimal'])} |")
    print(f"ratio mm / minimal: {mm_tps / min_tps:.3f}")


if __name__ == "__main__":
    sys.exit(main())
