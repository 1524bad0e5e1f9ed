"""Training tasks (``mm.tasks``, ``training.task``): what a run trains and what one step does.

See :mod:`mm_core.tasks.base` for the contract, :mod:`mm_core.tasks.toolkit` for the plumbing every task
shares, :mod:`mm_core.tasks.standard` for the default task and docs/tasks.md for writing one.
"""

from mm_core.tasks.base import MAIN, Reduced, StepResult, Task, TaskContext, TaskParts, task_class
from mm_core.tasks.building import BuiltModel, build_model
from mm_core.tasks.toolkit import TaskToolkit

__all__ = [
    "MAIN",
    "BuiltModel",
    "Reduced",
    "StepResult",
    "Task",
    "TaskContext",
    "TaskParts",
    "TaskToolkit",
    "build_model",
    "task_class",
]
