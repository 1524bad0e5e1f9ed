"""The plumbing every task shares (:mod:`mm_core.tasks.toolkit`) and named step statistics
(:mod:`mm_core.tasks.stats`), in one process on a real 1-rank gloo group (collectives run; nothing is
faked)."""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mm_core.config import validate_config
from mm_core.errors import ConfigError, NonFiniteError
from mm_core.tasks import TaskContext, TaskToolkit
from mm_core.tasks.stats import read_on_host, start_read, sum_over_ranks


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ctx(good_raw: dict[str, Any], **training: Any) -> TaskContext:
    raw = copy.deepcopy(good_raw)  # the package's base config (conftest): tiny qwen3, quickstart text
    raw["training"].update(training)
    state: Any = types.SimpleNamespace(device=torch.device("cpu"), is_main=True)
    return TaskContext(cfg=validate_config(raw), state=state, load_path=None)


def _model_with_grads(scale: float = 1.0) -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model(torch.randn(5, 4)).sum().mul(scale).backward()
    return model


def test_sum_over_ranks_keeps_names_and_shapes_in_one_buffer(group: None) -> None:
    values = {
        "loss_sum": torch.tensor(1.5, dtype=torch.float64),
        "part:a": torch.tensor([2.0, 1.0], dtype=torch.float64),
        "flops": torch.tensor(7.0, dtype=torch.float64),
    }
    summed = sum_over_ranks(values)
    assert list(summed) == list(values)
    assert summed["part:a"].shape == (2,) and summed["loss_sum"].shape == ()
    # one buffer: every value is a view of the same reduced storage, in the mapping's order
    assert len({t.untyped_storage().data_ptr() for t in summed.values()}) == 1
    a_sum, a_count = summed["part:a"]
    assert read_on_host({"loss": summed["loss_sum"], "a": a_sum, "n": a_count, "flops": summed["flops"]}) == {
        "loss": 1.5,
        "a": 2.0,
        "n": 1.0,
        "flops": 7.0,
    }
    assert read_on_host({}) == {}
    with pytest.raises(ValueError, match="no values"):
        sum_over_ranks({})


def test_clip_is_the_global_norm_of_the_trainable_parameters(good_raw: dict[str, Any], group: None) -> None:
    toolkit = TaskToolkit(_ctx(good_raw, clip_grad=0.5), [])
    model, reference = _model_with_grads(), _model_with_grads()
    model.bias.requires_grad_(False)  # a frozen parameter is neither counted nor clipped
    reference.bias.grad = None
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    norm = toolkit.clip(model)
    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)


def test_update_steps_or_skips_a_non_finite_step_within_the_budget(
    good_raw: dict[str, Any], group: None
) -> None:
    toolkit = TaskToolkit(_ctx(good_raw, skip_nonfinite_steps=1), [])
    model = _model_with_grads()
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert not toolkit.update(opt, sched, step=1, grad_norm=float("nan"), loss=1.0)
    assert torch.equal(model.weight, before) and model.weight.grad is None and sched.last_epoch == 0
    assert toolkit.nonfinite_metrics() == {"skipped_nonfinite_steps": 1}
    model(torch.randn(2, 4)).sum().backward()
    assert toolkit.update(opt, sched, step=2, grad_norm=1.0, loss=1.0)
    assert not torch.equal(model.weight, before) and model.weight.grad is None and sched.last_epoch == 1
    with pytest.raises(NonFiniteError, match="training stopped at step 3: the loss is inf"):
        toolkit.update(opt, sched, step=3, grad_norm=1.0, loss=float("inf"))


def test_no_skipped_count_without_skip_nonfinite_steps(good_raw: dict[str, Any], group: None) -> None:
    toolkit = TaskToolkit(_ctx(good_raw), [])
    assert toolkit.nonfinite_metrics() == {}


def test_load_and_save_checks_cover_every_model(good_raw: dict[str, Any], group: None) -> None:
    good, bad = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        bad.weight[0, 0] = float("nan")
    toolkit = TaskToolkit(_ctx(good_raw, init_model_with_meta_device=True), [good, bad])
    with pytest.raises(NonFiniteError, match=r"the weights are not finite \(weight\)"):
        toolkit.before_save(4)
    with pytest.raises(ConfigError, match="1 tensors hold NaN after initialisation or loading .*: weight"):
        toolkit.after_load()
    with pytest.raises(ConfigError, match="1 tensors hold NaN"):  # built whole: a NaN loaded is caught too
        TaskToolkit(_ctx(good_raw, init_model_with_meta_device=False), [good, bad]).after_load()
    TaskToolkit(_ctx(good_raw), [good]).after_load()
    TaskToolkit(_ctx(good_raw), [good]).before_save(4)


def test_update_then_read_masks_a_non_finite_step_on_the_device(
    good_raw: dict[str, Any], group: None
) -> None:
    """Fused AdamW: the update is issued before the read and skipped by the kernel itself when the loss or
    the grad norm is not finite (weights, moments and step count untouched); the policy then decides as
    :meth:`TaskToolkit.update` does."""
    toolkit = TaskToolkit(_ctx(good_raw, skip_nonfinite_steps=1), [])
    model = _model_with_grads()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    assert toolkit.masks_on_device(opt)
    assert not toolkit.masks_on_device(torch.optim.AdamW(nn.Linear(2, 2).parameters(), foreach=True))

    def step(loss: float, norm: float, number: int) -> tuple[dict[str, float], bool]:
        stats = {
            "loss": torch.tensor(loss, dtype=torch.float64),
            "norm": torch.tensor(norm, dtype=torch.float64),
        }
        read = start_read(stats)
        return toolkit.update_then_read(
            opt,
            sched,
            step=number,
            loss=stats["loss"],
            grad_norm=stats["norm"],
            read=read.result,
            names=("loss", "norm"),
        )

    values, applied = step(1.0, 2.0, 1)
    assert applied and values == {"loss": 1.0, "norm": 2.0} and sched.last_epoch == 1
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    model(torch.randn(5, 4)).sum().backward()
    values, applied = step(1.0, float("nan"), 2)  # skipped within the budget
    assert not applied and sched.last_epoch == 1 and model.weight.grad is None
    assert all(torch.equal(v, after_one[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, state[k]) for k, v in opt.state[model.weight].items())
    model(torch.randn(5, 4)).mul(float("inf")).sum().backward()
    with pytest.raises(NonFiniteError, match="training stopped at step 3: the loss is inf"):
        step(float("inf"), 1.0, 3)
    assert all(torch.equal(v, after_one[k]) for k, v in model.state_dict().items())
    assert not hasattr(opt, "found_inf")
    model(torch.randn(5, 4)).sum().backward()
    assert step(1.0, 1.0, 4)[1] and not torch.equal(model.weight, after_one["weight"])
