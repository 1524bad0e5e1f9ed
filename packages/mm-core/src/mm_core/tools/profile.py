"""``tools.profile``: a torch.profiler trace of chosen training steps on chosen ranks.

Steps are counted as in ``metrics.jsonl`` (the first step is 1); ``start_step`` .. ``end_step`` inclusive are
recorded, each wrapped in a ``train_step_<n>`` range. The result is a Chrome/Perfetto trace,
``<save_path>/trace_rank<r>_steps<start>-<end>.json``, plus a text table of the top operators.
On an NPU the profiler of torch_npu is used when it is installed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mm_core.config.schema import ProfileConfig
from mm_core.errors import ConfigError

log = logging.getLogger("mm")


def _npu_profiler():
    """``torch_npu.profiler`` (imported lazily), or None."""
    try:
        return importlib.import_module("torch_npu.profiler")
    except ImportError:
        return None


def _npu_experimental(npu: Any, cfg: ProfileConfig) -> Any:
    """torch_npu's experimental config from ``level``, ``aic_metrics_type`` and ``data_simplification``
    (None when none is given: torch_npu's defaults)."""
    given: dict[str, Any] = {}
    if cfg.level is not None:
        name = "Level_none" if cfg.level == "level_none" else cfg.level.capitalize()
        given["profiler_level"] = getattr(npu.ProfilerLevel, name)
    if cfg.aic_metrics_type is not None:
        metric = getattr(npu.AiCMetrics, cfg.aic_metrics_type, None)
        if metric is None:
            raise ConfigError(
                f"tools.profile.aic_metrics_type: {cfg.aic_metrics_type!r} is not a member of "
                "torch_npu.profiler.AiCMetrics (e.g. PipeUtilization)"
            )
        given["aic_metrics"] = metric
    if cfg.data_simplification is not None:
        given["data_simplification"] = cfg.data_simplification
    return npu._ExperimentalConfig(**given) if given else None


class StepProfiler:
    """Starts the profiler at the beginning of ``start_step`` and writes the trace after ``end_step``."""

    def __init__(self, cfg: ProfileConfig, rank: int, device_type: str, default_dir: Path) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device_type = device_type
        self.enabled = cfg.enable and rank in cfg.ranks
        self.save_dir = Path(cfg.save_path) if cfg.save_path else default_dir
        self.trace_path: Path | None = None
        self._prof: Any = None  # torch.profiler.profile, or torch_npu's (no common static type)
        self._range: contextlib.AbstractContextManager | None = None

    def _make(self):
        cfg = self.cfg
        host = cfg.with_cpu is not False  # null: on
        if self.device_type == "npu" and (npu := _npu_profiler()) is not None:
            return npu.profile(
                activities=[npu.ProfilerActivity.CPU] * host + [npu.ProfilerActivity.NPU],
                record_shapes=cfg.record_shapes,
                with_stack=cfg.with_stack,
                profile_memory=cfg.with_memory,
                experimental_config=_npu_experimental(npu, cfg),
            )
        npu_only = [
            k for k in ("level", "aic_metrics_type", "data_simplification") if getattr(cfg, k) is not None
        ]
        if npu_only:
            log.warning(
                "tools.profile: %s apply to Ascend NPU profiling (torch_npu) only; unused on %s",
                ", ".join(npu_only),
                self.device_type,
            )
        if self.device_type == "cpu" and not host:
            raise ConfigError(
                "tools.profile.with_cpu: false leaves nothing to record on a CPU run; set it to true or null"
            )
        activities = [ProfilerActivity.CPU] if host else []
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        return profile(
            activities=activities,
            record_shapes=cfg.record_shapes,
            with_stack=cfg.with_stack,
            profile_memory=cfg.with_memory,
        )

    def step_begin(self, step: int) -> None:
        if not self.enabled or not (self.cfg.start_step <= step <= self.cfg.end_step):
            return
        if step == self.cfg.start_step:
            self._prof = self._make()
            self._prof.__enter__()
        self._range = record_function(f"train_step_{step}")
        self._range.__enter__()

    def step_end(self, step: int) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and step >= self.cfg.end_step:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if self.device_type != "cpu":
            getattr(torch, self.device_type).synchronize()
        prof.__exit__(None, None, None)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self.rank}_steps{self.cfg.start_step}-{self.cfg.end_step}"
        self.trace_path = self.save_dir / f"trace_{stem}.json"
        prof.export_chrome_trace(str(self.trace_path))
        sort = "self_cpu_time_total" if self.device_type == "cpu" else f"self_{self.device_type}_time_total"
        with contextlib.suppress(Exception):  # a table is a convenience; the trace is the result
            table = prof.key_averages().table(sort_by=sort, row_limit=40)
            (self.save_dir / f"ops_{stem}.txt").write_text(table, encoding="utf-8")

    def close(self) -> None:
        """Write what was recorded if training ended inside the window."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._finish()
