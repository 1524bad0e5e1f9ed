"""``training.train_epochs``: epochs -> optimizer steps from the loader the run reads (fixed micro-batches on
any data-parallel rank count, ``drop_last`` or not, fractions of an epoch, gradient accumulation, token-budget
batches whose count changes with each epoch's order)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from mm_core.config.schema import DataConfig
from mm_core.data import EpochIterator, build_dataloader
from mm_core.data.epochs import iters_for_epochs, micro_batches_in_epoch


class Toy:
    """``n`` samples of lengths 1..9 (for token budgets)."""

    def __init__(self, n: int) -> None:
        self.lengths = np.array([1 + (7 * i) % 9 for i in range(n)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([i])}

    def sample_lengths(self) -> np.ndarray:
        return self.lengths


def loader(n: int, *, mbs: int = 2, dp: int = 2, rank: int = 0, **dl: Any) -> Any:
    cfg = DataConfig.model_validate({"dataset_param": {"dataset_type": "toy"}, "dataloader_param": dl})
    return build_dataloader(Toy(n), lambda s: s, cfg, micro_batch_size=mbs, dp_size=dp, dp_rank=rank, seed=3)


@pytest.mark.parametrize(
    ("n", "dp", "drop_last", "per_epoch"),
    [(10, 2, True, 2), (11, 2, True, 2), (10, 1, True, 5), (11, 2, False, 3), (9, 4, False, 2)],
)
def test_micro_batches_per_epoch(n: int, dp: int, drop_last: bool, per_epoch: int) -> None:
    ld = loader(n, dp=dp, drop_last=drop_last)
    assert micro_batches_in_epoch(ld, 0) == per_epoch
    # what the run then reads: every rank takes that many micro-batches in the epoch
    for rank in range(dp):
        assert len(list(loader(n, dp=dp, rank=rank, drop_last=drop_last))) == per_epoch


@pytest.mark.parametrize(
    ("epochs", "accum", "iters"),
    [(1, 1, 2), (2.5, 2, 3), (3, 2, 3), (0.01, 1, 1), (0.5, 1, 1), (1.5, 1, 3)],
)
def test_epochs_to_iters(epochs: float, accum: int, iters: int) -> None:
    got, note = iters_for_epochs(loader(10), epochs, accum)  # 2 micro-batches per rank and epoch
    assert got == iters
    assert note.startswith(f"training.train_epochs: {epochs:g} -> train_iters {iters} (2 micro-batches")


def test_the_run_reads_exactly_the_epochs() -> None:
    """The steps of 2 epochs read every sample of both epochs once (the data position carries over)."""
    ld = loader(12, mbs=3, dp=1)
    iters, _ = iters_for_epochs(ld, 2, 2)
    it = EpochIterator(ld)
    seen = [int(x["x"]) for _ in range(iters * 2) for x in next(it)]
    assert iters == 4 and sorted(seen) == sorted(list(range(12)) * 2)
    assert (it.epoch, it.consumed) == (1, 12)


def test_token_budget_counts_each_epoch() -> None:
    ld = loader(40, dp=2, max_tokens_per_batch=12, dynamic_batch_buffer=1)
    counts = [micro_batches_in_epoch(ld, e) for e in range(3)]
    iters, note = iters_for_epochs(ld, 3, 1)
    assert iters == sum(counts)
    assert ld.batch_sampler.epoch == 0  # the loader is left where it was
    if len(set(counts)) > 1:
        assert "(token budget)" in note
    whole = iters_for_epochs(ld, 2.5, 2)[0]
    assert whole == math.ceil((counts[0] + counts[1] + math.ceil(0.5 * counts[2])) / 2)
