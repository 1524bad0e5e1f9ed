"""Shared fixtures for mm-core tests: a tiny Qwen3 folder, configs written to tmp_path, the ``mm`` command."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from _tiny import QWEN3

REPO_ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = REPO_ROOT / "examples" / "quickstart"
TINY_QWEN = dict(QWEN3)


def base_config(model_dir: Path | str, out_dir: Path | str) -> dict[str, Any]:
    """A complete, valid config: tiny qwen3 from scratch, quickstart text data (absolute paths)."""
    return {
        "parallel": {
            "fully_shard_parallel_size": "auto",
            "fsdp_plan": {"apply_modules": ["model.layers.{*}"]},
        },
        "data": {
            "dataset_param": {
                "dataset_type": "text_pretrain",
                "basic_parameters": {
                    "dataset_dir": str(QUICKSTART / "data"),
                    "dataset": "python_reference.jsonl",
                    "seq_len": 32,
                },
                "preprocess_parameters": {"model_name_or_path": str(QUICKSTART / "tokenizer")},
            },
            "dataloader_param": {"collate_param": {"collator_id": "llm_pretrain"}},
        },
        "model": {"model_id": "qwen3", "model_name_or_path": str(model_dir), "from_scratch": True},
        "training": {
            "micro_batch_size": 2,
            "train_iters": 2,
            "lr": 1.0e-3,
            "output_dir": str(out_dir),
            "progress_bar": False,
        },
    }


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder holding only the config.json of a 2-layer Qwen3 (no weights)."""
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("tiny_qwen")
    Qwen3Config(**TINY_QWEN).save_pretrained(path)
    return path


@pytest.fixture
def good_raw(tiny_qwen_dir: Path, tmp_path: Path) -> dict[str, Any]:
    return base_config(tiny_qwen_dir, tmp_path / "out")


@pytest.fixture
def write_config(good_raw: dict[str, Any], tmp_path: Path) -> Callable[..., Path]:
    """``write_config(edit)`` writes the base config, changed by ``edit(raw)``, to tmp_path/cfg.yaml."""

    def write(edit: Callable[[dict[str, Any]], Any] | None = None, name: str = "cfg.yaml") -> Path:
        raw = copy.deepcopy(good_raw)
        if edit is not None:
            edit(raw)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        return path

    return write


def clean_env() -> dict[str, str]:
    """The environment without torchrun variables (the CLI must not think it runs under torchrun)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def mm_command() -> list[str]:
    """The ``mm`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("mm")
    assert script.is_file(), f"the mm console script is not installed beside {sys.executable}"
    return [str(script)]


def run_mm_in(cwd: Path, *args: Any, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the ``mm`` command in ``cwd`` and return the completed process."""
    return subprocess.run(
        [*mm_command(), *map(str, args)],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def mm_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``mm_cli(cwd, *args)``: the ``mm`` command as a user runs it."""
    return run_mm_in


@pytest.fixture(scope="session")
def config_file_writer(tiny_qwen_dir: Path) -> Callable[..., Path]:
    """``config_file_writer(folder, edit=None)``: the base config, changed by ``edit``, in ``folder``."""

    def write(
        folder: Path, edit: Callable[[dict[str, Any]], Any] | None = None, name: str = "cfg.yaml"
    ) -> Path:
        raw = base_config(tiny_qwen_dir, folder / "out")
        if edit is not None:
            edit(raw)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        return path

    return write


@pytest.fixture
def run_mm(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_mm(*args)`` runs the ``mm`` command in tmp_path and returns the completed process."""

    def run(*args: Any, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return run_mm_in(tmp_path, *args, timeout=timeout)

    return run
