"""``mm_parallel.teardown``: waiting until the process's other threads are idle before it exits."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from mm_parallel.teardown import shutdown_distributed, wait_for_idle_threads


def test_a_thread_woken_just_before_the_wait_finishes_during_it():
    """The case behind the abort at exit: a thread that still has work (here: after an event) needs the GIL,
    which the caller holds; the wait releases it until the thread is done."""
    go, done = threading.Event(), []

    def late_release() -> None:
        go.wait()
        done.append(sum(range(10_000)))  # Python work: needs the GIL

    worker = threading.Thread(target=late_release, daemon=True)
    worker.start()
    time.sleep(0.05)  # the worker is blocked on the event: idle
    go.set()  # wakes it; the main thread keeps the GIL until it sleeps
    assert wait_for_idle_threads(timeout_s=5.0)
    worker.join(timeout=0)
    assert done == [sum(range(10_000))] and not worker.is_alive()


def test_a_busy_thread_is_waited_for_only_until_the_timeout():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    try:
        start = time.monotonic()
        assert not wait_for_idle_threads(timeout_s=0.2)
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        worker.join()
    assert wait_for_idle_threads(timeout_s=5.0)


def test_shutdown_distributed_destroys_the_groups():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shutdown_distributed()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    shutdown_distributed()  # nothing to destroy: only waits


@pytest.mark.parametrize("quiet_polls", [1, 3])
def test_idle_process_returns_quickly(quiet_polls):
    start = time.monotonic()
    assert wait_for_idle_threads(timeout_s=5.0, quiet_polls=quiet_polls)
    assert time.monotonic() - start < 1.0
