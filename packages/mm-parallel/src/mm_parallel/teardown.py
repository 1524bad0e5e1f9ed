"""A clean exit for processes that ran collectives.

A gloo worker thread finishes a collective, wakes the caller, and only then drops its reference to the work
and so to the work's tensors. When the caller's Python side let go of those tensors first, the last release
happens on the worker thread and needs the GIL. If the process is already shutting Python down at that moment
(the process exits right after its last collective: ``all_gather_object`` then return, a trainer's final
logging collective then exit), CPython ends the worker thread with ``pthread_exit``; the unwinding crosses a
``noexcept`` C++ frame and the process aborts with ``terminate called without an active exception``
(SIGABRT, exit status 134), after the job has in fact finished. ``destroy_process_group`` does not prevent it:
gloo groups that Python objects still reference (device meshes, FSDP states, DTensor caches) keep their
threads until the interpreter is gone.

:func:`wait_for_idle_threads` closes the window: it releases the GIL until every other thread of the process
is blocked (waiting for work, a socket, a lock) rather than runnable, so a worker that still has a release
to make gets the GIL and makes it while Python is fully alive. mm runs it at exit (``atexit``, registered
when mm joins a process group); a script that uses ``mm_parallel`` with its own process group can call
:func:`shutdown_distributed` at its end.
"""

from __future__ import annotations

import os
import threading
import time

import torch.distributed as dist

_TASKS = "/proc/self/task"


def _runnable_threads() -> list[str] | None:
    """Native ids of this process's other threads that are running or runnable; None without ``/proc``."""
    if not os.path.isdir(_TASKS):
        return None
    me = threading.get_native_id()
    busy = []
    for tid in os.listdir(_TASKS):
        if tid == str(me):
            continue
        try:
            with open(f"{_TASKS}/{tid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # the name, in parentheses, may hold spaces
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            busy.append(tid)
    return busy


def wait_for_idle_threads(timeout_s: float = 2.0, poll_s: float = 0.005, quiet_polls: int = 3) -> bool:
    """Sleep in ``poll_s`` steps (the GIL released) until no other thread has been runnable for
    ``quiet_polls`` polls in a row; True when that happened within ``timeout_s``.

    A thread blocked on the GIL shows as sleeping while it waits, but it gets the GIL during the next sleep
    and is runnable, or done, at the next poll; hence several quiet polls. Where ``/proc`` is missing (not
    Linux) it sleeps ``quiet_polls`` polls once and returns True."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while True:
        time.sleep(poll_s)
        busy = _runnable_threads()
        quiet = quiet + 1 if not busy else 0
        if quiet >= quiet_polls:
            return True
        if time.monotonic() >= deadline:
            return False


def shutdown_distributed(timeout_s: float = 2.0) -> None:
    """End this process's part in the job: destroy every process group (if any), then
    :func:`wait_for_idle_threads`, so the process can exit without aborting."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    wait_for_idle_threads(timeout_s)
