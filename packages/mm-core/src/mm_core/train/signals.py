"""Stop cleanly on SIGTERM/SIGINT: finish the current step, save, exit with :data:`EXIT_INTERRUPTED`.

A cluster scheduler sends SIGTERM before it preempts a job; Ctrl-C sends SIGINT to every process of the
terminal's process group (the launcher forwards it once more). The handler only records the request; the
trainer reads it at the end of each step through a collective, so every rank stops after the same step.
Repeated signals are ignored (the launcher escalates to SIGKILL after its shutdown timeout).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: exit status of a run stopped by a signal after saving (EX_TEMPFAIL: "try again" — resume)
EXIT_INTERRUPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Whether this process was asked to stop (``requested``, set by the signal handler). Ranks agree on it
    in a step's collective (:meth:`mm_core.tasks.TaskContext.reduce`); the step's result carries the
    agreement (:attr:`mm_core.tasks.StepResult.stop`)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = "a signal"

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self.requested:
            self.requested = True
            self.signal_name = signal.Signals(signum).name
            rank = os.environ.get("RANK", "0")
            if rank == "0":
                os.write(
                    2,
                    f"mm: {self.signal_name} received: finishing the current step, saving a checkpoint, "
                    "then stopping\n".encode(),
                )

    @contextmanager
    def handling_signals(self) -> Iterator[StopRequest]:
        """Record SIGTERM/SIGINT instead of dying, for the duration of the block (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
