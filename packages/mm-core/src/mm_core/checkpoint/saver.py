"""Checkpoint saving for the training loop: synchronous, or asynchronous with DCP's ``async_save``.

An asynchronous save copies the state to CPU memory (the stall the loop sees), then writes it in a
background thread while training goes on; its collectives run on a separate gloo process group so they never
interleave with the training's own. ``latest`` moves only after the write is complete everywhere: rank 0's
future finishes after DCP has gathered every rank's results and written ``.metadata``. At most one save is in
flight; the next save, the end of training and :meth:`CheckpointSaver.close` wait for it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from mm_core.checkpoint import layout
from mm_core.checkpoint.dcp_io import TrainingState, _states, begin_save, finish_save, save_checkpoint

log = logging.getLogger("mm")


@dataclass
class _Pending:
    step: int
    future: Future[None]
    config_text: str | None


class CheckpointSaver:
    """Saves ``<root>/step_<N>`` for the trainer; ``async_save`` overlaps the writing with training."""

    def __init__(
        self,
        root: str | Path,
        *,
        async_save: bool = False,
        keep: int | None = None,
        save_optim: bool = True,
        save_rng: bool = True,
    ) -> None:
        self.root = Path(root)
        self.async_save = async_save
        self.keep, self.save_optim, self.save_rng = keep, save_optim, save_rng
        self._pending: _Pending | None = None
        # every rank must create the group together: do it here, in setup, not at the first save
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def save(self, step: int, ts: TrainingState, config_text: str | None = None) -> Path:
        """Save ``step``; returns the final folder (which exists once the save has completed)."""
        if not self.async_save:
            return save_checkpoint(
                self.root,
                step,
                ts,
                save_optim=self.save_optim,
                save_rng=self.save_rng,
                config_text=config_text,
                keep=self.keep,
            )
        self.wait()
        partial = begin_save(self.root, step)
        future = dcp.async_save(
            _states(ts, optim=self.save_optim, rng=self.save_rng),
            storage_writer=FileSystemWriter(str(partial)),
            process_group=self._group,
        )
        assert isinstance(future, Future)  # an AsyncSaveResponse comes only with an async_stager
        self._pending = _Pending(step, future, config_text)
        return layout.step_dir(self.root, step)

    def poll(self) -> None:
        """Finish a completed asynchronous save (rank 0 renames it and moves ``latest``); never blocks."""
        if self._pending is not None and self._pending.future.done():
            self._complete()

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and ``latest`` names it."""
        if self._pending is not None:
            self._complete()

    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        pending.future.result()  # re-raises a failed write
        if not dist.is_initialized() or dist.get_rank() == 0:
            final = finish_save(self.root, pending.step, pending.config_text, self.keep)
            log.warning(f"saved checkpoint {final} (asynchronously)")

    def close(self) -> None:
        """Wait for the save in flight, then release the async process group."""
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
