"""Owner planning and the two batched all-to-all exchanges of the distributed Muon step.

Every sharded matrix is orthogonalised by exactly one *owner* rank of its shard group. Owners are
chosen by greedy longest-processing-time on the Newton–Schulz cost, identically on every rank (the
plan depends only on global shapes and parameter order). Round one sends each rank's shard of every
matrix to the matrix's owner in one ``all_to_all_single`` per shard group; round two sends the
orthogonalised slices back the same way. Split sizes follow from the shapes, so no size exchange
is needed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import MatrixLayout
from .newton_schulz import ns_cost
from .stats import MuonStepStats


def assign_owners(costs: Sequence[int], num_ranks: int) -> list[int]:
    """Greedy LPT: largest job first, to the least-loaded rank (ties to the lowest rank)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0, rank) for rank in range(num_ranks)]
    owners = [0] * len(costs)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    return owners


@dataclass
class ExchangePlan:
    """The fixed routing for one shard group and one set of parameter layouts."""

    layouts: list[MatrixLayout]
    items: list[tuple[int, int]]  # (index into layouts, matrix index inside that parameter)
    owners: list[int]
    by_owner: list[list[int]]  # item indices owned by each rank, in item order
    send_splits: list[int]  # round one: elements this rank sends to each rank
    recv_splits: list[int]  # round one: elements this rank receives from each rank
    loads: list[int] = field(default_factory=list)  # estimated NS cost per rank

    @property
    def rank(self) -> int:
        return self.layouts[0].group_rank

    @property
    def size(self) -> int:
        return self.layouts[0].group_size

    @property
    def group(self) -> dist.ProcessGroup:
        group = self.layouts[0].group
        assert group is not None
        return group


def plan_exchange(layouts: Sequence[MatrixLayout]) -> ExchangePlan:
    """Build the routing for parameters that share one shard group (same order on every rank)."""
    layouts = list(layouts)
    size, rank = layouts[0].group_size, layouts[0].group_rank
    items = [(w, e) for w, lay in enumerate(layouts) for e in range(lay.num_local)]
    costs = [ns_cost(layouts[w].rows, layouts[w].cols) for w, _ in items]
    owners = assign_owners(costs, size)
    by_owner: list[list[int]] = [[] for _ in range(size)]
    loads = [0] * size
    for i, owner in enumerate(owners):
        by_owner[owner].append(i)
        loads[owner] += costs[i]
    send_splits = [sum(layouts[items[i][0]].piece_numel(rank) for i in by_owner[j]) for j in range(size)]
    recv_splits = [sum(layouts[items[i][0]].piece_numel(s) for i in by_owner[rank]) for s in range(size)]
    return ExchangePlan(layouts, items, owners, by_owner, send_splits, recv_splits, loads)


def _all_to_all(
    output: Tensor,
    inp: Tensor,
    out_splits: list[int],
    in_splits: list[int],
    plan: ExchangePlan,
    stats: MuonStepStats,
) -> dist.Work | None:
    """The one place the Muon step calls a collective; counts calls and bytes on ``stats``."""
    stats.all_to_all_calls += 1
    itemsize = inp.element_size()
    stats.bytes_sent += (sum(in_splits) - in_splits[plan.rank]) * itemsize
    stats.bytes_received += (sum(out_splits) - out_splits[plan.rank]) * itemsize
    work: dist.Work | None = dist.all_to_all_single(
        output,
        inp,
        output_split_sizes=out_splits,
        input_split_sizes=in_splits,
        group=plan.group,
        async_op=True,
    )
    return work


class ShardExchange:
    """Runs both rounds of one :class:`ExchangePlan` for one step."""

    def __init__(self, plan: ExchangePlan, stats: MuonStepStats) -> None:
        self.plan = plan
        self.stats = stats
        self._work: dist.Work | None = None
        self._recv: Tensor | None = None
        self._dtype = torch.float32
        self._device = torch.device("cpu")

    def start_scatter(self, updates: Sequence[Tensor], dtype: torch.dtype) -> None:
        """Send this rank's piece of every matrix to its owner. ``updates[w]`` is ``[num_local, a, b]``."""
        plan = self.plan
        pieces = [
            updates[plan.items[i][0]][plan.items[i][1]].reshape(-1)
            for owner in range(plan.size)
            for i in plan.by_owner[owner]
        ]
        device = updates[0].device
        self._dtype, self._device = dtype, device
        send = torch.cat(pieces).to(dtype) if pieces else torch.empty(0, dtype=dtype, device=device)
        self._recv = torch.empty(sum(plan.recv_splits), dtype=dtype, device=device)
        self._work = _all_to_all(self._recv, send, plan.recv_splits, plan.send_splits, plan, self.stats)

    def finish_scatter(self) -> list[tuple[int, Tensor]]:
        """Wait for round one; return ``(item index, full matrix)`` for every item this rank owns."""
        plan = self.plan
        assert self._recv is not None
        if self._work is not None:
            self._work.wait()
        owned = plan.by_owner[plan.rank]
        per_source = torch.split(self._recv, plan.recv_splits)
        pieces: list[list[Tensor]] = [[] for _ in owned]
        for source, chunk in enumerate(per_source):
            offset = 0
            for k, i in enumerate(owned):
                lay = plan.layouts[plan.items[i][0]]
                numel = lay.piece_numel(source)
                pieces[k].append(chunk[offset : offset + numel].view(lay.piece_shape(source)))
                offset += numel
        self._recv = None
        return [
            (i, torch.cat(pieces[k], dim=plan.layouts[plan.items[i][0]].shard_dim))
            for k, i in enumerate(owned)
        ]

    def start_return(self, results: dict[int, Tensor]) -> None:
        """Send each owned orthogonalised matrix's slices back to the ranks that hold them."""
        plan = self.plan
        owned = plan.by_owner[plan.rank]
        slices: list[list[Tensor]] = []
        for i in owned:
            lay = plan.layouts[plan.items[i][0]]
            slices.append(list(torch.split(results[i], lay.split_sizes(), dim=lay.shard_dim)))
        pieces = [slices[k][dest].reshape(-1) for dest in range(plan.size) for k in range(len(owned))]
        send = (
            torch.cat(pieces).to(self._dtype)
            if pieces
            else torch.empty(0, dtype=self._dtype, device=self._device)
        )
        self._recv = torch.empty(sum(plan.send_splits), dtype=self._dtype, device=self._device)
        self._work = _all_to_all(self._recv, send, plan.send_splits, plan.recv_splits, plan, self.stats)

    def finish_return(self, outputs: Sequence[Tensor]) -> None:
        """Wait for round two and copy this rank's slices into ``outputs[w][e]``."""
        plan = self.plan
        assert self._recv is not None
        if self._work is not None:
            self._work.wait()
        per_owner = torch.split(self._recv, plan.send_splits)
        for owner, chunk in enumerate(per_owner):
            offset = 0
            for i in plan.by_owner[owner]:
                w, e = plan.items[i]
                lay = plan.layouts[w]
                numel = lay.piece_numel(plan.rank)
                outputs[w][e].copy_(chunk[offset : offset + numel].view(lay.piece_shape(plan.rank)))
                offset += numel
        self._recv = None
