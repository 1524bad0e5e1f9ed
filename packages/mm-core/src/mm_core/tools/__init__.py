"""Profiling tools driven by the ``tools`` block: ``tools.profile`` (torch.profiler traces) and
``tools.memory_profile`` (allocator history and snapshot on accelerators, an RSS timeline on CPU)."""

from __future__ import annotations

from pathlib import Path

from mm_core.config.schema import ToolsConfig
from mm_core.tools.memory_profile import MemoryProfiler, rss_bytes
from mm_core.tools.profile import StepProfiler

__all__ = ["MemoryProfiler", "StepProfiler", "StepTools", "rss_bytes"]


class StepTools:
    """The profilers the trainer calls around each step (``step`` as in metrics.jsonl, from 1)."""

    def __init__(self, cfg: ToolsConfig, rank: int, device_type: str, out_dir: Path) -> None:
        self.profiler = StepProfiler(cfg.profile, rank, device_type, out_dir / "profile")
        self.memory = MemoryProfiler(cfg.memory_profile, rank, device_type, out_dir / "memory_profile")

    def step_begin(self, step: int) -> None:
        self.memory.step_begin(step)
        self.profiler.step_begin(step)

    def step_end(self, step: int) -> None:
        self.profiler.step_end(step)
        self.memory.step_end(step)

    def close(self) -> None:
        self.profiler.close()
        self.memory.close()
