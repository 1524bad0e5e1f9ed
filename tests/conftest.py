"""Fixtures shared by the cross-package tests; mypy (``test_types``) starts as soon as it is collected."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from _mm import REPO


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run in the repository root, outside any torchrun environment; destroy the test's process group."""
    monkeypatch.chdir(REPO)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


_MYPY: dict[str, object] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start mypy in the background when ``test_types`` is among the collected tests: at the lowest priority
    it uses the moments the tests before it leave a core idle (a fresh clone has no mypy cache: a minute)."""
    if session.config.option.collectonly:
        return
    if any(item.path.name == "test_types.py" for item in session.items):
        from test_types import start_mypy

        _MYPY["run"] = start_mypy()


@pytest.fixture
def mypy_run():  # noqa: ANN201 - test_types.MypyRun (imported lazily, like the module)
    """The mypy run started at collection (or one started now when collection did not start it)."""
    from test_types import start_mypy

    return _MYPY.pop("run", None) or start_mypy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A started mypy whose test did not run (``-x`` stopped the session first) is stopped."""
    run = _MYPY.pop("run", None)
    if run is not None:
        run.process.kill()
        run.output.close()
