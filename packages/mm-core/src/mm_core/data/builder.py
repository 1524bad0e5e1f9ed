"""Dataset, collator and StatefulDataLoader from the ``data`` block, via the plugin registries.

Which sample each rank reads (the epoch's global order, weighted mixing, token-budget batching) is the job
of :mod:`mm_core.data.sampling`; :class:`EpochIterator` carries the data position across epochs and
checkpoints."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from mm_core.config.schema import DataConfig
from mm_core.data.packing import enable_packing
from mm_core.data.sampling import (
    BUDGET_KEY,
    GlobalOrderSampler,
    SourceMixing,
    TokenBudgetBatchSampler,
    source_mixing,
)
from mm_core.errors import ConfigError
from mm_core.registry import collator_register, data_register

#: A collate function: the samples of one micro-batch -> the batch (model inputs plus ``labels``).
Collate = Callable[[list[dict[str, Any]]], dict[str, Any]]


#: Either sampler of :func:`build_dataloader`: both read the epoch's global order from a global position.
EpochSampler = GlobalOrderSampler | TokenBudgetBatchSampler


class MapDataset(Protocol):
    """What mm needs of a dataset plugin: map-style, ``len(ds)`` and ``ds[i]`` (checked by
    :func:`build_dataset`).

    Optional, read when present (see :mod:`mm_core.data.sampling`):

    - ``source_sizes: Sequence[int]`` and ``source_weights: Sequence[float] | None`` — samples per entry of
      ``basic_parameters.dataset`` (in index order) and the mixing weights from ``basic_parameters.weights``
      (None: no mixing). Each epoch then draws every source in proportion to its weight.
    - ``sample_lengths() -> numpy int array of len(ds)`` — tokens per sample as the collator will see them
      (text tokens, image/audio placeholder tokens included); required by
      ``data.dataloader_param.max_tokens_per_batch``.
    - ``sample_buckets() -> numpy int array of len(ds)`` — with ``max_tokens_per_batch``, a micro-batch holds
      samples of one bucket only (e.g. video latents of one shape).
    - ``set_epoch(epoch)`` — called before each epoch's samples are read (also when resuming), so per-sample
      randomness can depend on ``(seed, epoch, index)``; needs ``persistent_workers: false`` with workers.
    """

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
    param = cfg.dataloader_param.collate_param
    if callable(own):
        collate = cast(Collate, own)
        name = f"{cfg.dataset_param.dataset_type}.collate_fn"
    elif param.name is None:
        collate, name = torch.utils.data.default_collate, "default_collate"
    else:
        collate, name = collator_register.get(param.name)(param.model_dump(), dataset), param.name
    if cfg.dataloader_param.packing:  # one packed row per micro-batch (mm_core.data.packing)
        enable_packing(collate, name)
    return collate


def sample_lengths(dataset: MapDataset, dataset_type: str = "") -> npt.NDArray[np.int64]:
    """The dataset's ``sample_lengths()`` as int64, checked: one length of at least 1 token per sample.

    A dataset without the method is a ConfigError naming ``data.dataloader_param.max_tokens_per_batch``."""
    name = dataset_type or type(dataset).__name__
    method = getattr(dataset, "sample_lengths", None)
    if not callable(method):
        raise ConfigError(
            f"{BUDGET_KEY}: dataset {name!r} has no sample_lengths() (tokens per sample), which token-budget "
            "batching needs; remove the key to batch training.micro_batch_size samples"
        )
    lengths = np.asarray(method())
    if lengths.shape != (len(dataset),) or not np.issubdtype(lengths.dtype, np.integer):
        raise ConfigError(
            f"data.dataset_param.dataset_type: {name!r}.sample_lengths() gave {lengths.dtype} values of "
            f"shape {lengths.shape}; expected one integer per sample ({len(dataset)})"
        )
    if len(lengths) and int(lengths.min()) < 1:
        bad = int(lengths.argmin())
        raise ConfigError(
            f"data.dataset_param.dataset_type: {name!r}.sample_lengths() says sample {bad} has "
            f"{int(lengths[bad])} tokens; every sample needs at least 1"
        )
    return lengths.astype(np.int64, copy=False)


def _budget_sampler(
    dataset: MapDataset, cfg: DataConfig, *, dp_size: int, dp_rank: int, seed: int, mix: bool = True
) -> TokenBudgetBatchSampler:
    dl, dataset_type = cfg.dataloader_param, cfg.dataset_param.dataset_type
    assert dl.max_tokens_per_batch is not None
    lengths = sample_lengths(dataset, dataset_type)
    longest = int(lengths.argmax())
    if lengths[longest] > dl.max_tokens_per_batch:
        raise ConfigError(
            f"{BUDGET_KEY}: {dl.max_tokens_per_batch} is smaller than sample {longest}, which has "
            f"{int(lengths[longest])} tokens; raise it to at least {int(lengths[longest])}"
        )
    if dl.drop_last and len(dataset) < dp_size:
        raise ConfigError(
            f"data: the dataset has {len(dataset)} samples, fewer than the {dp_size} data-parallel ranks "
            f"that each need one per micro-batch ({BUDGET_KEY} is set)"
        )
    buckets = getattr(dataset, "sample_buckets", None)
    return TokenBudgetBatchSampler(
        lengths,
        dp_size=dp_size,
        dp_rank=dp_rank,
        max_tokens=dl.max_tokens_per_batch,
        buffer=dl.dynamic_batch_buffer,
        shuffle=dl.shuffle,
        seed=seed,
        drop_last=dl.drop_last,
        mixing=_mixing(dataset, dataset_type, mix),
        buckets=_checked_buckets(buckets(), len(dataset), dataset_type) if callable(buckets) else None,
        packed=dl.packing,
    )


def _mixing(dataset: MapDataset, dataset_type: str, mix: bool) -> SourceMixing | None:
    """The dataset's own mixing (``mix``), or each source weighted by its size: with that weight every
    sample comes once per epoch, and without shuffling the sources are merged evenly by position."""
    if mix:
        return source_mixing(dataset, dataset_type)
    sizes = [int(n) for n in getattr(dataset, "source_sizes", None) or ()]
    if len(sizes) < 2 or min(sizes) < 1 or sum(sizes) != len(dataset):
        return None
    return SourceMixing(tuple(sizes), tuple(float(n) for n in sizes))


def _checked_buckets(buckets: Any, n: int, dataset_type: str) -> npt.NDArray[np.int64]:
    values = np.asarray(buckets)
    if values.shape != (n,) or not np.issubdtype(values.dtype, np.integer):
        raise ConfigError(
            f"data.dataset_param.dataset_type: {dataset_type!r}.sample_buckets() gave {values.dtype} values "
            f"of shape {values.shape}; expected one integer per sample ({n})"
        )
    return values.astype(np.int64, copy=False)


def build_dataloader(
    dataset: MapDataset,
    collate_fn: Collate,
    cfg: DataConfig,
    *,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    seed: int,
    mix: bool = True,
) -> StatefulDataLoader:
    """A loader over this rank's share of a seeded global order (see :mod:`mm_core.data.sampling`).

    Batches are ``micro_batch_size`` samples (:class:`GlobalOrderSampler`), or cut by the token budget
    ``data.dataloader_param.max_tokens_per_batch`` when it is set (:class:`TokenBudgetBatchSampler`;
    ``micro_batch_size`` is then ignored). The loader has its own random generator (re-seeded per epoch by
    :class:`EpochIterator`), so starting an iterator never draws from the global torch RNG that dropout
    uses. ``mix=False`` reads every sample once, the sources interleaved in proportion to their sizes,
    whatever the dataset's ``source_weights`` (evaluation)."""
    dl = cfg.dataloader_param
    kwargs: dict[str, Any] = {}
    if dl.num_workers > 0 and dl.persistent_workers and callable(getattr(dataset, "set_epoch", None)):
        raise ConfigError(
            f"data.dataloader_param.persistent_workers: dataset {cfg.dataset_param.dataset_type!r} changes "
            "with the epoch (set_epoch), which workers kept across epochs would not see; set it to false"
        )
    if dl.num_workers > 0:
        kwargs["persistent_workers"] = dl.persistent_workers
        # ranks that `mm train` starts are spawned, and a spawned process spawns its own workers: each new
        # worker would import torch, transformers and the plugins again at every epoch start (~20 s here).
        # Fork them, as torch does in ranks started by torchrun (workers never touch the device or the
        # process group)
        if "fork" in multiprocessing.get_all_start_methods():
            kwargs["multiprocessing_context"] = "fork"
        if dl.prefetch_factor is not None:
            kwargs["prefetch_factor"] = dl.prefetch_factor
    if dl.max_tokens_per_batch is not None:
        kwargs["batch_sampler"] = _budget_sampler(
            dataset, cfg, dp_size=dp_size, dp_rank=dp_rank, seed=seed, mix=mix
        )
    else:
        per_step = micro_batch_size * dp_size
        if dl.drop_last and len(dataset) < per_step:
            raise ConfigError(
                f"data: the dataset has {len(dataset)} samples, fewer than one global micro-batch "
                f"(training.micro_batch_size {micro_batch_size} x {dp_size} data-parallel ranks)"
            )
        kwargs["sampler"] = GlobalOrderSampler(
            len(dataset),
            dp_size=dp_size,
            dp_rank=dp_rank,
            micro_batch_size=micro_batch_size,
            shuffle=dl.shuffle,
            seed=seed,
            drop_last=dl.drop_last,
            mixing=_mixing(dataset, cfg.dataset_param.dataset_type, mix),
        )
        kwargs.update(batch_size=micro_batch_size, drop_last=dl.drop_last)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return StatefulDataLoader(
        dataset,
        num_workers=dl.num_workers,
        collate_fn=collate_fn,
        pin_memory=dl.pin_memory and torch.accelerator.is_available(),  # cuda or npu; no-op on cpu
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
        sampler = loader.batch_sampler
        if not isinstance(sampler, TokenBudgetBatchSampler):
            sampler = loader.sampler
        if not isinstance(sampler, (GlobalOrderSampler, TokenBudgetBatchSampler)):
            raise TypeError(
                "EpochIterator needs a loader from build_dataloader (a GlobalOrderSampler or a "
                "TokenBudgetBatchSampler)"
            )
        self.sampler: EpochSampler = sampler
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch consumed by training
        self._it: Iterator[dict[str, Any]] | None = None
        self._yielded = 0  # micro-batches this iterator has returned
        self._uncounted = 0  # global samples consumed since the last take_samples_consumed()

    def _position(self) -> int:
        """The global position after the micro-batches this iterator returned (asked of the sampler: exact
        for fixed and for token-budget batches)."""
        return self.sampler.position_after(self._yielded)

    def take_samples_consumed(self) -> int:
        """Global samples (positions of the epochs' orders, all ranks together) consumed since the last call,
        across epoch ends; the count restarts at 0. The same on every rank."""
        taken, self._uncounted = self._uncounted, 0
        return taken

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._it is None:
                self.sampler.set_position(self.epoch, self.consumed)
                set_epoch = getattr(self.loader.dataset, "set_epoch", None)
                if callable(set_epoch):  # before the iterator starts its workers (a copy of the dataset each)
                    set_epoch(self.epoch)
                if self.loader.generator is not None:
                    self.loader.generator.manual_seed(self.sampler.seed * 1_000_003 + self.epoch)
                self._yielded = 0
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.consumed = 0
                continue
            self._yielded += 1
            position = self._position()
            self._uncounted += position - self.consumed
            self.consumed = position
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
