"""Start N local worker processes (``mm train --nproc-per-node N``) through torch's elastic launcher."""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mm_core.train.entry import ERROR_DIR_ENV, run_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(argv: list[str]) -> None:
    code = run_worker(argv)
    if code:
        sys.exit(code)


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run ``mm_core.train`` with ``argv`` on ``nproc`` local processes; returns the exit status
    (2 when a worker stopped on a user error, which it has already printed)."""
    # like torchrun: do not let N workers each start one thread per core
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts > 0:
        # restarted workers must not read the previous attempt's keys from a store shared with the
        # rendezvous (stale gloo/NCCL addresses: pytorch/pytorch#135712); give each attempt its own store
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"mm-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    # workers leave user errors in a folder; the agent's own log would add a traceback to them
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # "Terminating process ... via SIGTERM" when the other ranks are stopped after one failed
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="mm-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
        try:
            elastic_launch(config, _worker_main)(argv)
        except ChildFailedError as exc:
            messages = _collect_errors(Path(error_dir))
            for msg, ranks in messages.items():
                where = "" if len(ranks) == nproc or ranks == [0] else f" (rank {', '.join(map(str, ranks))})"
                print(f"mm: error{where}: {msg}", file=sys.stderr, flush=True)
            codes = {f.exitcode for f in exc.failures.values()}
            if messages and codes <= {2, -15}:  # -15: ranks stopped by the agent after another failed
                return 2
            for rank, failure in sorted(exc.failures.items()):
                print(f"mm: worker {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
            return 1
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
    return 0


def _collect_errors(error_dir: Path) -> dict[str, list[int]]:
    """Distinct worker error messages, each with the ranks that reported it."""
    found: dict[str, list[int]] = {}
    for f in sorted(error_dir.glob("rank_*.txt"), key=lambda p: int(p.stem.split("_")[1])):
        found.setdefault(f.read_text(encoding="utf-8"), []).append(int(f.stem.split("_")[1]))
    return found
