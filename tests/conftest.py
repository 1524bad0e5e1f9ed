"""Fixtures shared by the cross-package tests."""

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
