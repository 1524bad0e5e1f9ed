"""The task contract: what a training task supplies and what mm keeps.

A **task** (``training.task``, looked up in the ``mm.tasks`` entry-point group) decides which models and
optimizers a run has and what one optimizer step does: one model and one loss (``standard``, the default),
or several models trained together, e.g. a vocoder's generator and discriminator with two optimizers
stepped in turn. **mm keeps** the rest: the launcher and the process groups (:class:`ParallelState`), the
data (``data:``; the task gets each step's micro-batches), FSDP/EP/CP of every model through its plan
(:func:`mm_core.tasks.build_model`), one atomic DCP checkpoint of every model, optimizer and scheduler with
the data position and the random state (exact resume), metrics, and SIGTERM/SIGINT handling.

A task is a class ``Task(ctx)``; mm calls, in order:

1. :meth:`Task.build` once: build and shard the models, build the optimizers and schedulers, return them as
   :class:`TaskParts`. ``parts.models["model"]`` is the run's main model (the one ``mm convert dcp-to-hf``
   exports); other models are stored in the checkpoint under their own names.
2. :meth:`Task.after_load` after a checkpoint was loaded into the parts (resume).
3. per step, :meth:`Task.train_step` with the step's micro-batches: forward, backward, optimizer steps.
   It returns the step's metrics, global over ranks (the same on every rank): ``loss`` at least, any other
   numbers (e.g. ``loss_d``, ``grad_norm_g``); ``tokens`` (the step's input tokens, all ranks) and
   ``flops`` (its model FLOPs) are turned into throughput. :meth:`TaskContext.reduce` sums tensors over
   ranks in one collective and also agrees on a stop request; a task that does not call it gets one
   collective more per step from mm.
4. :meth:`Task.before_save` before each checkpoint, :meth:`Task.after_step` after each step.

Models a task builds with :func:`mm_core.tasks.build_model` get the parallel layout of the YAML's
``parallel:`` block and their model's plan, so a task works unchanged on 1, 2 or 1,024 ranks.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mm_core.checkpoint import TrainProgress
from mm_core.config.schema import MMConfig, ModelConfig
from mm_core.errors import ConfigError
from mm_core.parallel.state import ParallelState
from mm_core.train.signals import StopRequest

log = logging.getLogger("mm")

#: the name of the main model in :attr:`TaskParts.models`
MAIN = "model"
#: checkpoint entries a model name may not take
RESERVED = ("optimizer", "scheduler", "progress", "data", "rng")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def check_model_name(name: str, where: str) -> None:
    """A model name of a task: lower-case identifier, not a checkpoint entry of mm's own."""
    if not _NAME.fullmatch(name) or name.split("_")[0] in RESERVED:
        raise ConfigError(
            f"{where}: model name {name!r} must be a lower-case identifier ([a-z][a-z0-9_]*) that does not "
            f"start with {', '.join(RESERVED)}"
        )


@dataclass
class TaskParts:
    """What a task trains: models by name (``"model"``: the main one), and the optimizer and the lr
    scheduler of each trained model, under that model's name."""

    models: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "the task's parts"
        if MAIN not in self.models:
            raise ConfigError(f"{where}: no model named {MAIN!r} (the main model; got {sorted(self.models)})")
        for name in self.models:
            check_model_name(name, where)
        for kind, parts in (("optimizer", self.optimizers), ("scheduler", self.schedulers)):
            stray = sorted(set(parts) - set(self.models))
            if stray:
                raise ConfigError(
                    f"{where}: {kind} {stray[0]!r} names no model (models: {sorted(self.models)})"
                )
        stray = sorted(set(self.schedulers) - set(self.optimizers))
        if stray:
            raise ConfigError(f"{where}: scheduler {stray[0]!r} has no optimizer")


@dataclass
class TaskContext:
    """What mm hands a task: the config, the process groups, where the run resumes from, and the stop
    request (SIGTERM/SIGINT) that :meth:`reduce` agrees on across ranks."""

    cfg: MMConfig
    state: ParallelState
    #: the checkpoint this run resumes from (None: a fresh start); models built with weights from it need
    #: no other initialisation
    load_path: Path | None
    #: the steps done so far (``progress.step``: the last finished step; restored on resume)
    progress: TrainProgress = field(default_factory=TrainProgress)
    stop: StopRequest = field(default_factory=StopRequest)
    #: set when this step's stop request was agreed on (by :meth:`reduce` or :meth:`agree_stop`)
    stop_agreed_this_step: bool = False
    #: what :func:`mm_core.tasks.build_model` resolved for each model (the lines ``mm check`` prints too),
    #: logged by the trainer once the run is set up
    build_log: list[str] = field(default_factory=list)

    @property
    def param(self) -> dict[str, Any]:
        """``training.task_param``: the task's own settings."""
        return dict(self.cfg.training.task_param)

    @property
    def device(self) -> torch.device:
        return self.state.device

    def info(self, msg: str) -> None:
        """A notice printed once (by the main rank)."""
        if self.state.is_main:
            log.warning(msg)

    def reduce(self, values: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Sum 0-dim tensors over every rank in one all-reduce, with the stop request (one host sync);
        returns them as floats. Divide by :attr:`ParallelState.sizes` ``.world_size`` for a mean."""
        names = list(values)
        flat = [values[k].detach().to(self.device, torch.float64).reshape(()) for k in names]
        flat.append(torch.tensor(float(self.stop.requested), dtype=torch.float64, device=self.device))
        stacked = torch.stack(flat)
        dist.all_reduce(stacked)
        out = stacked.tolist()
        self.agree_stop(out[-1] > 0)
        return dict(zip(names, out[:-1]))

    def agree_stop(self, any_rank_requested: bool) -> None:
        """Record the outcome of a collective that summed :attr:`StopRequest.requested` over ranks (for a
        task that folds the request into its own collective, as ``standard`` does)."""
        self.stop.agreed = self.stop.agreed or any_rank_requested
        self.stop_agreed_this_step = True


class Task(ABC):
    """A training task (module docstring). Subclasses implement :meth:`build` and :meth:`train_step`."""

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx = ctx

    @classmethod
    def model_blocks(cls, cfg: MMConfig) -> dict[str, ModelConfig | None]:
        """The models :meth:`build` builds with :func:`mm_core.tasks.build_model`, by name: None for the
        YAML's ``model:`` (the main model), else the ``model:`` block of another model (read from ``cfg``,
        e.g. ``training.task_param``). ``mm check`` checks each through the worker's build pipeline."""
        return {MAIN: None}

    @abstractmethod
    def build(self) -> TaskParts:
        """Build the models (sharded, see :func:`mm_core.tasks.build_model`), optimizers and schedulers."""

    @abstractmethod
    def train_step(
        self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False
    ) -> dict[str, float]:
        """One optimizer step over the micro-batches; the step's global metrics (``loss`` at least; with
        ``log_memory``, ``peak_mem_gb`` may be given, else mm measures it)."""

    def after_load(self, path: Path, report: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Called after the checkpoint at ``path`` was loaded into the parts (``report``: what
        :func:`mm_core.checkpoint.load_checkpoint` returned)."""

    def before_save(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called before the checkpoint of ``step`` is written (e.g. to refuse saving broken weights)."""

    def after_step(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called after every step, once its metrics are logged and its checkpoint (if any) started."""


def task_class(name: str) -> Callable[[TaskContext], Task]:
    """The task class registered as ``name`` (``training.task``), checked to be a :class:`Task`."""
    from mm_core.registry import task_register

    cls = task_register.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"training.task: {name!r} is {cls!r}, not a subclass of mm_core.tasks.Task")
    return cls
