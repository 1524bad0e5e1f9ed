"""The task contract in one process: the parts a task returns are checked, ``training.task`` resolves
through the ``mm.tasks`` registry (``standard`` is mm-core's own entry point), :meth:`TaskContext.reduce`
agrees on a stop request and returns it, and a step's result is checked. Multi-process training with a task
plugin: tests/test_task_plugin.py; the toolkit: test_task_toolkit.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mm_core.errors import ConfigError
from mm_core.registry import task_register
from mm_core.tasks import MAIN, Task, TaskParts, task_class
from mm_core.tasks.standard import StandardTask


def test_parts_need_the_main_model_and_named_optimizers() -> None:
    model, critic = nn.Linear(2, 2), nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = TaskParts({MAIN: model, "critic": critic}, {MAIN: opt})
    assert parts.schedulers == {}
    with pytest.raises(ConfigError, match="no model named 'model'"):
        TaskParts({"generator": model})
    with pytest.raises(ConfigError, match="optimizer 'critc' names no model"):
        TaskParts({MAIN: model, "critic": critic}, {"critc": opt})
    with pytest.raises(ConfigError, match="scheduler 'model' has no optimizer"):
        TaskParts({MAIN: model}, {}, {MAIN: object()})
    for bad in ("optimizer_d", "Critic", "rng_rank0", "data", "2nd"):
        with pytest.raises(ConfigError, match=f"model name '{bad}' must be a lower-case identifier"):
            TaskParts({MAIN: model, bad: critic})


def test_training_task_resolves_through_the_registry() -> None:
    assert task_class("standard") is StandardTask  # mm-core's entry point, the default
    with pytest.raises(ConfigError, match="training.task: unknown task 'standrad'; did you mean 'standard'"):
        task_class("standrad")

    @task_register.register("not_a_task")
    def not_a_task(ctx: Any) -> None:
        return None

    try:
        with pytest.raises(ConfigError, match="'not_a_task' is .* not a subclass of mm_core.tasks.Task"):
            task_class("not_a_task")
    finally:
        task_register.unregister("not_a_task")


def test_a_task_implements_build_and_train_step() -> None:
    class Half(Task):
        def build(self) -> TaskParts:
            return TaskParts({MAIN: nn.Linear(1, 1)})

    with pytest.raises(TypeError, match="abstract method"):
        Half(None)  # type: ignore[abstract,arg-type]


def test_reduce_sums_over_ranks_and_agrees_on_a_stop_request() -> None:
    import types

    import torch.distributed as dist

    from mm_core.tasks import Reduced, TaskContext

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state: Any = types.SimpleNamespace(device=torch.device("cpu"), is_main=True)
        ctx = TaskContext(cfg=None, state=state, load_path=None)  # type: ignore[arg-type]
        reduced = ctx.reduce({"a": torch.tensor(2.0), "b": torch.tensor([3])})
        assert reduced == Reduced({"a": 2.0, "b": 3.0}, stop=False)
        ctx.stop.requested = True  # what the signal handler does
        assert ctx.stop_requested
        assert ctx.reduce({}) == Reduced({}, stop=True)
        with pytest.raises(ValueError, match="'_stop' is the name of mm's stop request"):
            ctx.reduce({"_stop": torch.tensor(1.0)})
    finally:
        dist.destroy_process_group()


def test_the_trainer_reads_only_what_the_contract_declares() -> None:
    """A task's step returns a StepResult with a ``loss``; the names mm writes into a record are mm's."""
    from mm_core.tasks import StepResult
    from mm_core.tasks.base import check_step_result

    check_step_result(StepResult({"loss": 1.0, "tokens": 8}, stop=False, flops=3.0), "lm_gan")
    with pytest.raises(ConfigError, match=r"training.task: the train_step of 'lm_gan' returned dict, not a"):
        check_step_result({"loss": 1.0}, "lm_gan")
    with pytest.raises(ConfigError, match=r"the metrics of 'lm_gan' \(loss_d\) have no 'loss'"):
        check_step_result(StepResult({"loss_d": 1.0}), "lm_gan")
    with pytest.raises(ConfigError, match="use peak_mem_gb, which mm writes itself"):
        check_step_result(StepResult({"loss": 1.0, "peak_mem_gb": 2.0}), "lm_gan")
    assert Task.setup_note is None  # declared on the contract, with its default
