"""The hooks a model or dataset without token ids uses (a video diffusion transformer over latents), in one
process: ``ModelPlan.count_tokens`` and ``ModelPlan.context_parallel`` (checked, described, the loss type
they need), plan Muon exclusions that name parameters, ``sample_buckets()`` under the token budget and
``set_epoch()`` before every epoch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from mm_core.config import load_config
from mm_core.config.schema import MMConfig, TrainingConfig
from mm_core.data import EpochIterator, TokenBudgetBatchSampler, build_dataloader
from mm_core.data.sampling import bucket_run_ends
from mm_core.errors import ConfigError
from mm_core.models import ModelPlan, plan_of
from mm_core.models.facts import ModelFacts
from mm_core.optim.muon import muon_plan
from mm_core.parallel.context import ContextPlan, plan_context_parallel
from mm_core.parallel.state import ParallelSizes, resolve_sizes

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "config.yaml"


def _split(model: nn.Module, mesh: Any) -> None:
    model.mesh = mesh


def _count(model: nn.Module, batch: Any) -> torch.Tensor:
    return torch.tensor(float(batch["latents"].shape[0]))


class SelfSplit(nn.Module):
    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        muon_exclude_modules=("blocks.{*}.table", "head"), count_tokens=_count, context_parallel=_split
    )

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        for block in self.blocks:
            block.table = nn.Parameter(torch.zeros(1, 6, 4))  # type: ignore[assignment]
        self.head = nn.Linear(4, 4)


def test_plan_hooks_are_checked_and_described() -> None:
    with pytest.raises(TypeError, match="ModelPlan.count_tokens"):
        ModelPlan(count_tokens="tokens")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ModelPlan.context_parallel"):
        ModelPlan(context_parallel=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="excludes cp_split_module"):
        ModelPlan(context_parallel=_split, cp_split_module="model")
    lines = SelfSplit.mm_plan.describe()
    assert "the model splits itself: test_model_hooks._split" in lines[3]
    assert lines[-1].split() == ["init_weights", "-"]


def _plan_cp(model: nn.Module, cfg: MMConfig, sizes: ParallelSizes) -> ContextPlan:
    return plan_context_parallel(model, ModelFacts.of(model), plan_of(model), cfg.model, sizes)


def test_a_model_that_splits_itself_needs_the_raw_loss() -> None:
    sizes = resolve_sizes(load_config(QUICKSTART, ["parallel.ulysses_parallel_size=2"]).parallel, 2)
    raw = load_config(QUICKSTART, ["model.loss_cfg.loss_type=raw"])
    assert _plan_cp(SelfSplit(), raw, sizes).attention is None  # no transformers attention to switch
    with pytest.raises(ConfigError, match="splits its own sequence and computes its own loss; use raw"):
        _plan_cp(SelfSplit(), load_config(QUICKSTART), sizes)
    with pytest.raises(ConfigError, match="neither the model's own .loss"):  # without the hook: refused
        _plan_cp(nn.Linear(2, 2), raw, sizes)


def test_plan_muon_exclusions_may_name_parameters() -> None:
    model = SelfSplit()
    plan = muon_plan(model, TrainingConfig(train_iters=1, optimizer="muon"), SelfSplit.mm_plan)
    assert set(plan.adamw_names) >= {"blocks.0.table", "blocks.1.table", "head.weight", "head.bias"}
    assert set(plan.muon_names) == {"blocks.0.weight", "blocks.1.weight"}


def test_bucket_run_ends() -> None:
    assert bucket_run_ends(np.array([3, 3, 1, 1, 1, 3, 2])).tolist() == [2, 2, 5, 5, 5, 6, 7]


@pytest.mark.parametrize("dp", [1, 2])
def test_budget_micro_batches_never_mix_buckets(dp: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.choice([8, 12, 16], size=60)
    buckets = (lengths == 12) * rng.integers(0, 2, size=60) + lengths  # two shapes share 12 tokens
    seen: Counter[int] = Counter()
    for rank in range(dp):
        sampler = TokenBudgetBatchSampler(
            lengths, dp_size=dp, dp_rank=rank, max_tokens=48, buffer=20, shuffle=True, seed=1,
            drop_last=False, buckets=buckets,
        )  # fmt: skip
        for batch in sampler:
            assert len({int(buckets[i]) for i in batch}) == 1, batch
            assert len(batch) * max(lengths[i] for i in batch) <= 48
            seen.update(batch)
    assert sum(seen.values()) >= 60 and set(seen) == set(range(60))
    # without buckets the same plan mixes the two shapes of 12 tokens
    plain = TokenBudgetBatchSampler(
        lengths, dp_size=1, dp_rank=0, max_tokens=48, buffer=20, shuffle=True, seed=1, drop_last=False
    )
    assert any(len({int(buckets[i]) for i in batch}) > 1 for batch in plain)


class Epochs(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        self.epoch, self.calls = -1, []

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([self.epoch * 100 + i])}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.calls.append(epoch)

    def sample_lengths(self) -> np.ndarray:
        return np.full(4, 3, dtype=np.int64)

    def sample_buckets(self) -> list[str]:  # not integers: refused
        return ["a"] * 4


def test_set_epoch_is_called_before_each_epoch_also_on_resume() -> None:
    cfg = load_config(QUICKSTART, ["data.dataloader_param.shuffle=false"]).data
    ds = Epochs()
    loader = build_dataloader(
        ds, torch.utils.data.default_collate, cfg, micro_batch_size=2, dp_size=1, dp_rank=0, seed=0
    )
    it = EpochIterator(loader)
    seen = [next(it)["x"].flatten().tolist() for _ in range(3)]
    assert seen == [[0, 1], [2, 3], [100, 101]] and ds.calls == [0, 1]
    resumed = EpochIterator(loader)
    resumed.load_state_dict(it.state_dict())
    assert next(resumed)["x"].flatten().tolist() == [102, 103] and ds.calls[-1] == 1


def test_dataloader_refuses_what_an_epoch_dependent_dataset_cannot_use() -> None:
    workers = ["data.dataloader_param.num_workers=1", "data.dataloader_param.persistent_workers=true"]
    cfg = load_config(QUICKSTART, workers).data
    with pytest.raises(ConfigError, match="persistent_workers: dataset .* changes with the epoch"):
        build_dataloader(Epochs(), torch.utils.data.default_collate, cfg, micro_batch_size=2, dp_size=1,
                         dp_rank=0, seed=0)  # fmt: skip
    budget = load_config(QUICKSTART, ["data.dataloader_param.max_tokens_per_batch=6"]).data
    with pytest.raises(ConfigError, match=r"sample_buckets\(\) gave <U1 values"):
        build_dataloader(Epochs(), torch.utils.data.default_collate, budget, micro_batch_size=2, dp_size=1,
                         dp_rank=0, seed=0)  # fmt: skip
