"""Suite-wide: prepared data (tokenised corpora, record indexes) goes to one temporary cache for the whole
test session (``$MM_CACHE_DIR``, inherited by the ``mm train`` processes tests start), never to the user's
``~/.cache/mm``."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["MM_CACHE_DIR"] = str(tmp_path_factory.mktemp("mm_cache"))
