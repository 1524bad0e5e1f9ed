"""Helpers for the cross-package tests: run ``mm`` as a user would and read its outputs."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

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


def registered_model_ids() -> set[str]:
    """The ``mm.models`` entry points of every package of the repository (``packages/*/pyproject.toml``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import pytest

        tomllib = pytest.importorskip("tomli")
    ids: set[str] = set()
    for pyproject in sorted(REPO.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        ids |= set(project.get("entry-points", {}).get("mm.models", {}))
    return ids


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


def checkpoint_tensors(ckpt: Path, suffix: str = "") -> dict[str, Any]:
    """The model tensors (keys ``model.*`` ending in ``suffix``) of a DCP checkpoint folder, read with the
    shapes and dtypes of its metadata and nothing unpickled."""
    import torch
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if k.startswith("model.") and k.endswith(suffix)
    }
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def assert_close_series(a: list[float], b: list[float], rtol: float, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} values"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12), f"{what} step {i + 1}: {x!r} vs {y!r}"


#: what `mm` (tests/conftest.py's clean environment) runs without: torchrun's variables
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _python_default_warning_filters() -> None:
    """The warning filters of a fresh interpreter (what the ``mm`` script starts with), not pytest's."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)


def mm_here(*args: Any, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``mm ARGS`` run in ``cwd`` by ``mm_core.cli.main`` in this process, as the ``mm`` script runs it
    (``sys.exit(main())``): the exit status (0, main's return value, a SystemExit's code, or 1 and the
    traceback on stderr for any other exception) and what it prints. What would reach the script's stderr
    reaches the captured stderr: warnings (under a fresh interpreter's filters), log records without a
    handler (logging's last resort) and those of a library's own stream handler. The environment (without
    torchrun's variables), the working directory, logging and warnings are restored afterwards."""
    from mm_core.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    env, cwd_before = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    streams = [
        (h, h.stream)
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
        for h in logger.handlers
        if type(h) is logging.StreamHandler
    ]
    try:
        for key in TORCHRUN_ENV:
            os.environ.pop(key, None)
        os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        os.chdir(cwd)
        root.handlers, root.level = [], logging.WARNING  # pytest's log capture off: the last resort prints
        for handler, _ in streams:  # not setStream: it flushes the old stream, which may be closed
            handler.stream = err
        with warnings.catch_warnings(record=True) as caught, redirect_stdout(out), redirect_stderr(err):
            _python_default_warning_filters()
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):
                    print(exc.code, file=err)
            except Exception:
                traceback.print_exc(file=err)
                code = 1
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        for handler, stream in streams:
            handler.stream = stream
        root.handlers, root.level = root_handlers, root_level
        os.chdir(cwd_before)
        os.environ.clear()
        os.environ.update(env)
    return subprocess.CompletedProcess(["mm", *argv], code, out.getvalue(), err.getvalue())
