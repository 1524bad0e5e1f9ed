"""What the benchmarks' local process groups share: a free port, the rank environment, spawning the ranks."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """The environment torchrun would give rank ``rank`` of ``world`` on this host (plus ``extra``)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def spawn_ranks(worker: Callable[..., None], nproc: int, *args: Any) -> dict[str, Any]:
    """Run ``worker(rank, nproc, port, *args, out)`` in ``nproc`` spawned processes; returns what they put in
    ``out`` (a shared dict)."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(worker, args=(nproc, free_port(), *args, out), nprocs=nproc, join=True)
    return dict(out)
