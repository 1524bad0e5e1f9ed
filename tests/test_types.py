"""The type checker passes: mypy over packages/*/src with the repository's mypy.ini (strict on mm_parallel and
on mm_core's public API, see the comments there).

mypy keeps an incremental cache in .mypy_cache/ at the repository root: the first run reads torch and the
parts of transformers mm uses (about half a minute); later runs recheck only what changed (seconds).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_passes() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed in this environment; run `bash tools/setup_env.sh`")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"mypy found type errors (run `python -m mypy` at the root):\n{output}"
