"""Install a throwaway plugin package into this interpreter's environment with pip (no index, no deps, no
build isolation) for the duration of a test, as a user installs a third-party plugin: mm finds it through
its entry points only, never through a path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, timeout=300
    )


def providers(group: str, name: str) -> list[str]:
    """The distributions that register ``name`` in the entry-point ``group``, seen by a fresh interpreter."""
    code = (
        "import json, sys; from importlib.metadata import entry_points; "
        "eps = entry_points(group=sys.argv[1]); "
        "print(json.dumps([ep.dist.name for ep in eps if ep.name == sys.argv[2]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, group, name], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout))


@contextmanager
def installed(src: Path, dist: str, group: str, name: str, workdir: Path) -> Iterator[Path]:
    """pip-install the package folder ``src`` (copied to ``workdir`` first: the build writes nothing into the
    repository) whose distribution ``dist`` registers ``name`` in ``group``; uninstall it afterwards."""
    assert providers(group, name) == [], f"{name!r} ({group}) is already installed; uninstall it first"
    root = workdir / src.name
    shutil.copytree(src, root)
    proc = pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(root))
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert providers(group, name) == [dist]
        yield root
    finally:
        out = pip("uninstall", "-y", dist)
        assert out.returncode == 0, out.stdout + out.stderr
        assert providers(group, name) == [], f"{dist} is still installed after pip uninstall"
