"""The data-plan contract: what a dataset plugin tells mm about the keys of its free-form parameter dicts.

``basic_parameters`` and ``preprocess_parameters`` belong to the dataset plugin; mm reads them only through
the keys the plugin names here. A dataset class (or factory) declares
``mm_data_plan: ClassVar[DataPlan] = DataPlan(...)``; :func:`data_plan_of` reads it. A dataset that
declares nothing gets ``DataPlan()``: mm then guards no dataset folder and copies no tokenizer files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mm_core.errors import ConfigError


@dataclass(frozen=True)
class DataPlan:
    """The parameter keys of a dataset that mm itself reads. Every field is optional."""

    #: ``basic_parameters`` keys whose value (a path, a glob pattern or a list of them) names what the
    #: dataset reads; run outputs inside those folders are refused (:mod:`mm_core.train.outputs`)
    source_keys: tuple[str, ...] = ()
    #: the ``basic_parameters`` key of the folder that relative source paths start from
    root_key: str | None = None
    #: the ``preprocess_parameters`` key of the tokenizer / processor folder, whose tokenizer files
    #: ``mm convert dcp-to-hf`` copies into the export
    processor_key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.source_keys, str):
            raise TypeError(
                f"DataPlan.source_keys: give a tuple of keys, not the string {self.source_keys!r}"
            )
        object.__setattr__(self, "source_keys", tuple(self.source_keys))


def data_plan_of(factory: Any) -> DataPlan:
    """The plan of a dataset class or factory: its ``mm_data_plan``; ``DataPlan()`` when it declares none."""
    plan = getattr(factory, "mm_data_plan", None)
    if plan is None:
        return DataPlan()
    if not isinstance(plan, DataPlan):
        name = getattr(factory, "__qualname__", repr(factory))
        raise ConfigError(
            f"{name}.mm_data_plan: expected an mm_core.data.plan.DataPlan, got {type(plan).__name__}"
        )
    return plan


def registered_data_plan(dataset_type: str) -> DataPlan:
    """The plan of the installed or registered dataset ``dataset_type`` (``data.dataset_param.dataset_type``);
    imports nothing but that dataset's entry point."""
    from mm_core.registry import data_register

    return data_plan_of(data_register.get(dataset_type))
