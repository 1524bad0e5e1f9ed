"""``training.compile``: mm's training step with each FSDP unit compiled vs eager, side by side.

Two trainers on the same config (the quickstart Qwen3 unless overridden), the same initial weights and the
same micro-batches, in the same processes: one with ``training.compile=false``, one with ``true``. They
alternate in rounds so that machine noise hits both alike, and see the same steps in the same order, so
their losses stay comparable (printed as a parity check). Prints the first compiled step's time (the
compilation), tokens/s of each and the ratio (compiled / eager; above 1 = compile pays off).

    python tools/bench/compile.py --nproc 2 --rounds 5 --steps 4 [key=value overrides for the config]

e.g. ``model.recompute=true`` to compare with recompute on in both.
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


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.chdir(REPO)
    from mm_core.config import load_config
    from mm_core.train import Trainer

    common = ["training.progress_bar=false", "training.save=null", *args.overrides]
    trainers = {
        mode: Trainer(
            load_config(args.config, [*common, f"training.compile={mode == 'compiled'}"]), args.config
        ).setup()
        for mode in ("eager", "compiled")
    }
    micro = [trainers["eager"]._next_micro_batches() for _ in range(args.steps)]
    losses: dict[str, list[float]] = {mode: [] for mode in trainers}

    def timed(mode: str) -> float:
        trainer = trainers[mode]
        dist.barrier()
        t0 = time.perf_counter()
        for batches in micro:
            losses[mode].append(trainer.train_step([dict(b) for b in batches]).metrics["loss"])
        dist.barrier()
        return time.perf_counter() - t0

    tokens_per_step = sum(b["input_ids"].numel() for b in micro[0]) * world
    timed("eager")  # warm-up both; the compiled one compiles in its first step
    dist.barrier()
    t0 = time.perf_counter()
    losses["compiled"].append(trainers["compiled"].train_step([dict(b) for b in micro[0]]).metrics["loss"])
    first = time.perf_counter() - t0
    for batches in micro[1:]:
        losses["compiled"].append(trainers["compiled"].train_step([dict(b) for b in batches]).metrics["loss"])
    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    for _ in range(args.rounds):
        for mode in trainers:
            times[mode].append(timed(mode))
    if rank == 0:
        for mode in trainers:
            out[mode] = [args.steps * tokens_per_step / t for t in times[mode]]
        out["first_step_s"] = first
        out["max_rel_loss_diff"] = max(
            abs(c - e) / abs(e) for c, e in zip(losses["compiled"], losses["eager"], strict=True)
        )
        out["steps"] = len(losses["eager"])
        out["layout"] = trainers["eager"].state.sizes.layout
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
    eager, compiled = statistics.median(out["eager"]), statistics.median(out["compiled"])
    print(f"layout: {out['layout']}, {args.rounds} alternating rounds of {args.steps} steps, median tokens/s")
    print(f"first compiled step (compilation included): {out['first_step_s']:.1f} s")
    print("| step | tokens/s (median) | per round |")
    print("|---|---:|---|")
    print(f"| eager | {eager:,.0f} | {', '.join(f'{x:,.0f}' for x in out['eager'])} |")
    print(f"| compiled | {compiled:,.0f} | {', '.join(f'{x:,.0f}' for x in out['compiled'])} |")
    print(f"ratio compiled / eager: {compiled / eager:.3f}")
    print(f"loss parity over {out['steps']} steps: max relative difference {out['max_rel_loss_diff']:.2e}")


if __name__ == "__main__":
    sys.exit(main())
