"""Dataset, collator and StatefulDataLoader from the ``data`` block, via the plugin registries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from mm_core.config.schema import DataConfig
from mm_core.errors import ConfigError
from mm_core.registry import collator_register, data_register

#: A collate function: the samples of one micro-batch -> the batch (model inputs plus ``labels``).
Collate = Callable[[list[dict[str, Any]]], dict[str, Any]]


class MapDataset(Protocol):
    """What mm needs of a dataset plugin: map-style, ``len(ds)`` and ``ds[i]`` (checked by
    :func:`build_dataset`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def build_dataset(cfg: DataConfig, seed: int) -> MapDataset:
    """Call the registered dataset class or factory named by ``data.dataset_param.dataset_type``."""
    dp = cfg.dataset_param
    factory = data_register.get(dp.dataset_type)
    dataset: MapDataset = factory(  # a plugin's object: checked to be map-style below
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


def build_collator(cfg: DataConfig, dataset: MapDataset) -> Collate:
    """The collate rule: a dataset's own callable ``collate_fn`` wins; else ``collate_param.collator_id``
    (alias ``model_name``) picks a registered collator; else the tensors are stacked."""
    own = getattr(dataset, "collate_fn", None)
    if callable(own):
        return cast(Collate, own)
    param = cfg.dataloader_param.collate_param
    if param.name is None:
        return torch.utils.data.default_collate
    factory = collator_register.get(param.name)
    collate: Collate = factory(param.model_dump(), dataset)
    return collate


class GlobalOrderSampler(Sampler[int]):
    """This data-parallel rank's share of one epoch, read from a seeded global order from a global position.

    The epoch's global order is a permutation of the dataset seeded by ``(seed, epoch)`` (or the identity
    without shuffling). Starting at global position ``start``, rank ``r`` of ``dp_size`` takes every
    ``dp_size``-th index from ``r``, so after ``k`` global micro-batches of ``micro_batch_size`` per rank
    exactly the first ``start + k * micro_batch_size * dp_size`` samples of the order are consumed, whatever
    ``dp_size`` is. That is what makes the position resharding-safe: a run saved on 2 ranks resumes on 1 or 4
    with no sample of the epoch seen twice and none skipped. With ``drop_last`` the rest is cut to whole
    global micro-batches; without it the order is padded by wrapping to a multiple of ``dp_size``."""

    def __init__(
        self,
        num_samples: int,
        *,
        dp_size: int,
        dp_rank: int,
        micro_batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
    ) -> None:
        self.num_samples, self.dp_size, self.dp_rank = num_samples, dp_size, dp_rank
        self.micro_batch_size, self.shuffle = micro_batch_size, shuffle
        self.seed, self.drop_last = seed, drop_last
        self.epoch = 0
        self.start = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, order) of the last epoch asked for

    def set_position(self, epoch: int, start: int) -> None:
        """Read epoch ``epoch`` from global position ``start`` (samples of that epoch already consumed)."""
        self.epoch, self.start = epoch, start

    def global_order(self) -> list[int]:
        """Every sample index of the current epoch, in the order all ranks together consume them."""
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                order = list(range(self.num_samples))
            self._order = (self.epoch, order)
        return self._order[1]

    def _remaining(self) -> list[int]:
        rest = self.global_order()[self.start :]
        if self.drop_last:
            per_step = self.dp_size * self.micro_batch_size
            return rest[: len(rest) // per_step * per_step]
        pad = -len(rest) % self.dp_size
        if rest and pad:
            rest = rest + [rest[i % len(rest)] for i in range(pad)]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.dp_rank :: self.dp_size])

    def __len__(self) -> int:
        return len(self._remaining()) // self.dp_size


def build_dataloader(
    dataset: MapDataset,
    collate_fn: Collate,
    cfg: DataConfig,
    *,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    seed: int,
) -> StatefulDataLoader:
    """A loader over this rank's share of a seeded global order (see :class:`GlobalOrderSampler`).

    The loader has its own random generator (re-seeded per epoch by :class:`EpochIterator`), so starting an
    iterator never draws from the global torch RNG that dropout uses."""
    dl = cfg.dataloader_param
    per_step = micro_batch_size * dp_size
    if dl.drop_last and len(dataset) < per_step:
        raise ConfigError(
            f"data: the dataset has {len(dataset)} samples, fewer than one global micro-batch "
            f"(training.micro_batch_size {micro_batch_size} x {dp_size} data-parallel ranks)"
        )
    sampler = GlobalOrderSampler(
        len(dataset),
        dp_size=dp_size,
        dp_rank=dp_rank,
        micro_batch_size=micro_batch_size,
        shuffle=dl.shuffle,
        seed=seed,
        drop_last=dl.drop_last,
    )
    kwargs: dict[str, Any] = {}
    if dl.num_workers > 0:
        kwargs["persistent_workers"] = dl.persistent_workers
        if dl.prefetch_factor is not None:
            kwargs["prefetch_factor"] = dl.prefetch_factor
    generator = torch.Generator()
    generator.manual_seed(seed)
    return StatefulDataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        num_workers=dl.num_workers,
        collate_fn=collate_fn,
        pin_memory=dl.pin_memory and torch.accelerator.is_available(),  # cuda or npu; no-op on cpu
        drop_last=dl.drop_last,
        generator=generator,
        **kwargs,
    )


class EpochIterator:
    """Endless micro-batches across epochs; a DCP ``Stateful`` whose state is the data position.

    The position is ``(epoch, samples of the epoch consumed)``, counted in the global order, so it is the same
    on every rank and means the same thing on any data-parallel size (saved once, not per rank). Worker
    processes draw their seeds from ``(seed, epoch)``; a dataset that randomises per sample should derive its
    randomness from the sample index and its ``seed`` so that a resumed epoch reproduces it exactly."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader
        self.sampler: GlobalOrderSampler = loader.sampler
        if not isinstance(self.sampler, GlobalOrderSampler):
            raise TypeError("EpochIterator needs a loader from build_dataloader (a GlobalOrderSampler)")
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch consumed by training
        self._it: Iterator[dict[str, Any]] | None = None
        self._start = 0  # global position this iterator started at
        self._yielded = 0  # micro-batches this iterator has returned

    def _position(self) -> int:
        per_batch = self.sampler.micro_batch_size * self.sampler.dp_size
        return self._start + min(self._yielded * per_batch, len(self.sampler) * self.sampler.dp_size)

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._it is None:
                self.sampler.set_position(self.epoch, self.consumed)
                if self.loader.generator is not None:
                    self.loader.generator.manual_seed(self.sampler.seed * 1_000_003 + self.epoch)
                self._start, self._yielded = self.consumed, 0
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.consumed = 0
                continue
            self._yielded += 1
            self.consumed = self._position()
            return batch

    def __iter__(self) -> EpochIterator:
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": torch.tensor(self.epoch, dtype=torch.int64),
            "consumed": torch.tensor(self.consumed, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self._it = None
