"""The data-plan contract: mm reads a dataset's parameter keys only through the ``DataPlan`` it declares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from mm_core.config import validate_config
from mm_core.config.schema import MMConfig
from mm_core.data.plan import DataPlan, data_plan_of, registered_data_plan
from mm_core.errors import ConfigError
from mm_core.registry import data_register
from mm_core.train.outputs import check_run_outputs, dataset_dirs


class _Planned:
    mm_data_plan: ClassVar[DataPlan] = DataPlan(source_keys=("shards", "extra"), root_key="root")


class _Undeclared:
    pass


@pytest.fixture
def registered() -> Iterator[None]:
    data_register.register("plan_probe")(_Planned)
    data_register.register("plan_probe_none")(_Undeclared)
    yield
    data_register.unregister("plan_probe")
    data_register.unregister("plan_probe_none")


def _cfg(dataset_type: str, basic: dict[str, object]) -> MMConfig:
    return validate_config(
        {
            "data": {"dataset_param": {"dataset_type": dataset_type, "basic_parameters": basic}},
            "model": {"model_id": "qwen3"},
            "training": {"micro_batch_size": 1, "train_iters": 1},
        }
    )


def test_plan_defaults_and_type_checks() -> None:
    assert data_plan_of(_Undeclared) == DataPlan()
    assert data_plan_of(_Planned).source_keys == ("shards", "extra")
    with pytest.raises(TypeError, match="source_keys: give a tuple"):
        DataPlan(source_keys="dataset")  # type: ignore[arg-type]

    class Bad:
        mm_data_plan = {"source_keys": ["x"]}

    with pytest.raises(
        ConfigError, match="Bad.mm_data_plan: expected an mm_core.data.plan.DataPlan, got dict"
    ):
        data_plan_of(Bad)


def test_output_guard_reads_the_keys_the_plan_names(tmp_path: Path, registered: None) -> None:
    data = tmp_path / "data"
    (data / "part").mkdir(parents=True)
    cfg = _cfg("plan_probe", {"root": str(data), "shards": ["part", "x/*.bin"], "dataset": str(tmp_path)})
    assert registered_data_plan("plan_probe").root_key == "root"
    key = "data.dataset_param.basic_parameters"
    assert [(k, p, r) for k, p, r in dataset_dirs(cfg)] == [
        (f"{key}.root", data, True),
        (f"{key}.shards[0]", data / "part", True),
        (f"{key}.shards[1]", data / "x", False),
    ]
    with pytest.raises(
        ConfigError, match=r"inside the dataset folder .*\(data\.dataset_param\.basic_parameters\.root\)"
    ):
        check_run_outputs(cfg, data / "out", None)
    # a key the plan does not name is the plugin's own business: "dataset" here is not a source
    check_run_outputs(cfg, tmp_path / "out", None)


def test_a_dataset_without_a_plan_has_no_folders(tmp_path: Path, registered: None) -> None:
    cfg = _cfg("plan_probe_none", {"dataset": str(tmp_path), "dataset_dir": str(tmp_path)})
    assert dataset_dirs(cfg) == []
