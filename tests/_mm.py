"""Helpers for the cross-package tests: run ``mm`` as a user would and read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart" / "config.yaml"


def quickstart_text_data(seq_len: int) -> dict:
    """The YAML ``data:`` block of the quickstart's real text (the Python reference, its local tokenizer),
    packed into sequences of ``seq_len`` tokens, with absolute paths."""
    folder = QUICKSTART.parent
    return {
        "dataset_param": {
            "dataset_type": "text_pretrain",
            "basic_parameters": {
                "dataset_dir": str(folder / "data"),
                "dataset": "python_reference.jsonl",
                "seq_len": seq_len,
            },
            "preprocess_parameters": {"model_name_or_path": str(folder / "tokenizer")},
        },
        "dataloader_param": {"collate_param": {"collator_id": "llm_pretrain"}},
    }


def mm(*args: str, cwd: Path = REPO, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run the ``mm`` CLI in a subprocess (one thread per rank, as on the CI machine)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mm_core.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"mm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_layouts(
    tmp_path_factory, config: Path, layouts: list[tuple], common: list[str] = (), timeout: float = 600
) -> dict[str, list[dict]]:
    """Train ``config`` once per ``(name, processes, overrides)`` layout; the metrics records by name.

    The layouts that share a process count run in one launch of that many processes (one after the other,
    each with its own process group, see :mod:`_launch`); ``timeout`` is per layout."""
    from _launch import run_in_one_launch

    dirs = {name: tmp_path_factory.mktemp(name) for name, _, _ in layouts}
    by_nproc: dict[int, list] = {}
    for name, nproc, extra in layouts:
        overrides = [*common, *extra, f"training.output_dir={dirs[name]}"]
        by_nproc.setdefault(nproc, []).append((name, str(config), overrides))
    for nproc, runs in by_nproc.items():
        run_in_one_launch(nproc, runs, REPO, timeout * len(runs))
    return {name: read_metrics(dirs[name]) for name, _, _ in layouts}


def read_metrics(out_dir: Path) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def assert_close_series(a: list[float], b: list[float], rtol: float, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} values"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12), f"{what} step {i + 1}: {x!r} vs {y!r}"
