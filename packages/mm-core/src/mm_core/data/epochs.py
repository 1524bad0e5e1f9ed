"""``training.train_epochs``: a run's length in passes over the training data, turned into optimizer steps.

The count comes from the loader the run reads: each epoch's micro-batches per data-parallel rank (fixed-size
micro-batches: ``samples // (micro_batch_size x dp)`` with ``drop_last``, else rounded up; token-budget
batches: that epoch's own plan, which depends on the epoch's order), summed over the epochs (a fraction of
the last one included), then divided by ``gradient_accumulation_steps`` and rounded up. The data position
carries over epoch ends (a step may hold the last micro-batches of one epoch and the first of the next), so
the run ends when that many micro-batches have been read. The count is a function of the dataset, the batch
settings and the data-parallel size: a resumed run with the same ones computes the same steps.
"""

from __future__ import annotations

import math

from torchdata.stateful_dataloader import StatefulDataLoader

from mm_core.data.sampling import GlobalOrderSampler, TokenBudgetBatchSampler
from mm_core.errors import ConfigError


def micro_batches_in_epoch(loader: StatefulDataLoader, epoch: int) -> int:
    """Micro-batches one data-parallel rank reads in epoch ``epoch`` of ``loader`` (from its start)."""
    sampler = loader.batch_sampler
    if not isinstance(sampler, TokenBudgetBatchSampler):
        sampler = loader.sampler
    if not isinstance(sampler, (GlobalOrderSampler, TokenBudgetBatchSampler)):
        raise TypeError("micro_batches_in_epoch needs a loader from mm_core.data.build_dataloader")
    epoch_before, start_before = sampler.epoch, sampler.start
    sampler.set_position(epoch, 0)
    try:
        if isinstance(sampler, TokenBudgetBatchSampler):
            return len(sampler)
        per_rank = len(sampler)
        mbs = sampler.micro_batch_size
        return per_rank // mbs if loader.drop_last else math.ceil(per_rank / mbs)
    finally:
        sampler.set_position(epoch_before, start_before)


def iters_for_epochs(loader: StatefulDataLoader, epochs: float, grad_accum: int) -> tuple[int, str]:
    """The optimizer steps of ``epochs`` passes over ``loader``'s data, and a line that says how they were
    counted (for the run's log)."""
    whole = math.floor(epochs)
    counts = [micro_batches_in_epoch(loader, e) for e in range(math.ceil(epochs))]
    if not counts or counts[0] == 0:
        raise ConfigError(
            "training.train_epochs: an epoch of this dataset holds no micro-batch per rank; use fewer "
            "data-parallel ranks, a smaller training.micro_batch_size or "
            "data.dataloader_param.drop_last: false"
        )
    micro = sum(counts[:whole])
    if epochs > whole:
        micro += math.ceil((epochs - whole) * counts[whole])
    iters = max(1, math.ceil(micro / grad_accum))
    per_epoch = f"{counts[0]}" if len(set(counts)) == 1 else f"{min(counts)} to {max(counts)} (token budget)"
    note = (
        f"training.train_epochs: {epochs:g} -> train_iters {iters} ({per_epoch} micro-batches per rank and "
        f"epoch, {micro} in all, {grad_accum} per step)"
    )
    return iters, note
