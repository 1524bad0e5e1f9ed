"""The type checker passes: mypy over packages/*/src with the repository's mypy.ini (strict on mm_parallel and
on mm_core's public API, see the comments there).

mypy keeps an incremental cache in .mypy_cache/ at the repository root: the first run reads torch and the
parts of transformers mm uses (about half a minute); later runs recheck only what changed (seconds).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class MypyRun:
    """A mypy process started early, and the file its output goes to."""

    process: subprocess.Popen[bytes]
    output: IO[str]

    def result(self, timeout: float) -> tuple[int, str]:
        """Wait for it (killed after ``timeout`` seconds): its exit status and output."""
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self.output.seek(0)
        text = self.output.read().strip()
        self.output.close()
        return code, text


def start_mypy() -> MypyRun:
    """mypy over the repository, started at the lowest CPU priority with its output in a temporary file
    (``tests/conftest.py`` starts it as soon as the session has collected this test, so that it runs in the
    idle moments of the tests before it)."""
    output = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # noqa: SIM115 - closed by result()
    process = subprocess.Popen(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini")],
        cwd=ROOT,
        stdout=output,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.nice(19),
    )
    return MypyRun(process, output)


def test_mypy_passes(mypy_run: MypyRun) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed in this environment; run `bash tools/setup_env.sh`")
    code, output = mypy_run.result(timeout=900)
    assert code == 0, f"mypy found type errors (run `python -m mypy` at the root):\n{output}"
