"""Which samples every data-parallel rank reads: one global order per epoch, the same on every rank.

**Global order.** Epoch ``e`` has a global order of the dataset's indices, seeded by ``(seed, e)``: a
``randperm(seed + e)`` with shuffling, the identity without. It is kept as an int64 tensor (8 bytes per
sample). Training consumes it from a global *position* (samples of the order consumed), so a position saved
on one data-parallel size means the same thing on any other: a resume neither repeats nor skips a sample.

**Weighted mixing.** A dataset MAY expose

- ``source_sizes: Sequence[int]`` — samples per source, in index order: source 0 owns indices ``[0, n0)``,
  source 1 the next ``n1``, ... (a source is one entry of ``basic_parameters.dataset``);
- ``source_weights: Sequence[float] | None`` — the mixing weights from ``basic_parameters.weights``
  (read with :func:`mm_core.data.params.optional_weights`, checked with
  :func:`mm_core.data.params.check_weights`); None means no mixing.

With weights, an epoch still has ``N = sum(source_sizes)`` samples, of which source ``s`` gets
``c_s = N * w_s / sum(w)`` rounded by largest remainder (:func:`largest_remainder`). Source ``s`` draws from
an endless stream that cycles through permutations of its own indices (cycle ``k`` seeded by
``(seed, s, k)``; identity cycles without shuffling); epoch ``e`` takes stream positions
``[e * c_s, (e + 1) * c_s)``, so a down-sampled source shows other samples in the next epoch and an
up-sampled one repeats a sample only after a whole cycle. The draws are concatenated and permuted by the
epoch's ``randperm(seed + e)`` with shuffling, or merged by fractional position ``(i + 0.5) / c_s`` without.

**Token budget.** With ``data.dataloader_param.max_tokens_per_batch`` the dataset provides
``sample_lengths()`` (tokens per sample as the collator sees them). The epoch's order is then re-sorted by
length, stably, inside each consecutive window of ``dynamic_batch_buffer`` samples, and each global
micro-batch is cut greedily: rank 0 takes consecutive samples while ``count * longest <= budget``, rank 1
continues from there, and so on (:class:`TokenBudgetBatchSampler`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Sampler

from mm_core.data.params import BASIC, check_weights
from mm_core.errors import ConfigError

BUDGET_KEY = "data.dataloader_param.max_tokens_per_batch"
_CHUNK = 4096  # indices turned into Python ints at a time while iterating


# ---------------------------------------------------------------------------------------------- mixing
@dataclass(frozen=True)
class SourceMixing:
    """Samples per source (in index order) and their mixing weights (one per source, all > 0)."""

    sizes: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.weights) or not self.sizes:
            raise ValueError(f"{len(self.sizes)} source sizes but {len(self.weights)} weights")
        if min(self.sizes) < 1 or not min(self.weights) > 0:
            raise ValueError(f"every source needs a sample and a weight > 0: {self.sizes}, {self.weights}")


def source_mixing(dataset: Any, dataset_type: str = "") -> SourceMixing | None:
    """The mixing a dataset asks for through ``source_sizes``/``source_weights``, or None (no weights).

    Raises ConfigError when the sizes do not add up to ``len(dataset)``, when the weights do not match the
    sources (naming ``basic_parameters.weights``), or when a source with a weight has no sample."""
    weights = getattr(dataset, "source_weights", None)
    if weights is None:
        return None
    where = f"data.dataset_param.dataset_type: {dataset_type or type(dataset).__name__!r}"
    sizes = getattr(dataset, "source_sizes", None)
    if sizes is None:
        raise ConfigError(
            f"{where} gives source_weights but no source_sizes, so {BASIC}.weights cannot apply"
        )
    if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in sizes):
        raise ConfigError(f"{where}: source_sizes {list(sizes)!r} must be non-negative integers")
    sizes = tuple(int(n) for n in sizes)
    if sum(sizes) != len(dataset):
        raise ConfigError(
            f"{where}: source_sizes {list(sizes)} add up to {sum(sizes)}, but the dataset has {len(dataset)}"
        )
    checked = check_weights(weights, len(sizes), f"{BASIC}.weights")
    assert checked is not None  # weights is not None
    for s, n in enumerate(sizes):
        if n == 0:
            raise ConfigError(
                f"{BASIC}.weights[{s}]: dataset entry {s} has no sample, so it cannot be drawn with weight "
                f"{checked[s]}; remove the entry or give it data"
            )
    return SourceMixing(sizes, tuple(checked))


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (exact rationals), floors first, then one more to each of
    the largest remainders (ties to the lower index); the counts add up to ``total``."""
    exact = [Fraction(w) for w in weights]
    whole = sum(exact)
    quotas = [total * w / whole for w in exact]
    counts = [int(q) for q in quotas]  # floor: the quotas are non-negative
    by_remainder = sorted(range(len(quotas)), key=lambda s: (-(quotas[s] - counts[s]), s))
    for s in by_remainder[: total - sum(counts)]:
        counts[s] += 1
    return counts


def _cycle_seed(seed: int, source: int, cycle: int) -> int:
    """A 63-bit seed for cycle ``cycle`` of source ``source`` (the same on every platform)."""
    digest = hashlib.sha256(f"mm-mix:{seed}:{source}:{cycle}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _source_draws(
    size: int, count: int, *, source: int, epoch: int, seed: int, shuffle: bool
) -> torch.Tensor:
    """Positions ``[epoch * count, (epoch + 1) * count)`` of source ``source``'s endless stream of cycles."""
    lo, hi = epoch * count, (epoch + 1) * count
    parts: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)]
    for cycle in range(lo // size, -(-hi // size)):
        if shuffle:
            g = torch.Generator()
            g.manual_seed(_cycle_seed(seed, source, cycle))
            perm = torch.randperm(size, generator=g)
        else:
            perm = torch.arange(size, dtype=torch.int64)
        start = cycle * size
        parts.append(perm[max(lo - start, 0) : min(hi - start, size)])
    return torch.cat(parts)


def mixed_order(mixing: SourceMixing, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Epoch ``epoch``'s global order under weighted mixing (module docstring), as dataset indices."""
    total = sum(mixing.sizes)
    counts = largest_remainder(total, mixing.weights)
    offsets = np.cumsum((0, *mixing.sizes[:-1])).tolist()
    draws, keys = [], []
    for s, (size, count, offset) in enumerate(zip(mixing.sizes, counts, offsets)):
        draws.append(_source_draws(size, count, source=s, epoch=epoch, seed=seed, shuffle=shuffle) + offset)
        keys.append((torch.arange(count, dtype=torch.float64) + 0.5) / max(count, 1))
    order = torch.cat(draws)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return order[torch.randperm(total, generator=g)]
    return order[torch.sort(torch.cat(keys), stable=True).indices]  # ties: the lower source first


class EpochOrder:
    """The global order of each epoch (module docstring); the last epoch asked for is cached."""

    def __init__(
        self, num_samples: int, *, seed: int, shuffle: bool, mixing: SourceMixing | None = None
    ) -> None:
        if mixing is not None and sum(mixing.sizes) != num_samples:
            raise ValueError(f"source sizes add up to {sum(mixing.sizes)}, not to the {num_samples} samples")
        self.num_samples, self.seed, self.shuffle, self.mixing = num_samples, seed, shuffle, mixing
        self._cached: tuple[int, torch.Tensor] | None = None

    def __call__(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._build(epoch))
        return self._cached[1]

    def _build(self, epoch: int) -> torch.Tensor:
        if self.mixing is not None:
            return mixed_order(self.mixing, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(self.num_samples, generator=g)
        return torch.arange(self.num_samples, dtype=torch.int64)


def _iter_indices(indices: torch.Tensor) -> Iterator[int]:
    for lo in range(0, len(indices), _CHUNK):
        yield from indices[lo : lo + _CHUNK].tolist()


# ------------------------------------------------------------------------------------- fixed batches
class GlobalOrderSampler(Sampler[int]):
    """This data-parallel rank's share of one epoch, read from the epoch's global order from a position.

    Starting at global position ``start``, rank ``r`` of ``dp_size`` takes every ``dp_size``-th index from
    ``r``, so after ``k`` global micro-batches of ``micro_batch_size`` per rank exactly the first
    ``start + k * micro_batch_size * dp_size`` samples of the order are consumed, whatever ``dp_size`` is.
    That is what makes the position resharding-safe: a run saved on 2 ranks resumes on 1 or 4 with no
    sample of the epoch seen twice and none skipped. With ``drop_last`` the rest is cut to whole global
    micro-batches; without it the order is padded by wrapping to a multiple of ``dp_size``."""

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
        mixing: SourceMixing | None = None,
    ) -> None:
        self.num_samples, self.dp_size, self.dp_rank = num_samples, dp_size, dp_rank
        self.micro_batch_size, self.shuffle = micro_batch_size, shuffle
        self.seed, self.drop_last = seed, drop_last
        self.order = EpochOrder(num_samples, seed=seed, shuffle=shuffle, mixing=mixing)
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Read epoch ``epoch`` from global position ``start`` (samples of that epoch already consumed)."""
        self.epoch, self.start = epoch, start

    def global_order(self) -> torch.Tensor:
        """Every sample index of the current epoch, in the order all ranks together consume them."""
        return self.order(self.epoch)

    def position_after(self, batches: int) -> int:
        """The global position once every rank has read ``batches`` micro-batches from ``start``."""
        return self.start + min(batches * self.micro_batch_size * self.dp_size, len(self) * self.dp_size)

    def _remaining(self) -> torch.Tensor:
        rest = self.global_order()[self.start :]
        if self.drop_last:
            per_step = self.dp_size * self.micro_batch_size
            return rest[: len(rest) // per_step * per_step]
        pad = -len(rest) % self.dp_size
        if len(rest) and pad:
            rest = torch.cat([rest, rest[torch.arange(pad) % len(rest)]])
        return rest

    def __iter__(self) -> Iterator[int]:
        return _iter_indices(self._remaining()[self.dp_rank :: self.dp_size])

    def __len__(self) -> int:
        """``len(self._remaining()) // dp_size``, counted without building it."""
        rest = max(self.num_samples - self.start, 0)
        if self.drop_last:
            return rest // (self.dp_size * self.micro_batch_size) * self.micro_batch_size
        return -(-rest // self.dp_size)


# ------------------------------------------------------------------------------------ token budget
def sort_windows(
    order: torch.Tensor, lengths: torch.Tensor, window: int, buckets: torch.Tensor | None = None
) -> torch.Tensor:
    """``order`` with each consecutive ``window`` of it stably sorted by ``lengths[index]`` (ascending), then
    by ``buckets[index]`` when given (so the samples of one length and bucket are adjacent)."""
    if window <= 1 or len(order) <= 1:
        return order
    keyed = lengths[order]
    if buckets is not None:
        keyed = keyed * (int(buckets.max()) + 1) + buckets[order]
    key = torch.arange(len(order), dtype=torch.int64) // window * (int(keyed.max()) + 1) + keyed
    return order[torch.sort(key, stable=True).indices]


def bucket_run_ends(buckets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """For each position, the end of the run of equal values it belongs to (``buckets`` in batch order)."""
    n = len(buckets)
    ends = np.append(np.flatnonzero(np.diff(buckets)) + 1, n).astype(np.int64)
    return ends[np.searchsorted(ends, np.arange(n), side="right")]


def _fit(lengths: npt.NDArray[np.int64], lo: int, budget: int, packed: bool = False) -> int:
    """How many samples from ``lo`` make one micro-batch: the longest run with ``count * longest <= budget``
    (``sum of lengths <= budget`` when ``packed``; ``lengths[lo] <= budget``). The window doubles, so a batch
    of ``m`` samples costs ``O(m)``."""
    # every sample has at least 1 token; count * longest also bounds count by budget // lengths[lo]
    cap = min(budget if packed else budget // int(lengths[lo]), len(lengths) - lo)
    width = min(cap, 64)
    while True:
        run = lengths[lo : lo + width]
        cost = np.cumsum(run) if packed else np.arange(1, width + 1) * np.maximum.accumulate(run)
        fits = int(np.count_nonzero(cost <= budget))  # cost strictly increases: the fitting ones lead
        if fits < width or width == cap:
            return fits
        width = min(2 * width, cap)


@dataclass(frozen=True)
class BatchPlan:
    """Every rank's micro-batches from one start: rank ``r``'s ``j``-th reads positions
    ``[lo[j, r], hi[j, r])`` of the epoch's order (positions past its end wrap around to its beginning);
    ``after[k]`` is the global position after ``k`` global micro-batches."""

    lo: npt.NDArray[np.int64]
    hi: npt.NDArray[np.int64]
    after: npt.NDArray[np.int64]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches under a token budget (``data.dataloader_param.max_tokens_per_batch``).

    The epoch's global order (mixed when the dataset asks for it) is sorted by length, stably, inside each
    consecutive window of ``buffer`` samples. From global position ``start``, global micro-batch ``j`` is cut
    greedily: rank 0 takes consecutive samples while ``count * max(length) <= max_tokens`` (at least one),
    then rank 1 continues from where rank 0 stopped, ..., rank ``dp_size - 1``. Every rank computes the whole
    plan (the lengths are known everywhere), so the position after ``k`` global micro-batches — the start of
    micro-batch ``k`` — is exact and the same on every rank, and a resume on another ``dp_size`` neither
    repeats nor skips a sample. At the end of the epoch a global micro-batch that cannot give every rank a
    sample is dropped with ``drop_last``; without it each rank left empty reads one sample from the start of
    the epoch's order (wrapping). ``training.micro_batch_size`` plays no part.

    With ``buckets`` (one integer per sample, from the dataset's ``sample_buckets()``: e.g. the latent shape
    of a video clip) a micro-batch never holds two buckets: the windows are sorted by length, then bucket,
    and a cut also ends where the bucket changes.

    With ``packed`` (``data.dataloader_param.packing``) a micro-batch takes samples while the sum of their
    lengths is at most ``max_tokens``: the collator concatenates them into one row."""

    def __init__(
        self,
        lengths: npt.NDArray[np.integer[Any]],
        *,
        dp_size: int,
        dp_rank: int,
        max_tokens: int,
        buffer: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        mixing: SourceMixing | None = None,
        buckets: npt.NDArray[np.integer[Any]] | None = None,
        packed: bool = False,
    ) -> None:
        self.packed = packed
        self.lengths = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
        self.buckets = None if buckets is None else torch.as_tensor(np.asarray(buckets, dtype=np.int64))
        if self.buckets is not None and self.buckets.shape != self.lengths.shape:
            raise ValueError(f"{len(self.buckets)} buckets for {len(self.lengths)} samples")
        self.num_samples = len(self.lengths)
        if self.num_samples and int(self.lengths.min()) < 1:
            raise ValueError("every sample length must be at least 1 token")
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.max_tokens, self.buffer = max_tokens, buffer
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.order = EpochOrder(self.num_samples, seed=seed, shuffle=shuffle, mixing=mixing)
        self.epoch = 0
        self.start = 0
        self._sorted: tuple[int, torch.Tensor] | None = None
        self._plan: tuple[int, int, BatchPlan] | None = None

    def set_position(self, epoch: int, start: int) -> None:
        """Read epoch ``epoch`` from global position ``start`` (samples of that epoch already consumed)."""
        self.epoch, self.start = epoch, start

    def global_order(self) -> torch.Tensor:
        """The current epoch's effective order: the global order, sorted by length inside each window."""
        if self._sorted is None or self._sorted[0] != self.epoch:
            order = sort_windows(self.order(self.epoch), self.lengths, self.buffer, self.buckets)
            self._sorted = (self.epoch, order)
        return self._sorted[1]

    def plan(self) -> BatchPlan:
        """The micro-batches of every rank from the current position to the end of the epoch."""
        if self._plan is None or self._plan[:2] != (self.epoch, self.start):
            self._plan = (self.epoch, self.start, self._build_plan())
        return self._plan[2]

    def _build_plan(self) -> BatchPlan:
        order = self.global_order()
        lengths = self.lengths[order].numpy()
        n, dp = self.num_samples, self.dp_size
        # where each position's bucket run ends (a micro-batch stops there); the end of the order without
        run_end = bucket_run_ends(self.buckets[order].numpy()) if self.buckets is not None else None
        lo: list[int] = []
        hi: list[int] = []
        after = [self.start]
        pos = self.start
        while pos < n:
            cuts = [pos]
            while len(cuts) <= dp and pos < n:
                if lengths[pos] > self.max_tokens:
                    raise ConfigError(
                        f"{BUDGET_KEY}: sample {int(order[pos])} has {int(lengths[pos])} tokens, more than "
                        f"the budget of {self.max_tokens}; raise {BUDGET_KEY} to at least {int(lengths[pos])}"
                    )
                cut = lengths if run_end is None else lengths[: run_end[pos]]
                pos += _fit(cut, pos, self.max_tokens, self.packed)
                cuts.append(pos)
            missing = dp + 1 - len(cuts)
            if missing and self.drop_last:
                break
            lo += cuts[:-1]
            hi += cuts[1:]
            for w in range(missing):  # the last global micro-batch: empty ranks wrap to the epoch's start
                lo.append(n + w)
                hi.append(n + w + 1)
            after.append(pos)
        shape = (len(after) - 1, dp)
        return BatchPlan(
            np.array(lo, dtype=np.int64).reshape(shape),
            np.array(hi, dtype=np.int64).reshape(shape),
            np.array(after, dtype=np.int64),
        )

    def position_after(self, batches: int) -> int:
        """The global position once every rank has read ``batches`` micro-batches from ``start``."""
        after = self.plan().after
        return int(after[min(batches, len(after) - 1)])

    def __iter__(self) -> Iterator[list[int]]:
        order, plan = self.global_order(), self.plan()
        for lo, hi in zip(plan.lo[:, self.dp_rank].tolist(), plan.hi[:, self.dp_rank].tolist()):
            if hi <= self.num_samples:
                yield order[lo:hi].tolist()
            else:
                yield order[(torch.arange(lo, hi) - self.num_samples) % self.num_samples].tolist()

    def __len__(self) -> int:
        return len(self.plan().after) - 1
