"""The batch-to-device rule, the collate rule and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from mm_core.config.schema import DataConfig, TrainingConfig
from mm_core.data import build_collator, move_to_device
from mm_core.errors import DataError, MMError
from mm_core.optim import build_scheduler, lr_factor
from mm_core.registry import collator_register

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------- move_to_device
def test_tensors_move_floats_take_the_dtype_integers_stay_integer() -> None:
    batch = {
        "input_ids": torch.arange(6).view(2, 3),
        "attention_mask": torch.ones(2, 3, dtype=torch.bool),
        "pixel_values": torch.randn(2, 4),
    }
    out = move_to_device(batch, CPU, torch.bfloat16)
    assert out["input_ids"].dtype == torch.int64
    assert torch.equal(out["input_ids"], batch["input_ids"])
    assert out["attention_mask"].dtype == torch.bool
    assert out["pixel_values"].dtype == torch.bfloat16
    torch.testing.assert_close(out["pixel_values"], batch["pixel_values"].to(torch.bfloat16))
    assert all(t.device == CPU for t in out.values())
    assert out is not batch and batch["pixel_values"].dtype == torch.float32


def test_without_a_dtype_floats_keep_theirs() -> None:
    batch = {"x": torch.randn(3, dtype=torch.float64), "y": torch.randn(3, dtype=torch.float16)}
    out = move_to_device(batch, CPU)
    assert out["x"].dtype == torch.float64 and out["y"].dtype == torch.float16


def test_lists_and_tuples_of_tensors_move_and_keep_their_type() -> None:
    batch = {
        "images": [torch.randn(2, 2), torch.randn(3, 2)],
        "grids": (torch.tensor([1, 2]), torch.tensor([3, 4])),
    }
    out = move_to_device(batch, CPU, torch.float16)
    assert isinstance(out["images"], list) and [t.dtype for t in out["images"]] == [torch.float16] * 2
    assert isinstance(out["grids"], tuple) and [t.dtype for t in out["grids"]] == [torch.int64] * 2
    assert [tuple(t.shape) for t in out["images"]] == [(2, 2), (3, 2)]


def test_plain_values_and_none_pass_through() -> None:
    batch = {
        "n": 3,
        "scale": 0.5,
        "flag": True,
        "name": "doc",
        "nothing": None,
        "lengths": [1, 2, 3],
        "empty": [],
    }
    assert move_to_device(batch, CPU, torch.bfloat16) == batch


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("vision", {"pixel_values": torch.zeros(1)}, "dict"),
        ("mixed", [torch.zeros(1), 3], "list"),
        ("nested_list", [[torch.zeros(1)]], "list"),
        ("obj", object(), "object"),
    ],
)
def test_unsupported_values_raise_data_error_naming_the_field(field: str, value: Any, kind: str) -> None:
    with pytest.raises(DataError) as info:
        move_to_device({"input_ids": torch.zeros(1, dtype=torch.long), field: value}, CPU)
    assert f"batch field {field!r} is a {kind}" in str(info.value)
    assert issubclass(DataError, MMError)


def test_a_batch_that_is_not_a_dict_is_a_data_error() -> None:
    with pytest.raises(DataError, match="returned a list"):
        move_to_device([torch.zeros(1)], CPU)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- build_collator
class DatasetWithCollate:
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.zeros(1)}

    def collate_fn(self, items: list[dict]) -> dict:
        return {"own": True}


class PlainDataset(DatasetWithCollate):
    collate_fn = None  # not callable: the registry decides


def data_cfg(**collate: Any) -> DataConfig:
    return DataConfig.model_validate(
        {"dataset_param": {"dataset_type": "anything"}, "dataloader_param": {"collate_param": collate}}
    )


@pytest.fixture
def recording_collator():
    """A collator factory registered in-process as ``test_rules_collator``; records its arguments."""
    calls: list[tuple[dict, Any]] = []

    def factory(param: dict, dataset: Any):
        calls.append((param, dataset))
        return lambda items: {"from": "registry", "n": len(items)}

    collator_register.register("test_rules_collator")(factory)
    yield calls
    collator_register.unregister("test_rules_collator")


def test_dataset_collate_fn_wins_over_collate_param(recording_collator: list) -> None:
    ds = DatasetWithCollate()
    fn = build_collator(data_cfg(collator_id="test_rules_collator"), ds)
    assert fn([{}]) == {"own": True}
    assert recording_collator == []
    # it wins even when the configured name is not installed: the registry is not consulted at all
    assert build_collator(data_cfg(collator_id="not_installed_anywhere"), ds)([{}]) == {"own": True}


@pytest.mark.parametrize("key", ["collator_id", "model_name"])
def test_collator_id_and_its_alias_model_name_pick_a_registered_collator(
    key: str, recording_collator: list
) -> None:
    ds = PlainDataset()
    fn = build_collator(data_cfg(**{key: "test_rules_collator", "my_option": 5}), ds)
    assert fn([{}, {}]) == {"from": "registry", "n": 2}
    ((param, dataset),) = recording_collator
    assert dataset is ds
    assert param[key] == "test_rules_collator"
    assert param["my_option"] == 5


def test_collator_id_wins_over_model_name(recording_collator: list) -> None:
    fn = build_collator(
        data_cfg(collator_id="test_rules_collator", model_name="not_installed_anywhere"), PlainDataset()
    )
    assert fn([{}]) == {"from": "registry", "n": 1}


def test_without_a_collator_tensors_are_stacked() -> None:
    fn = build_collator(data_cfg(), PlainDataset())
    out = fn([{"x": torch.tensor([1, 2])}, {"x": torch.tensor([3, 4])}])
    assert torch.equal(out["x"], torch.tensor([[1, 2], [3, 4]]))


def test_unknown_collator_names_the_key() -> None:
    with pytest.raises(
        MMError, match=r"data\.dataloader_param\.collate_param\.collator_id: unknown collator"
    ):
        build_collator(data_cfg(model_name="no_such_collator_xyz"), PlainDataset())


# ------------------------------------------------------------------------------------- lr_factor
def tcfg(**kw: Any) -> TrainingConfig:
    return TrainingConfig(**{"train_iters": 10, "lr": 1.0, **kw})


def test_constant_without_warmup() -> None:
    cfg = tcfg(lr_decay_style="constant", lr_min=0.5)
    assert [lr_factor(s, cfg) for s in (0, 5, 9, 10)] == [1.0, 1.0, 1.0, 1.0]


def test_constant_with_warmup() -> None:
    cfg = tcfg(lr_decay_style="constant", lr_warmup_ratio=0.3)  # ceil(3.0) = 3 warmup steps
    assert [lr_factor(s, cfg) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])


def test_warmup_steps_round_up() -> None:
    cfg = tcfg(lr_decay_style="constant", lr_warmup_ratio=0.15)  # ceil(1.5) = 2
    assert [lr_factor(s, cfg) for s in range(3)] == pytest.approx([0.5, 1.0, 1.0])


def test_linear_with_warmup_and_lr_min() -> None:
    cfg = tcfg(lr_decay_style="linear", lr_warmup_ratio=0.2, lr=2.0, lr_min=0.2)  # warmup 2, floor 0.1
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.1 + 0.9 * 0.75, 6: 0.55, 9: 0.1 + 0.9 * 0.125, 10: 0.1, 20: 0.1}
    for step, value in expected.items():
        assert lr_factor(step, cfg) == pytest.approx(value), step


def test_cosine_with_warmup_and_lr_min() -> None:
    cfg = tcfg(lr_decay_style="cosine", lr_warmup_ratio=0.2, lr=1.0, lr_min=0.1)  # warmup 2, decay over 8
    expected = {
        0: 0.5,
        1: 1.0,
        2: 1.0,
        4: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)),
        6: 0.55,
        9: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)),
        10: 0.1,
    }
    for step, value in expected.items():
        assert lr_factor(step, cfg) == pytest.approx(value), step


def test_cosine_without_warmup_goes_to_zero() -> None:
    cfg = tcfg(lr_decay_style="cosine")
    assert lr_factor(0, cfg) == pytest.approx(1.0)
    assert lr_factor(5, cfg) == pytest.approx(0.5)
    assert lr_factor(10, cfg) == pytest.approx(0.0)


def test_scheduler_applies_the_factor_to_every_group() -> None:
    cfg = tcfg(lr_decay_style="linear", lr_warmup_ratio=0.2, lr=2.0, lr_min=0.2)
    p = torch.nn.Parameter(torch.zeros(1))
    q = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(7):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for step, lrs in enumerate(seen):
        assert lrs == pytest.approx([2.0 * lr_factor(step, cfg)] * 2), step
