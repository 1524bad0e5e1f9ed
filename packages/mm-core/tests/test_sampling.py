"""mm_core.data.sampling in one process: weighted mixing of sources, the length-sorted windows and the
token-budget plan (budget, positions, drop_last, padding, errors), and the mixing keys of
mm_core.data.params."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from mm_core.data import (
    GlobalOrderSampler,
    SourceMixing,
    TokenBudgetBatchSampler,
    largest_remainder,
    mixed_order,
)
from mm_core.data.params import BASIC, check_weights, optional_weights, read_params
from mm_core.data.sampling import sort_windows, source_mixing
from mm_core.errors import ConfigError

SIZES = (6, 20, 4)  # source 0: indices 0..5, source 1: 6..25, source 2: 26..29
OFFSETS = (0, 6, 26)


def _source_of(index: int) -> int:
    return max(s for s, off in enumerate(OFFSETS) if index >= off)


def _per_source(order: torch.Tensor) -> list[list[int]]:
    """The indices of ``order`` drawn from each source, local to the source, in order of appearance."""
    out: list[list[int]] = [[] for _ in SIZES]
    for i in order.tolist():
        s = _source_of(i)
        out[s].append(i - OFFSETS[s])
    return out


# ---------------------------------------------------------------------------------------------- mixing
def test_largest_remainder_shares_add_up_and_follow_the_weights():
    assert largest_remainder(30, [1, 1, 1]) == [10, 10, 10]
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]  # one left over: the tie goes to the lower index
    assert largest_remainder(30, [0.5, 0.25, 0.25]) == [15, 8, 7]
    assert largest_remainder(7, [3.0, 1.0]) == [5, 2]  # 5.25 / 1.75: the larger remainder gets the extra
    for total, weights in [(997, [0.1, 0.7, 0.2]), (13, [2.5, 1e-3, 9.0]), (1, [1, 1])]:
        counts = largest_remainder(total, weights)
        assert sum(counts) == total
        for c, w in zip(counts, weights):
            assert abs(c - total * w / sum(weights)) < 1


@pytest.mark.parametrize("shuffle", [True, False])
def test_mixed_order_counts_per_source_are_the_largest_remainder_shares(shuffle):
    mixing = SourceMixing(SIZES, (1.0, 1.0, 3.0))
    expected = largest_remainder(sum(SIZES), mixing.weights)
    assert expected == [6, 6, 18]
    for epoch in range(3):
        order = mixed_order(mixing, seed=5, epoch=epoch, shuffle=shuffle)
        assert order.dtype == torch.int64 and len(order) == sum(SIZES)
        assert [len(d) for d in _per_source(order)] == expected


def test_mixed_order_is_deterministic_in_seed_and_epoch():
    mixing = SourceMixing(SIZES, (2.0, 1.0, 1.0))
    a = mixed_order(mixing, seed=3, epoch=1, shuffle=True)
    assert torch.equal(a, mixed_order(mixing, seed=3, epoch=1, shuffle=True))
    assert not torch.equal(a, mixed_order(mixing, seed=4, epoch=1, shuffle=True))
    assert not torch.equal(a, mixed_order(mixing, seed=3, epoch=2, shuffle=True))
    # without shuffling the order depends on nothing random
    assert torch.equal(
        mixed_order(mixing, seed=3, epoch=1, shuffle=False),
        mixed_order(mixing, seed=9, epoch=1, shuffle=False),
    )


@pytest.mark.parametrize("shuffle", [True, False])
def test_downsampled_source_shows_new_samples_each_epoch_and_upsampled_repeats_only_per_cycle(shuffle):
    mixing = SourceMixing(SIZES, (4.0, 1.0, 1.0))  # shares 20, 5, 5 of 30: source 0 up, source 1 down
    counts = largest_remainder(sum(SIZES), mixing.weights)
    assert counts == [20, 5, 5]
    epochs = [_per_source(mixed_order(mixing, seed=1, epoch=e, shuffle=shuffle)) for e in range(8)]
    for s, size in enumerate(SIZES):
        seen: Counter[int] = Counter()
        for e in range(8):
            seen.update(epochs[e][s])
            # a sample is drawn again only once every sample of its source has been: counts differ by <= 1
            times = [seen[i] for i in range(size)]
            assert sum(times) == (e + 1) * counts[s] and max(times) - min(times) <= 1, (s, e, times)
    # source 1 (20 samples, 5 per epoch): 4 epochs show all 20, each epoch other ones
    assert sorted(sum((epochs[e][1] for e in range(4)), [])) == list(range(20))
    if shuffle:  # the next cycle is another permutation: epoch 4 does not replay epoch 0's samples
        assert sorted(epochs[4][1]) != sorted(epochs[0][1])
    else:  # identity cycles, and the interleave merges the sources in a fixed pattern
        assert [epochs[e][1] for e in (0, 1, 4)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]
        first = mixed_order(mixing, seed=1, epoch=0, shuffle=False).tolist()
        assert [_source_of(i) for i in first[:6]] == [0, 0, 1, 2, 0, 0]  # by (i + 0.5) / c_s


def test_no_weights_keeps_the_plain_order():
    s = GlobalOrderSampler(30, dp_size=1, dp_rank=0, micro_batch_size=2, shuffle=True, seed=7, drop_last=True)
    g = torch.Generator()
    g.manual_seed(7 + 2)
    s.set_position(2, 0)
    assert torch.equal(s.global_order(), torch.randperm(30, generator=g))
    s = GlobalOrderSampler(
        30, dp_size=1, dp_rank=0, micro_batch_size=2, shuffle=False, seed=7, drop_last=True
    )
    assert s.global_order().tolist() == list(range(30))
    assert s.global_order().dtype == torch.int64


class _Sources:
    def __init__(self, sizes, weights):
        self.source_sizes, self.source_weights = sizes, weights

    def __len__(self):
        return sum(self.source_sizes)


class _Longer(_Sources):
    def __len__(self):
        return sum(self.source_sizes) + 2


def test_source_mixing_reads_and_checks_the_protocol():
    assert source_mixing(_Sources([3, 4], None)) is None
    assert source_mixing(_Sources([3, 4], [1, 3])) == SourceMixing((3, 4), (1.0, 3.0))
    with pytest.raises(ConfigError, match=r"basic_parameters\.weights: got 3 weights for 2 dataset entries"):
        source_mixing(_Sources([3, 4], [1, 1, 1]))
    with pytest.raises(ConfigError, match=r"basic_parameters\.weights\[1\]: got 0; expected a finite number"):
        source_mixing(_Sources([3, 4], [1, 0]))
    with pytest.raises(ConfigError, match=r"basic_parameters\.weights\[0\]: dataset entry 0 has no sample"):
        source_mixing(_Sources([0, 4], [1, 1]))
    with pytest.raises(ConfigError, match=r"source_sizes \[3, 4\] add up to 7, but the dataset has 9"):
        source_mixing(_Longer([3, 4], [1, 1]))
    no_sizes = _Sources([3, 4], [1, 1])
    no_sizes.source_sizes = None
    with pytest.raises(ConfigError, match=r"gives source_weights but no source_sizes"):
        source_mixing(no_sizes)


def test_weights_field_and_check():
    fields = {"weights": optional_weights()}
    assert read_params({}, fields, BASIC) == {"weights": None}
    assert read_params({"weights": [0.5, 2]}, fields, BASIC) == {"weights": [0.5, 2]}
    for bad in ([], [1, -1], [1, float("nan")], [True], "1,2", 3):
        with pytest.raises(
            ConfigError, match=r"basic_parameters\.weights: got .*; expected a list of positive"
        ):
            read_params({"weights": bad}, fields, BASIC)
    key = f"{BASIC}.weights"
    assert check_weights(None, 3, key) is None
    assert check_weights([1, 2.5], 2, key) == [1.0, 2.5]
    with pytest.raises(
        ConfigError, match=r"^data\.dataset_param\.basic_parameters\.weights: got 1 weights for 2"
    ):
        check_weights([1], 2, key)
    for bad in (float("inf"), -2.0, 0, "1"):
        with pytest.raises(
            ConfigError, match=r"basic_parameters\.weights\[1\]: got .*; expected a finite number"
        ):
            check_weights([1, bad], 2, key)


# ---------------------------------------------------------------------------------------- token budget
LENGTHS = np.random.default_rng(0).integers(1, 30, size=97)


def _samplers(dp: int, budget: int = 64, *, drop_last: bool = True, buffer: int = 16, lengths=LENGTHS):
    return [
        TokenBudgetBatchSampler(
            lengths,
            dp_size=dp,
            dp_rank=r,
            max_tokens=budget,
            buffer=buffer,
            shuffle=True,
            seed=2,
            drop_last=drop_last,
        )
        for r in range(dp)
    ]


def _global_batches(samplers, epoch: int = 0, start: int = 0) -> list[list[list[int]]]:
    """Every global micro-batch from ``start``: the list of each rank's micro-batch."""
    for s in samplers:
        s.set_position(epoch, start)
    return [list(step) for step in zip(*(list(s) for s in samplers))]


def test_sort_windows_sorts_stably_inside_each_window_only():
    order = torch.tensor([4, 0, 3, 1, 2, 5, 6])
    lengths = torch.tensor([5, 1, 5, 2, 9, 1, 3])
    assert sort_windows(order, lengths, 3).tolist() == [3, 0, 4, 1, 5, 2, 6]  # 1 and 5 tie: order kept
    assert sort_windows(order, lengths, 1).tolist() == order.tolist()
    whole = sorted(order.tolist(), key=lambda i: int(lengths[i]))  # Python's sort is stable too
    assert sort_windows(order, lengths, 100).tolist() == whole


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_every_micro_batch_fits_the_budget_and_every_position_is_read_once(dp):
    samplers = _samplers(dp, drop_last=False)
    steps = _global_batches(samplers)
    order = samplers[0].global_order().tolist()
    flat: list[int] = []
    for step in steps:
        assert len(step) == dp and all(len(b) >= 1 for b in step)
        for batch in step:
            assert len(batch) * max(int(LENGTHS[i]) for i in batch) <= 64
        flat += [i for batch in step for i in batch]
    assert flat[: len(order)] == order  # ranks in order, then the next global micro-batch: the global order
    assert len(flat) - len(order) < dp  # only the padding of the last global micro-batch is extra
    # greedy: a micro-batch stops only where the next sample would break the budget (or the epoch ends)
    for step in steps[:-1]:
        for batch in step:
            pos = order.index(batch[-1]) + 1
            longest = max(int(LENGTHS[i]) for i in batch + [order[pos]])
            assert (len(batch) + 1) * longest > 64


def test_windows_are_sorted_by_length_and_aligned_to_the_epoch_order():
    s = _samplers(1, buffer=16)[0]
    raw, effective = s.order(0), s.global_order()
    for lo in range(0, len(raw), 16):
        window = effective[lo : lo + 16]
        assert sorted(window.tolist()) == sorted(raw[lo : lo + 16].tolist())
        assert torch.all(torch.diff(torch.as_tensor(LENGTHS)[window]) >= 0)


@pytest.mark.parametrize("new_dp", [1, 2, 4])
def test_resume_on_another_dp_size_reads_on_exactly_where_the_first_stopped(new_dp):
    first = _samplers(2)
    steps = _global_batches(first)
    k = len(steps) // 2
    position = first[0].position_after(k)
    assert all(s.position_after(k) == position for s in first)  # the same on every rank
    head = [i for step in steps[:k] for b in step for i in b]
    assert position == len(head)
    resumed = _samplers(new_dp)
    tail = [i for step in _global_batches(resumed, start=position) for b in step for i in b]
    seen = head + tail
    assert len(seen) == len(set(seen)), "a sample was read twice"
    order = first[0].global_order().tolist()
    assert seen == order[: len(seen)]  # nothing skipped: the global order, read on from the saved position
    assert len(order) - len(seen) < 4 * new_dp  # at most the dropped last global micro-batch is left


def test_drop_last_drops_a_global_micro_batch_that_cannot_feed_every_rank():
    lengths = np.array([8] * 9)  # budget 16: two samples per micro-batch
    steps = _global_batches(_samplers(2, 16, lengths=lengths, buffer=1))
    assert [[len(b) for b in step] for step in steps] == [[2, 2], [2, 2]]  # the 9th sample alone is dropped
    plan = _samplers(2, 16, lengths=lengths, buffer=1)[0].plan()
    assert plan.after.tolist() == [0, 4, 8]
    lengths = np.array([8] * 11)  # the last global micro-batch: [2, 1] still feeds both ranks
    steps = _global_batches(_samplers(2, 16, lengths=lengths, buffer=1))
    assert [[len(b) for b in step] for step in steps] == [[2, 2], [2, 2], [2, 1]]


def test_without_drop_last_empty_ranks_wrap_to_the_start_of_the_order():
    lengths = np.array([8] * 9)
    samplers = _samplers(3, 16, lengths=lengths, buffer=1, drop_last=False)
    steps = _global_batches(samplers)
    order = samplers[0].global_order().tolist()
    assert [[len(b) for b in step] for step in steps] == [[2, 2, 2], [2, 1, 1]]
    assert steps[-1] == [order[6:8], [order[8]], [order[0]]]  # the empty rank wraps to the epoch's start
    assert samplers[0].plan().after.tolist() == [0, 6, 9]  # the epoch is complete, padding not counted
    samplers = _samplers(4, 64, lengths=np.array([8] * 3), buffer=1, drop_last=False)  # fewer than the ranks
    order = samplers[0].global_order().tolist()
    assert _global_batches(samplers) == [[order, [order[0]], [order[1]], [order[2]]]]


def test_a_sample_longer_than_the_budget_is_an_error_naming_it():
    lengths = np.array([4, 4, 40, 4])
    s = TokenBudgetBatchSampler(
        lengths, dp_size=1, dp_rank=0, max_tokens=16, buffer=1, shuffle=False, seed=0, drop_last=True
    )
    with pytest.raises(
        ConfigError,
        match=r"^data\.dataloader_param\.max_tokens_per_batch: sample 2 has 40 tokens, more than the budget "
        r"of 16; raise data\.dataloader_param\.max_tokens_per_batch to at least 40$",
    ):
        list(s)


def test_budget_plan_with_mixing_reads_the_mixed_order():
    mixing = SourceMixing(SIZES, (1.0, 2.0, 3.0))
    lengths = np.random.default_rng(1).integers(1, 10, size=sum(SIZES))
    s = TokenBudgetBatchSampler(
        lengths, dp_size=1, dp_rank=0, max_tokens=20, buffer=1, shuffle=True, seed=4, drop_last=False,
        mixing=mixing,
    )  # fmt: skip
    read = [i for batch in s for i in batch]
    assert read == mixed_order(mixing, seed=4, epoch=0, shuffle=True).tolist()
    assert Counter(_source_of(i) for i in read) == dict(enumerate(largest_remainder(30, mixing.weights)))
