"""Run outputs on rank 0: ``metrics.jsonl``, TensorBoard events and a progress bar."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path
from typing import Any

import torch

from mm_core.train.outputs import METRICS_FILE, open_metrics


def peak_memory_gb(device: torch.device) -> float:
    """Allocator peak on an accelerator; peak resident set size of the process on CPU."""
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsLogger:
    """Writes one JSON object per logged step; mirrors scalars to TensorBoard and a tqdm bar."""

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tensorboard_dir: Path | None = None,
        progress_bar: bool = True,
    ) -> None:
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        # keeps the records up to start_step (a resumed run's own), so no step is listed twice
        self._file = open_metrics(output_dir / METRICS_FILE, start_step)
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # events of steps after start_step from an earlier attempt are hidden (they are redone)
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=start_step + 1)
        if progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled or self._file is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                refresh=False,
            )

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
