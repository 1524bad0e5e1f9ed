"""One training process: ``CFG [key=value ...]`` under torchrun or mm's local launcher.

Imported by the CLI, the local launcher and ``python -m mm_core.train``; it imports the trainer only
when it runs, so importing it is cheap. User errors (:class:`MMError`) become one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

from mm_core.errors import MMError, TrainingInterrupted
from mm_core.train.signals import EXIT_INTERRUPTED

EXIT_USER_ERROR = 2
ERROR_DIR_ENV = "MM_ERROR_DIR"  # set by the local launcher: workers leave their user errors there
INTERRUPTED_FILE = "interrupted.txt"  # rank 0 leaves it there after a clean stop on SIGTERM/SIGINT


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
    """Run ``fn``; an :class:`MMError` becomes one line on stderr and exit status 2 (no traceback).

    A stop requested by SIGTERM/SIGINT (after its checkpoint) prints one line and returns
    :data:`EXIT_INTERRUPTED`. Any other exception is a bug or a crash in a plugin: it keeps its traceback, and
    a worker of the local launcher also leaves its type, message and traceback tail for the launcher to print.
    """
    try:
        return fn() or 0
    except MMError as exc:
        return report_error(str(exc))
    except TrainingInterrupted as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"mm: {exc}", file=sys.stderr, flush=True)
            if error_dir := os.environ.get(ERROR_DIR_ENV):  # tell the local launcher the stop was clean
                with contextlib.suppress(OSError):
                    Path(error_dir, INTERRUPTED_FILE).write_text(str(exc), encoding="utf-8")
        return EXIT_INTERRUPTED
    except BaseException as exc:
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            _leave_crash_report(exc)
        raise


#: lines of the traceback a crash report keeps (the innermost frames: where the plugin or mm failed)
CRASH_TAIL_LINES = 24


def traceback_tail(exc: BaseException) -> str:
    """The innermost :data:`CRASH_TAIL_LINES` lines of ``exc``'s traceback (where the plugin or mm failed)."""
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    tail = lines[-CRASH_TAIL_LINES:]
    if len(lines) > len(tail):  # start at a frame, not inside one
        while tail and not tail[0].startswith("  File "):
            tail = tail[1:]
        tail = ["Traceback (most recent call last, innermost frames):", *tail]
    return "\n".join(tail)


def _leave_crash_report(exc: BaseException) -> None:
    """For the local launcher: ``crash_<rank>.txt`` with the time, the exception and its traceback tail."""
    error_dir, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not (error_dir and rank is not None):
        return
    report = {
        "time": time.time(),
        "summary": f"{type(exc).__name__}: {exc}",
        "traceback": traceback_tail(exc),
    }
    with contextlib.suppress(OSError):
        Path(error_dir, f"crash_{rank}.json").write_text(json.dumps(report), encoding="utf-8")


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
