"""Dataset, collator and StatefulDataLoader from the ``data`` block, via the plugin registries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from mm_core.config.schema import DataConfig
from mm_core.errors import ConfigError
from mm_core.registry import collator_register, data_register


def build_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """Call the registered dataset class or factory named by ``data.dataset_param.dataset_type``."""
    dp = cfg.dataset_param
    factory = data_register.get(dp.dataset_type)
    dataset = factory(
        basic_param=dict(dp.basic_parameters),
        preprocess_param=dict(dp.preprocess_parameters),
        dataset_param=dp,
        seed=seed,
    )
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"data.dataset_param.dataset_type: {dp.dataset_type!r} built a {type(dataset).__name__}, "
            "which is not a map-style dataset (it needs __len__ and __getitem__)"
        )
    if len(dataset) == 0:
        raise ConfigError(
            f"data.dataset_param: dataset {dp.dataset_type!r} is empty; check basic_parameters.dataset"
        )
    return dataset


def build_collator(cfg: DataConfig, dataset: Dataset) -> Callable[[list[dict]], dict]:
    """The collate rule: a dataset's own callable ``collate_fn`` wins; else ``collate_param.collator_id``
    (alias ``model_name``) picks a registered collator; else the tensors are stacked."""
    own = getattr(dataset, "collate_fn", None)
    if callable(own):
        return own
    param = cfg.dataloader_param.collate_param
    if param.name is None:
        return torch.utils.data.default_collate
    factory = collator_register.get(param.name)
    return factory(param.model_dump(), dataset)


def build_dataloader(
    dataset: Dataset,
    collate_fn: Callable[[list[dict]], dict],
    cfg: DataConfig,
    *,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    seed: int,
) -> StatefulDataLoader:
    """A StatefulDataLoader over this data-parallel rank's share, shuffled with ``seed`` per epoch."""
    dl = cfg.dataloader_param
    per_step = micro_batch_size * dp_size
    if dl.drop_last and len(dataset) < per_step:
        raise ConfigError(
            f"data: the dataset has {len(dataset)} samples, fewer than one global micro-batch "
            f"(training.micro_batch_size {micro_batch_size} x {dp_size} data-parallel ranks)"
        )
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=dl.shuffle, seed=seed, drop_last=dl.drop_last
    )
    kwargs: dict[str, Any] = {}
    if dl.num_workers > 0:
        kwargs["persistent_workers"] = dl.persistent_workers
        if dl.prefetch_factor is not None:
            kwargs["prefetch_factor"] = dl.prefetch_factor
    return StatefulDataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        num_workers=dl.num_workers,
        collate_fn=collate_fn,
        pin_memory=dl.pin_memory and torch.cuda.is_available(),
        drop_last=dl.drop_last,
        **kwargs,
    )


class EpochIterator:
    """Endless micro-batches across epochs; a DCP ``Stateful`` holding the epoch and the loader position."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader
        self.epoch = 0
        self._it: Iterator | None = None

    def __next__(self) -> dict:
        while True:
            if self._it is None:
                self.loader.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1

    def __iter__(self) -> EpochIterator:
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.loader.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(state["loader"])
        self._it = None
