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
   exports); other models are stored in the checkpoint under their own names. A line the task wants shown
   once the run is set up goes in :attr:`Task.setup_note`.
2. :meth:`Task.after_load` after a checkpoint was loaded into the parts (resume).
3. per step, :meth:`Task.train_step` with the step's micro-batches: forward, backward, optimizer steps.
   It returns a :class:`StepResult`: the step's metrics, global over ranks (the same on every rank):
   ``loss`` at least, any other numbers (e.g. ``loss_d``, ``grad_norm_g``); ``tokens`` (the step's input
   tokens, all ranks) is turned into throughput, as is :attr:`StepResult.flops` (its model FLOPs).
   :meth:`TaskContext.reduce` sums tensors over ranks in one collective and agrees on a stop request in
   it; the task passes that agreement on in :attr:`StepResult.stop` (a task that does not get one there
   gets one collective more per step from mm).
4. :meth:`Task.before_save` before each checkpoint, :meth:`Task.after_step` after each step.

The plumbing every task needs around its optimizer steps (gradient clipping, the non-finite policy, the
checks after a load and before a save) is :class:`mm_core.tasks.toolkit.TaskToolkit`.

Models a task builds with :func:`mm_core.tasks.build_model` get the parallel layout of the YAML's
``parallel:`` block and their model's plan, so a task works unchanged on 1, 2 or 1,024 ranks.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mm_core.checkpoint import TrainProgress
from mm_core.config.schema import MMConfig, ModelConfig
from mm_core.errors import ConfigError
from mm_core.parallel.state import ParallelState
from mm_core.tasks.stats import read_on_host, sum_over_ranks
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


#: the name under which :meth:`TaskContext.reduce` sends the stop request (not a metric name)
STOP = "_stop"


@dataclass(frozen=True)
class Reduced:
    """What :meth:`TaskContext.reduce` returns: the sums by name, and whether any rank was asked to stop
    (agreed in the same collective: the same on every rank)."""

    sums: dict[str, float]
    stop: bool


@dataclass
class StepResult:
    """What :meth:`Task.train_step` returns for one step; every value is global (the same on every rank)."""

    #: logged as given: ``loss`` at least, any other number (``loss_critic``, ``grad_norm_critic``,
    #: ``lr_critic``...); ``tokens`` (the step's input tokens, all ranks) also gives ``tokens_per_s``
    metrics: dict[str, float]
    #: whether any rank was asked to stop (SIGTERM/SIGINT), as agreed in the step's own collective
    #: (:attr:`Reduced.stop`); None: the step made no such agreement, mm makes one after it
    stop: bool | None = None
    #: the step's model FLOPs, every rank together; gives ``tflops_per_s`` (and ``mfu``); None: not counted
    flops: float | None = None
    #: with ``log_memory``: the peak memory (GB) of the fullest rank; None: mm measures it
    peak_mem_gb: float | None = None


#: the names mm writes into a step's record itself; a task's metrics may not use them
RECORD_KEYS = ("step", "tokens_per_s", "step_time_s", "peak_mem_gb", "tflops_per_s", "mfu", "skipped_samples")


def check_step_result(result: object, task: str) -> None:
    """What the ``training.task`` named ``task`` returned from a step is a :class:`StepResult` with a
    ``loss`` and none of mm's own record names."""
    if not isinstance(result, StepResult):
        raise ConfigError(
            f"training.task: the train_step of {task!r} returned {type(result).__name__}, not a "
            "mm_core.tasks.StepResult (the step's metrics, its stop agreement and FLOPs)"
        )
    names = ", ".join(result.metrics)
    if "loss" not in result.metrics:
        raise ConfigError(f"training.task: the metrics of {task!r} ({names}) have no 'loss'")
    taken = sorted(set(result.metrics) & set(RECORD_KEYS))
    if taken:
        raise ConfigError(
            f"training.task: the metrics of {task!r} ({names}) use {', '.join(taken)}, which mm writes "
            "itself; return the peak memory as StepResult.peak_mem_gb, or rename the metric"
        )


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
    #: set by mm's signal handler; a task reads it through :attr:`stop_requested`
    stop: StopRequest = field(default_factory=StopRequest)
    #: what :func:`mm_core.tasks.build_model` resolved for each model (the lines ``mm check`` prints too),
    #: logged by the trainer once the run is set up
    build_log: list[str] = field(default_factory=list)
    #: the names of the training data's sources when it mixes several (``basic_parameters.dataset``
    #: entries); each micro-batch then carries each row's source index under
    #: :data:`mm_core.data.sources.SOURCE_KEY` for a task that sets :attr:`Task.reads_sources`
    sources: tuple[str, ...] = ()

    @property
    def param(self) -> dict[str, Any]:
        """``training.task_param``: the task's own settings."""
        return dict(self.cfg.training.task_param)

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def stop_requested(self) -> bool:
        """Whether this process was asked to stop; a task that sums it over ranks in its own collective
        (as ``standard`` does) returns the agreement in :attr:`StepResult.stop`."""
        return self.stop.requested

    def info(self, msg: str) -> None:
        """A notice printed once (by the main rank)."""
        if self.state.is_main:
            log.warning(msg)

    def reduce(self, values: Mapping[str, torch.Tensor]) -> Reduced:
        """Sum 0-dim tensors over every rank in one all-reduce, with the stop request (one host sync);
        returns the sums as floats and the agreed stop. Divide by :attr:`ParallelState.sizes`
        ``.world_size`` for a mean."""
        if STOP in values:
            raise ValueError(f"TaskContext.reduce: {STOP!r} is the name of mm's stop request, not a value")
        flat = {k: v.detach().to(self.device, torch.float64).reshape(()) for k, v in values.items()}
        flat[STOP] = torch.full((), float(self.stop_requested), dtype=torch.float64, device=self.device)
        out = read_on_host(sum_over_ranks(flat))
        stop = out.pop(STOP) > 0
        return Reduced(out, stop)


class Task(ABC):
    """A training task (module docstring). Subclasses implement :meth:`build` and :meth:`train_step`."""

    #: a line mm prints once the run is set up (after a resume), e.g. where the standard task's chunked
    #: loss goes; None: nothing
    setup_note: str | None = None
    #: whether the micro-batches may carry each row's source index (:data:`mm_core.data.sources.SOURCE_KEY`,
    #: with mixed sources) for losses per source; a task that sets it takes the key out of the batch
    reads_sources: bool = False

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
    def train_step(self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False) -> StepResult:
        """One optimizer step over the micro-batches: its global metrics (``loss`` at least), the stop
        agreement of its collective and, with ``log_memory``, optionally the peak memory (else mm measures
        it); see :class:`StepResult`."""

    def after_load(self, path: Path, report: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Called after the checkpoint at ``path`` was loaded into the parts (``report``: what
        :func:`mm_core.checkpoint.load_checkpoint` returned)."""

    def before_save(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called before the checkpoint of ``step`` is written (e.g. to refuse saving broken weights)."""

    def after_step(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called after every step, once its metrics are logged and its checkpoint (if any) started."""

    def eval_step(
        self, micro_batches: Iterable[dict[str, Any]], sources: Sequence[str] = ()
    ) -> dict[str, float]:
        """The validation loss on ``micro_batches`` (``data.eval_dataset_param``; an iterable read once, the
        same number on every rank), global over ranks:
        ``{"loss": ..., "loss/<source>": ...}`` (``sources``: the names of the eval data's sources, when it
        has several). Called with the models as training left them; it must change no training state
        (mm saves and restores the random generators around it). A task without it cannot evaluate."""
        raise ConfigError(
            f"data.eval_dataset_param: the training task {type(self).__name__} "
            f"({self.ctx.cfg.training.task!r}) has no eval_step, so it cannot compute a validation loss; "
            "remove data.eval_dataset_param"
        )


def task_class(name: str) -> Callable[[TaskContext], Task]:
    """The task class registered as ``name`` (``training.task``), checked to be a :class:`Task`."""
    from mm_core.registry import task_register

    cls = task_register.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"training.task: {name!r} is {cls!r}, not a subclass of mm_core.tasks.Task")
    return cls
