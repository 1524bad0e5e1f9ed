"""Start N local worker processes (``mm train --nproc-per-node N``) through torch's elastic launcher."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mm_core.train.entry import ERROR_DIR_ENV, INTERRUPTED_FILE, run_worker
from mm_core.train.signals import EXIT_INTERRUPTED

#: seconds a signalled worker has to finish its step and save before the launcher kills it
#: (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` overrides)
SHUTDOWN_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
        # a signalled run finishes its step and saves before it exits: give it time before SIGKILL
        shutdown_timeout=int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)),
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
            codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
            return _report_failure(Path(error_dir), nproc, codes)
        except SignalException as exc:
            # this process was signalled: the agent passed the signal on to the workers and waited up to
            # shutdown_timeout for them to finish their step and save
            if (Path(error_dir) / INTERRUPTED_FILE).is_file():
                return EXIT_INTERRUPTED
            print(f"mm: stopped by {signal.Signals(exc.sigval).name} before a checkpoint", file=sys.stderr)
            return 128 + int(exc.sigval)
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
    return 0


def _report_failure(error_dir: Path, nproc: int, codes: dict[int, int]) -> int:
    """Print what the failed workers left (each distinct user error once; the first crash with its traceback
    tail) and return the launcher's exit status."""
    messages = _collect_errors(error_dir)
    for msg, ranks in messages.items():
        where = "" if len(ranks) == nproc or ranks == [0] else f" (rank {', '.join(map(str, ranks))})"
        print(f"mm: error{where}: {msg}", file=sys.stderr, flush=True)
    stopped = {-int(signal.SIGTERM), -int(signal.SIGINT)}  # ranks the agent stopped after another failed
    if EXIT_INTERRUPTED in codes.values() and set(codes.values()) <= {EXIT_INTERRUPTED} | stopped:
        return EXIT_INTERRUPTED
    if messages and set(codes.values()) <= {2} | stopped:
        return 2
    crash = _first_crash(error_dir)
    if crash is not None:
        rank, report = crash
        print(report["traceback"], file=sys.stderr)
        print(f"mm: worker rank {rank} failed: {report['summary']}", file=sys.stderr, flush=True)
        others = sorted(r for r in codes if r != rank)
        if others:
            who = f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
            print(f"mm: {who} stopped too (see above)", file=sys.stderr, flush=True)
        return 1
    for rank, code in sorted(codes.items()):
        print(f"mm: worker {rank} failed with exit code {code}", file=sys.stderr)
    return 1


def _first_crash(error_dir: Path) -> tuple[int, dict[str, Any]] | None:
    """The earliest crash report a worker left (later ones are usually its consequences on other ranks)."""
    reports = []
    for f in error_dir.glob("crash_*.json"):
        try:
            reports.append((int(f.stem.split("_")[1]), json.loads(f.read_text(encoding="utf-8"))))
        except (ValueError, OSError):
            continue
    return min(reports, key=lambda r: r[1]["time"]) if reports else None


def _collect_errors(error_dir: Path) -> dict[str, list[int]]:
    """Distinct worker error messages, each with the ranks that reported it."""
    found: dict[str, list[int]] = {}
    for f in sorted(error_dir.glob("rank_*.txt"), key=lambda p: int(p.stem.split("_")[1])):
        found.setdefault(f.read_text(encoding="utf-8"), []).append(int(f.stem.split("_")[1]))
    return found
