"""A run's outputs belong to that run: never mix a new run into another run's metrics or checkpoints.

A run may start in ``training.output_dir`` and ``training.save`` only when they hold nothing of another run,
when it resumes them (``training.load: auto``, or ``training.load`` naming a checkpoint under
``training.save``), or when ``training.overwrite_output_dir: true`` says to replace them (the earlier
checkpoints under ``training.save`` are then removed, and ``metrics.jsonl`` starts empty). Outputs inside a
dataset directory are always refused: files written there could be read back as training data.
``metrics.jsonl`` never lists a step twice: :func:`open_metrics` keeps the records up to the step a run
starts from and drops the later ones, which the run redoes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist

from mm_core.checkpoint import layout
from mm_core.checkpoint.reader import raise_on_all_ranks
from mm_core.config.schema import MMConfig
from mm_core.data.plan import registered_data_plan
from mm_core.errors import ConfigError

log = logging.getLogger("mm")

METRICS_FILE = "metrics.jsonl"
_BASIC = "data.dataset_param.basic_parameters"
_WILDCARDS = "*?["


def _has_wildcard(text: str) -> bool:
    return any(ch in text for ch in _WILDCARDS)


def dataset_dirs(cfg: MMConfig) -> list[tuple[str, Path, bool]]:
    """Folders the dataset reads from, by the keys its :class:`~mm_core.data.plan.DataPlan` names:
    ``(key, folder, recursive)``. The root folder (``root_key``), a directory named by a source key and the
    folder a ``**`` pattern searches are read recursively; a pattern such as ``data/*.jsonl`` reads only the
    files directly in its folder."""
    from mm_core.registry import import_plugins

    import_plugins(cfg.training.plugin)  # a dataset registered by a training.plugin module
    plan = registered_data_plan(cfg.data.dataset_param.dataset_type)
    basic = cfg.data.dataset_param.basic_parameters
    base = basic.get(plan.root_key) if plan.root_key else None
    base = Path(base) if isinstance(base, str) and base else None
    found: list[tuple[str, Path, bool]] = []
    if base is not None:
        found.append((f"{_BASIC}.{plan.root_key}", base, True))
    for name in plan.source_keys:
        spec: Any = basic.get(name)
        entries = [spec] if isinstance(spec, str) else spec if isinstance(spec, list) else []
        for i, entry in enumerate(entries):
            if not isinstance(entry, str) or not entry:
                continue
            key = f"{_BASIC}.{name}" if isinstance(spec, str) else f"{_BASIC}.{name}[{i}]"
            path = Path(entry)
            if base is not None and not path.is_absolute():
                path = base / path
            if _has_wildcard(entry):
                parts = path.parts
                first = next(i for i, part in enumerate(parts) if _has_wildcard(part))
                root = Path(*parts[:first]) if first else Path(".")
                recursive = "**" in entry or first < len(parts) - 1
                found.append((key, root, recursive))
            elif path.is_dir():
                found.append((key, path, True))
    return found


def _inside(path: Path, folder: Path, recursive: bool) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or (recursive and folder in path.parents)


def _refuse_inside_datasets(cfg: MMConfig, outputs: list[tuple[str, Path]]) -> None:
    for out_key, out in outputs:
        for data_key, folder, recursive in dataset_dirs(cfg):
            if _inside(out, folder, recursive):
                raise ConfigError(
                    f"{out_key}: {str(out)!r} is inside the dataset folder {str(folder)!r} ({data_key}); "
                    "files written there could be read back as training data: choose a folder outside it"
                )


def _other_run_checkpoints(save: Path) -> list[str]:
    names = [path.name for _, path in layout.list_checkpoints(save)]
    if not names and (save / layout.LATEST).is_file():
        names = [layout.LATEST]
    return names


def resumes_outputs(cfg: MMConfig, load_path: Path | None) -> bool:
    """True when the run continues the run whose outputs these are: ``training.load: auto``, or a
    ``training.load`` that names a checkpoint under ``training.save``."""
    tcfg = cfg.training
    if tcfg.load == "auto":
        return True
    if load_path is None or not tcfg.save:
        return False
    return Path(load_path).resolve().parent == Path(tcfg.save).resolve()


def _refuse_other_run(cfg: MMConfig, out_dir: Path) -> None:
    metrics = out_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        raise ConfigError(
            f"training.output_dir: {str(out_dir)!r} already holds {METRICS_FILE} of another run; set "
            "training.load: auto to resume that run, or training.overwrite_output_dir: true to start over "
            "there, or choose another training.output_dir"
        )
    save = cfg.training.save
    if save and (names := _other_run_checkpoints(Path(save))):
        shown = ", ".join(names[-3:])
        raise ConfigError(
            f"training.save: {save!r} already holds checkpoints of another run ({shown}); set training.load: "
            "auto to resume from them, or training.overwrite_output_dir: true to replace them, or choose "
            "another training.save"
        )


def _remove_checkpoints(save: Path) -> None:
    """Remove the earlier run's ``step_<N>`` folders, unfinished saves and ``latest`` marker (rank 0)."""
    removed = [path for _, path in layout.list_checkpoints(save)]
    removed += [p for p in save.glob(".step_*.partial") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path)
    for marker in (save / layout.LATEST, save / f".{layout.LATEST}.tmp"):
        marker.unlink(missing_ok=True)
    if removed:
        log.warning(
            f"training.overwrite_output_dir: removed {len(removed)} checkpoint folder(s) of an earlier run "
            f"from {save}"
        )


def check_run_outputs(cfg: MMConfig, out_dir: Path, load_path: Path | None) -> None:
    """Refuse outputs that belong to another run or lie in a dataset folder (a ConfigError naming the key, on
    every rank); with ``training.overwrite_output_dir`` on a fresh start, remove the earlier checkpoints.
    Call on every rank, after ``training.load`` is resolved and before anything is written."""
    tcfg = cfg.training
    outputs = [("training.output_dir", out_dir)]
    if tcfg.save:
        outputs.append(("training.save", Path(tcfg.save)))
    fresh = not resumes_outputs(cfg, load_path)

    def check() -> None:
        _refuse_inside_datasets(cfg, outputs)
        if fresh and not tcfg.overwrite_output_dir:
            _refuse_other_run(cfg, out_dir)

    raise_on_all_ranks(check)
    if fresh and tcfg.overwrite_output_dir and tcfg.save:
        if not dist.is_initialized() or dist.get_rank() == 0:
            _remove_checkpoints(Path(tcfg.save))
        if dist.is_initialized():
            dist.barrier()


def open_metrics(path: Path, start_step: int) -> TextIO:
    """Open ``metrics.jsonl`` for a run that starts after step ``start_step``: the records of steps up to it
    are kept (a resumed run continues its own log), later ones and a line cut short by a crash are dropped,
    so no step is listed twice. A fresh start (step 0) begins with an empty file."""
    kept: list[str] = []
    if start_step > 0 and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(step, int) and step <= start_step:
                kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the caller
