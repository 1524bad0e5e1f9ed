"""Run a test function on N real gloo ranks (processes from the test session's forkserver, see
``tests/_launch.py``; file rendezvous)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import START_METHOD, join_within


def _worker(
    rank: int,
    fn: Callable[..., None],
    world_size: int,
    init_file: str,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the launching test's environment (a forkserver child starts with the server's)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout: float = 90.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; fail on error or timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, init_file, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        join_within(context, timeout, f"{fn.__name__} on {world_size} ranks")


def reference_muon(
    params: list[torch.Tensor],
    grad_steps: list[list[torch.Tensor]],
    *,
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
    dtype: torch.dtype = torch.float32,
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
) -> list[torch.Tensor]:
    """Single-process Muon, one matrix at a time (3-D weights: one loop iteration per expert).

    fp32: torch.optim.Muon's algorithm with the iteration in fp32. bf16: torch's own per-matrix
    Newton–Schulz function, so the result is what torch.optim.Muon does to each matrix.
    """
    from torch.optim._muon import _zeropower_via_newtonschulz

    params = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    a, b, c = coefficients
    for grads in grad_steps:
        for p, g, buf in zip(params, grads, bufs):
            buf.lerp_(g, 1 - momentum)
            update = g.lerp(buf, momentum) if nesterov else buf
            outs = []
            for matrix in update.reshape(-1, *update.shape[-2:]):
                if dtype == torch.bfloat16:
                    outs.append(_zeropower_via_newtonschulz(matrix, (a, b, c), ns_steps, eps))
                    continue
                x = matrix.to(dtype)
                tall = x.size(0) > x.size(1)
                x = x.T if tall else x
                x = x / x.norm().clamp(min=eps)
                for _ in range(ns_steps):
                    gram = x @ x.T
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                outs.append(x.T if tall else x)
            ortho = torch.stack(outs).reshape(update.shape)
            rows, cols = p.shape[-2:]
            if adjust_lr_fn == "match_rms_adamw":
                adjusted = lr * 0.2 * max(rows, cols) ** 0.5
            else:
                adjusted = lr * max(1.0, rows / cols) ** 0.5
            p.mul_(1 - lr * weight_decay)
            p.add_(ortho, alpha=-adjusted)
    return params


def full_grads(shapes: list[tuple[int, ...]], steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """The same pseudo-random full gradients on every rank: ``[step][param]``."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()
