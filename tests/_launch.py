"""Run several ``mm train`` runs in ONE launch of N local gloo processes.

The processes, and their import of torch, transformers and mm, start once for all the runs that share a
process count; they join one process group and run the runs one after the other, each as an ``mm train``
worker runs it (:func:`mm_core.train.entry.run_worker`): the config loaded with the run's overrides, a
``Trainer`` set up from it (its own device meshes and groups, its seed) and trained, its checkpoint saver
closed. The process group is destroyed once, after the last run: a group destroyed and made again in the same
processes can pair one rank's collective with another's (seen with HSDP after an expert-parallel run).

Between runs a launch may call a function of a test module on every rank (:class:`Call`: after a barrier,
e.g. to snapshot a run's outputs before the next run rewrites them, or to build a trained run's model again
and write what the test compares).

The processes are forked from a forkserver that imported torch, transformers and mm's trainer once for the
whole test session (``MM_TEST_START_METHOD=spawn`` starts them as fresh interpreters instead); each worker
takes the environment of the test that launched it, not the one the forkserver started with."""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

START_METHOD = os.environ.get("MM_TEST_START_METHOD", "forkserver")
#: what the forkserver imports once (its children start with these modules loaded)
PRELOAD = ["torch", "torch.distributed", "transformers", "mm_core.train.trainer", "_launch"]
mp.set_forkserver_preload(PRELOAD)

#: (name, config path, overrides)
Run = tuple[str, str, list[str]]


@dataclass(frozen=True)
class Call:
    """``target`` (``"module:function"``, a module importable from the tests folder) called with ``args`` on
    every rank of a launch, after the runs before it and a barrier; it finishes on every rank before the next
    item starts."""

    name: str
    target: str
    args: tuple[Any, ...] = ()

    def __call__(self) -> None:
        module, _, function = self.target.partition(":")
        getattr(importlib.import_module(module), function)(*self.args)


Item = Run | Call

_CAPTURE = "mm-test-log-capture"


def capture_log(prefix: str) -> None:
    """On every rank (as a :class:`Call`): from now on what is logged also goes to ``{prefix}.rank{RANK}``,
    formatted as an ``mm train`` worker prints it on stderr (the message only)."""
    handler = logging.FileHandler(f"{prefix}.rank{os.environ['RANK']}", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.set_name(_CAPTURE)
    logging.getLogger().addHandler(handler)


def stop_capture() -> None:
    """On every rank (as a :class:`Call`): end what :func:`capture_log` started."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _CAPTURE]:
        root.removeHandler(handler)
        handler.close()


def captured(prefix: Path, items: list[Item]) -> list[Item]:
    """``items`` with what every rank logs meanwhile kept in ``{prefix}.rank*`` (:func:`read_captured`)."""
    start = Call(f"capture {prefix.name}", "_launch:capture_log", (str(prefix),))
    return [start, *items, Call(f"end capture {prefix.name}", "_launch:stop_capture")]


def read_captured(prefix: Path) -> str:
    """What :func:`captured` kept under ``prefix``, rank 0's lines first."""
    files = prefix.parent.glob(f"{prefix.name}.rank*")
    ordered = sorted(files, key=lambda p: int(p.name.rpartition("rank")[2]))
    return "".join(p.read_text(encoding="utf-8") for p in ordered)


def _train(config: str, overrides: list[str]) -> None:
    from mm_core.config import load_config
    from mm_core.train.trainer import Trainer

    trainer = Trainer(load_config(config, overrides), config).setup()
    try:
        trainer.train()
    finally:
        if trainer.saver is not None:
            trainer.saver.close()


def enter_rank(rank: int, world: int, port: int, env: dict[str, str] | None = None) -> None:
    """The environment of one launched test process: ``env`` (the launching test's; a forkserver child
    starts with the server's) when given, plus the torchrun variables of ``rank`` of ``world`` on this
    machine and one thread."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )


def _worker(rank: int, world: int, port: int, runs: list[Item], cwd: str, env: dict[str, str]) -> None:
    enter_rank(rank, world, port, env)
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    os.chdir(cwd)
    try:
        for item in runs:
            try:
                if isinstance(item, Call):
                    if dist.is_initialized():
                        dist.barrier()
                    item()
                else:
                    _train(item[1], item[2])
            except Exception as exc:
                what = "call" if isinstance(item, Call) else "run"
                raise RuntimeError(f"{what} {_name(item)!r} failed on rank {rank} of {world}") from exc
            if isinstance(item, Call) and dist.is_initialized():
                dist.barrier()
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _name(item: Item) -> str:
    return item.name if isinstance(item, Call) else item[0]


def free_port() -> int:
    """A free TCP port on the loopback address, for a launch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def join_within(context: mp.ProcessContext, timeout: float, what: str) -> None:
    """Wait for the processes of ``context`` (a worker's error is raised again here); after ``timeout``
    seconds kill the ones still alive and raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{what} did not finish in {timeout:.0f} s")


def run_in_one_launch(nproc: int, runs: list[Item], cwd: Path, timeout: float) -> None:
    """Run ``runs`` (training runs and calls) in order on ``nproc`` processes started once; fail on any error
    or after ``timeout`` seconds for the whole launch."""
    context = mp.start_processes(
        _worker,
        args=(nproc, free_port(), runs, str(cwd), dict(os.environ)),
        nprocs=nproc,
        join=False,
        start_method=START_METHOD,
    )
    names = ", ".join(_name(item) for item in runs)
    join_within(context, timeout, f"runs {names} on {nproc} processes")
