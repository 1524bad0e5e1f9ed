"""Run several short trainings of the quickstart model in the same N gloo processes (one process-group
start-up for all of them): ``run_variants(n, {name: [overrides]})`` returns, per variant, the per-step losses
seen by rank 0. Built on :func:`_compose.run_sequence`."""

from __future__ import annotations

import tempfile

from _compose import run_sequence
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


def run_variants(
    world: int, variants: dict[str, list[str]], out: str | None = None
) -> dict[str, list[float]]:
    out = out or tempfile.mkdtemp(prefix="mm-memory-")
    runs = [(name, str(QUICKSTART), [*BASE, *overrides]) for name, overrides in variants.items()]
    return {name: [r["loss"] for r in res["records"]] for name, res in run_sequence(world, runs, out).items()}
