"""``tools.memory_profile``: where memory goes during chosen training steps on chosen ranks.

- CUDA / NPU: the caching allocator records the history of every allocation from the beginning of
  ``start_step``; after ``end_step`` a snapshot is written to ``<save_path>/memory_snapshot_rank<r>.pickle``
  (open it at https://pytorch.org/memory_viz).
- CPU: a sampler thread reads the process's resident set size every ``interval_s`` seconds; the result,
  ``<save_path>/memory_timeline_rank<r>.json``, holds every sample (time, step, RSS) and, per step, the RSS at
  its start and end and its peak.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

from mm_core.config.schema import MemoryProfileConfig

log = logging.getLogger("mm")

MiB = 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _RSSSampler:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.t0 = time.perf_counter()
        self.step = 0
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mm-rss-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        rss = rss_bytes()
        with self._lock:
            self.samples.append((time.perf_counter() - self.t0, self.step, rss))
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class MemoryProfiler:
    """Allocator history + snapshot on accelerators; an RSS timeline on CPU."""

    def __init__(
        self,
        cfg: MemoryProfileConfig,
        rank: int,
        device_type: str,
        default_dir: Path,
        *,
        interval_s: float = 0.005,
        max_entries: int = 100_000,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device_type = device_type
        self.enabled = cfg.enable and rank in cfg.ranks
        self.save_dir = Path(cfg.save_path) if cfg.save_path else default_dir
        self.interval_s = interval_s
        self.max_entries = cfg.max_entries or max_entries
        self.output: Path | None = None
        self._sampler: _RSSSampler | None = None
        self._steps: list[dict[str, Any]] = []
        self._recording = False

    def _memory_module(self):
        import torch

        mod = getattr(getattr(torch, self.device_type), "memory", None)
        if mod is None or not hasattr(mod, "_record_memory_history"):
            raise RuntimeError(
                f"tools.memory_profile: torch.{self.device_type}.memory has no allocator history recording "
                "in this installation; set tools.memory_profile.enable: false"
            )
        return mod

    def step_begin(self, step: int) -> None:
        if not self.enabled or not (self.cfg.start_step <= step <= self.cfg.end_step):
            return
        if self.device_type == "cpu":
            if self._sampler is None:
                self._sampler = _RSSSampler(self.interval_s)
            self._sampler.step = step
            self._steps.append({"step": step, "t_start_s": time.perf_counter() - self._sampler.t0})
            self._steps[-1]["rss_start_mb"] = self._sampler.sample() / MiB
        elif not self._recording:
            self._memory_module()._record_memory_history(max_entries=self.max_entries, stacks=self.cfg.stacks)
            self._recording = True

    def step_end(self, step: int) -> None:
        if not self.enabled or not (self.cfg.start_step <= step <= self.cfg.end_step):
            return
        if self._sampler is not None:
            rec = self._steps[-1]
            rec["rss_end_mb"] = self._sampler.sample() / MiB
            rec["t_end_s"] = time.perf_counter() - self._sampler.t0
            with self._sampler._lock:
                in_step = [rss for _, s, rss in self._sampler.samples if s == step]
            rec["rss_peak_mb"] = max(in_step) / MiB
            rec["samples"] = len(in_step)
        if self.cfg.mem_info:
            log.warning("memory_profile rank %d step %d: %s", self.rank, step, self._mem_info())
        if step >= self.cfg.end_step:
            self._finish()

    def _mem_info(self) -> str:
        """This step's memory in one line (``tools.memory_profile.mem_info``)."""
        if self.device_type == "cpu":
            rec = self._steps[-1] if self._steps else {}
            return ", ".join(f"{k} {v:.1f}" for k, v in rec.items() if k.startswith("rss_"))
        import torch

        mod = getattr(torch, self.device_type)
        return (
            f"allocated {mod.memory_allocated() / MiB:.1f} MiB, "
            f"reserved {mod.memory_reserved() / MiB:.1f} MiB, peak {mod.max_memory_allocated() / MiB:.1f} MiB"
        )

    def _finish(self) -> None:
        self.save_dir.mkdir(parents=True, exist_ok=True)
        if self._sampler is not None:
            sampler, self._sampler = self._sampler, None
            sampler.stop()
            self.output = self.save_dir / f"memory_timeline_rank{self.rank}.json"
            data = {
                "rank": self.rank,
                "device": "cpu",
                "measure": "resident set size of the process (bytes held in RAM)",
                "interval_s": self.interval_s,
                "steps": self._steps,
                "samples": [{"t_s": t, "step": s, "rss_mb": r / MiB} for t, s, r in sampler.samples],
            }
            self.output.write_text(json.dumps(data, indent=1), encoding="utf-8")
        elif self._recording:
            mod = self._memory_module()
            self.output = self.save_dir / f"memory_snapshot_rank{self.rank}.pickle"
            mod._dump_snapshot(str(self.output))
            mod._record_memory_history(enabled=None)
            self._recording = False

    def close(self) -> None:
        """Write what was recorded if training ended inside the window."""
        if self._sampler is not None or self._recording:
            self._finish()
