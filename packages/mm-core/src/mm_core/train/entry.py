"""One training process: ``CFG [key=value ...]`` under torchrun or mm's local launcher.

Imported by the CLI, the local launcher and ``python -m mm_core.train``; it imports the trainer only
when it runs, so importing it is cheap. User errors (:class:`MMError`) become one line and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable

from mm_core.errors import MMError

EXIT_USER_ERROR = 2
ERROR_DIR_ENV = "MM_ERROR_DIR"  # set by the local launcher: workers leave their user errors there


def report_error(msg: str) -> int:
    """Report a user error. Workers started by ``mm train --nproc-per-node`` hand it to the launcher, which
    prints each distinct message once; under torchrun every rank prints (ranks > 0 say which they are)."""
    rank = os.environ.get("RANK")
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir and rank is not None:
        with open(os.path.join(error_dir, f"rank_{rank}.txt"), "w", encoding="utf-8") as f:
            f.write(msg)
        return EXIT_USER_ERROR
    prefix = "mm: error" if rank in (None, "0") else f"mm: error (rank {rank})"
    print(f"{prefix}: {msg}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def guarded(fn: Callable[[], int | None]) -> int:
    """Run ``fn``; an :class:`MMError` becomes one line on stderr and exit status 2 (no traceback)."""
    try:
        return fn() or 0
    except MMError as exc:
        return report_error(str(exc))


def run_worker(argv: list[str]) -> int:
    """One training process (under torchrun or the local launcher): ``CFG [key=value ...]``."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # known-harmless library warnings that would bury mm's own output on every rank
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    parser = argparse.ArgumentParser(prog="python -m mm_core.train")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)

    def go() -> None:
        from mm_core.config import load_config
        from mm_core.train.trainer import Trainer

        cfg = load_config(args.config, args.overrides)
        trainer = Trainer(cfg, args.config).setup()
        try:
            trainer.train()
        finally:
            trainer.close()

    return guarded(go)
