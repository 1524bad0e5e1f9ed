"""``data.dataloader_param.dataloader_mode`` and ``sampler_type``, the MindSpeed-MM keys: ``base`` (a
DataLoader over torch's ``DistributedSampler``) and ``sampler`` with ``BaseRandomBatchSampler`` read the very
same samples on every rank as torch's own ``DistributedSampler`` would, and stay resumable and elastic
because mm reads that order from a global position."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from mm_core.config.schema import DataConfig, MMConfig
from mm_core.config.support import check_supported
from mm_core.data import EpochIterator, build_dataloader
from mm_core.errors import ConfigError


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"sample_id": i}


def _cfg(mode: str, shuffle: bool) -> DataConfig:
    return DataConfig.model_validate(
        {
            "dataset_param": {"dataset_type": "ids"},
            "dataloader_param": {"dataloader_mode": mode, "shuffle": shuffle, "drop_last": True},
        }
    )


def _torch_epochs(n: int, dp: int, rank: int, mbs: int, seed: int, shuffle: bool, epochs: int) -> list[int]:
    """What a plain DataLoader over torch's DistributedSampler hands rank ``rank`` in ``epochs`` epochs."""
    sampler = DistributedSampler(
        Ids(n), num_replicas=dp, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
    )
    loader = DataLoader(Ids(n), batch_size=mbs, sampler=sampler, drop_last=True)
    out: list[int] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            out += batch["sample_id"].tolist()
    return out


@pytest.mark.parametrize("mode", ["base", "sampler"])
@pytest.mark.parametrize("n,dp,mbs,shuffle", [(40, 2, 4, True), (37, 3, 2, True), (29, 4, 3, False)])
def test_every_rank_reads_what_distributed_sampler_gives(mode, n, dp, mbs, shuffle):
    seed = 11
    for rank in range(dp):
        loader = build_dataloader(
            Ids(n), torch.utils.data.default_collate, _cfg(mode, shuffle),
            micro_batch_size=mbs, dp_size=dp, dp_rank=rank, seed=seed,
        )  # fmt: skip
        it = EpochIterator(loader)
        per_epoch = n // (dp * mbs)  # whole micro-batches per rank and epoch
        got: list[int] = []
        for _ in range(2 * per_epoch):
            got += next(it)["sample_id"].tolist()
        assert got == _torch_epochs(n, dp, rank, mbs, seed, shuffle, 2), (mode, rank)


def test_sampler_types_other_than_the_guides_are_refused_with_the_alternative():
    ok = {"dataset_param": {"dataset_type": "ids"}, "dataloader_param": {"dataloader_mode": "base"}}
    base = {
        "data": ok,
        "model": {"model_id": "qwen3"},
        "training": {"train_iters": 1},
    }
    check_supported(MMConfig.model_validate(base))
    bad = {**base, "data": {**ok, "dataloader_param": {"sampler_type": "LengthGroupedSampler"}}}
    expected = r"data\.dataloader_param\.sampler_type: got 'LengthGroupedSampler'.*max_tokens_per_batch"
    with pytest.raises(ConfigError, match=expected):
        check_supported(MMConfig.model_validate(bad))
