"""Run outputs on rank 0: ``metrics.jsonl``, TensorBoard, Weights & Biases, SwanLab and a progress bar.

Every destination is a :class:`MetricsSink`: ``log(record)`` for each logged step (a record holds ``step``
and the numbers of that step: training metrics and, at evaluation steps, ``eval_loss``...), ``close()`` at
the end. :class:`MetricsLogger` writes each record to every sink the config enables; only the main rank
builds any. The trackers (``tools.wandb``, ``tools.swanlab``) are optional extras of mm-core, imported only
when enabled, and get the run's resolved config once, when the run starts.
"""

from __future__ import annotations

import importlib
import json
import math
import resource
from pathlib import Path
from typing import Any, Protocol

import torch

from mm_core.config.schema import SwanlabConfig, ToolsConfig, WandbConfig
from mm_core.errors import ConfigError
from mm_core.train.outputs import METRICS_FILE, open_metrics


def peak_memory_gb(device: torch.device) -> float:
    """Allocator peak on an accelerator; peak resident set size of the process on CPU."""
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, ``step`` left out (what the scalar sinks plot)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def plot_name(key: str) -> str:
    """Where a metric goes in the plotting sinks: ``eval_loss`` and ``eval_loss/<source>`` under ``eval/``,
    everything else under ``train/`` (``loss/<source>`` becomes ``train/loss/<source>``)."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_") :]
    return f"train/{key}"


class MetricsSink(Protocol):
    """One destination of the logged records."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``metrics.jsonl``: one JSON object per logged step (non-finite numbers as null); a resumed run keeps
    the records up to ``start_step`` and drops the later ones, which it redoes."""

    def __init__(self, output_dir: Path, start_step: int) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open_metrics(output_dir / METRICS_FILE, start_step)

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorboardSink:
    """TensorBoard events (``tools.tensorboard``); events of steps after ``start_step`` from an earlier
    attempt are hidden (they are redone)."""

    def __init__(self, log_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(plot_name(key), value, record["step"])

    def close(self) -> None:
        self._writer.close()


def _import_tracker(name: str) -> Any:
    """The tracker library ``name``, or a ConfigError saying which extra installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(
            f"tools.{name}.enable: true needs the {name} library, which is not importable ({exc}); "
            f"install it with: pip install 'mm-core[{name}]' (or set tools.{name}.enable: false)"
        ) from None


class WandbSink:
    """A Weights & Biases run (``tools.wandb``): the config at start, scalars per logged step."""

    def __init__(self, cfg: WandbConfig, run_config: dict[str, Any], output_dir: Path) -> None:
        wandb = _import_tracker("wandb")
        folder = Path(cfg.dir) if cfg.dir else output_dir
        folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            name=cfg.name or output_dir.name,
            mode=cfg.mode,
            dir=str(folder),
            config=run_config,
        )

    def log(self, record: dict[str, Any]) -> None:
        self._run.log({plot_name(k): v for k, v in scalars(record).items()}, step=record["step"])

    def close(self) -> None:
        self._run.finish()


class SwanlabSink:
    """A SwanLab experiment (``tools.swanlab``): the config at start, scalars per logged step."""

    def __init__(self, cfg: SwanlabConfig, run_config: dict[str, Any], output_dir: Path) -> None:
        swanlab = _import_tracker("swanlab")
        folder = Path(cfg.logdir) if cfg.logdir else output_dir / "swanlog"
        folder.mkdir(parents=True, exist_ok=True)
        self._swanlab = swanlab
        self._run = swanlab.init(
            project=cfg.project or "mm",
            experiment_name=cfg.name or output_dir.name,
            mode=cfg.mode,
            logdir=str(folder),
            config=run_config,
        )

    def log(self, record: dict[str, Any]) -> None:
        self._run.log({plot_name(k): v for k, v in scalars(record).items()}, step=record["step"])

    def close(self) -> None:
        self._swanlab.finish()


class MetricsLogger:
    """Writes every logged record to each enabled sink (rank 0 only) and drives a tqdm bar."""

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tools: ToolsConfig | None = None,
        run_config: dict[str, Any] | None = None,
        progress_bar: bool = True,
    ) -> None:
        self.enabled = enabled
        self.sinks: list[MetricsSink] = []
        self._bar = None
        if not enabled:
            return
        tools = tools or ToolsConfig()
        self.sinks.append(JsonlSink(output_dir, start_step))
        try:
            tb = tools.tensorboard
            if tb.enable:
                self.sinks.append(TensorboardSink(Path(tb.folder or output_dir / "tb"), start_step))
            config = run_config or {}
            if tools.wandb.enable:
                self.sinks.append(WandbSink(tools.wandb, config, output_dir))
            if tools.swanlab.enable:
                self.sinks.append(SwanlabSink(tools.swanlab, config, output_dir))
        except BaseException:
            self.close()
            raise
        if progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        for sink in self.sinks:
            sink.log(record)
        if self._bar is not None:
            shown = {
                "loss": f"{record['loss']:.4f}" if isinstance(record.get("loss"), float) else None,
                "eval": f"{record['eval_loss']:.4f}" if isinstance(record.get("eval_loss"), float) else None,
                "lr": f"{record['lr']:.2e}" if isinstance(record.get("lr"), float) else None,
                "tok_s": f"{record['tokens_per_s']:.0f}" if "tokens_per_s" in record else None,
            }
            self._bar.set_postfix({k: v for k, v in shown.items() if v is not None}, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        sinks, self.sinks = self.sinks, []
        for sink in reversed(sinks):
            sink.close()
