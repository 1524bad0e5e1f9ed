"""A third-party model package, pip-installed, trains through ``mm train`` on 2 gloo processes.

The package lives only in tmp_path: its own pyproject.toml (hatchling) registers ``tiny_mlp`` in the
``mm.models`` entry-point group. It is installed into this interpreter's environment with pip (that is the
point: no path imports) and uninstalled afterwards.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from _mm import quickstart_text_data
from _pip_package import installed, providers

DIST = "tiny-mm-plugin"
VERSION = "0.0.1"
SEQ_LEN = 64
MICRO_BATCH = 2
NPROC = 2

PYPROJECT = f"""\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{DIST}"
version = "{VERSION}"
description = "A throwaway mm model plugin for tests"
requires-python = ">=3.10"
dependencies = ["mm-core"]

[project.entry-points."mm.models"]
tiny_mlp = "tiny_mm_plugin.model:TinyLM"

[tool.hatch.build.targets.wheel]
packages = ["src/tiny_mm_plugin"]
"""

MODEL = '''\
"""A tiny custom language model implementing mm_core.models.BaseModel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from mm_core.models import BaseModel, ModelArguments, ModelPlan


@dataclass
class TinyOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class TinyLM(nn.Module, BaseModel):
    """Embedding, residual MLP blocks, head. Each block is an FSDP unit by default."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(fsdp_units=("blocks.{*}",))

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(),
                          nn.Linear(2 * hidden, hidden))
            for _ in range(n_blocks)
        )
        self.head = nn.Linear(hidden, vocab_size)

    @classmethod
    def _from_config(cls, args: ModelArguments) -> TinyLM:
        return cls(**args.config_overrides)

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> TinyLM:
        model = cls._from_config(args)
        if args.model_name_or_path:
            model.load_state_dict(torch.load(f"{args.model_name_or_path}/weights.pt", weights_only=True))
        return model

    def forward(self, input_ids, labels=None, position_ids=None, **kwargs) -> TinyOutput:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        loss = None
        if labels is not None:
            flat = logits[:, :-1].flatten(0, 1).float()
            loss = F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100)
        return TinyOutput(loss=loss, logits=logits)
'''


def mm(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [str(Path(sys.executable).with_name("mm")), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Write the package, pip-install it (no deps, no build isolation, no index), uninstall it afterwards."""
    root = tmp_path_factory.mktemp("tiny_mm_plugin_src") / "tiny-mm-plugin"
    pkg = root / "src" / "tiny_mm_plugin"
    pkg.mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT, encoding="utf-8")
    (root / "README.md").write_text("A throwaway mm plugin.\n", encoding="utf-8")
    (pkg / "__init__.py").write_text('"""Throwaway mm plugin."""\n', encoding="utf-8")
    (pkg / "model.py").write_text(MODEL, encoding="utf-8")
    with installed(root, DIST, "mm.models", "tiny_mlp", tmp_path_factory.mktemp("tiny_mm_plugin")) as copy:
        yield copy


@pytest.mark.slow
def test_installed_plugin_trains_on_two_processes(installed_plugin: Path, tmp_path: Path) -> None:
    # installed as a real distribution, not imported from its source folder
    assert providers("mm.models", "tiny_mlp") == [DIST]

    out_dir = tmp_path / "out"
    cfg = {
        "parallel": {"fully_shard_parallel_size": "auto"},  # no fsdp_plan: the model's default plan is used
        "data": quickstart_text_data(SEQ_LEN),
        "model": {
            "model_id": "tiny_mlp",
            "from_scratch": True,
            "config_overrides": {"vocab_size": 4096, "hidden": 32, "n_blocks": 2},
        },
        "training": {
            "micro_batch_size": MICRO_BATCH,
            "train_iters": 3,
            "lr": 1.0e-3,
            "log_interval": 1,
            "output_dir": str(out_dir),
            "progress_bar": False,
            "save": str(tmp_path / "ckpt"),
        },
    }
    path = tmp_path / "tiny_mlp.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")

    proc = mm("train", str(path), "--nproc-per-node", str(NPROC), cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    records = [
        json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 20, r
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        assert r["tokens"] == NPROC * MICRO_BATCH * SEQ_LEN, r
        for key in ("lr", "tokens_per_s", "step_time_s", "peak_mem_gb", "tflops_per_s"):
            assert key in r, r
        assert r["tflops_per_s"] > 0 and "mfu" not in r, (
            r
        )  # a CPU's peak is unknown without tools.peak_tflops
    resolved = yaml.safe_load((out_dir / "config.yaml").read_text())
    assert resolved["model"]["model_id"] == "tiny_mlp"

    plugins = mm("plugins", cwd=tmp_path)
    assert plugins.returncode == 0, plugins.stderr
    rows = [line.split() for line in plugins.stdout.splitlines()]
    assert ["model", "tiny_mlp", DIST, VERSION, "tiny_mm_plugin.model:TinyLM"] in rows, plugins.stdout

    # a custom (non-transformers) model exports its weights as one safetensors file with its own names
    export = mm("convert", "dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "export"), cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert any(n.startswith("blocks.0.") for n in names), sorted(names)
