"""Orthogonalise the Muon updates of one step: local matrices in place, sharded ones via owners."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .exchange import ExchangePlan, ShardExchange, plan_exchange
from .layout import MatrixLayout
from .newton_schulz import ns_cost, zeropower_via_newtonschulz
from .stats import MuonStepStats


@dataclass(frozen=True)
class NSConfig:
    """Newton–Schulz settings shared by all matrices orthogonalised in one batch."""

    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    dtype: torch.dtype


def _run_batched(
    jobs: Sequence[tuple[Tensor, Callable[[Tensor], object]]],  # the callback's result is ignored
    config: NSConfig,
    stats: MuonStepStats,
    sync: Callable[[], None],
) -> None:
    """Orthogonalise ``[b, m, n]`` inputs, batching equal shapes; hand each result to its callback."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for index, (matrices, _) in enumerate(jobs):
        by_shape.setdefault((matrices.shape[-2], matrices.shape[-1]), []).append(index)
    for (rows, cols), indices in by_shape.items():
        batch = torch.cat([jobs[i][0] for i in indices]) if len(indices) > 1 else jobs[indices[0]][0]
        sync()
        start, cpu_start = time.perf_counter(), time.thread_time()
        result = zeropower_via_newtonschulz(
            batch, config.coefficients, config.steps, config.eps, config.dtype
        )
        sync()
        stats.ns_seconds += time.perf_counter() - start
        stats.ns_cpu_seconds += time.thread_time() - cpu_start
        stats.matrices_orthogonalized += batch.shape[0]
        stats.ns_cost += batch.shape[0] * ns_cost(rows, cols)
        offset = 0
        for i in indices:
            count = jobs[i][0].shape[0]
            jobs[i][1](result[offset : offset + count])
            offset += count


def orthogonalize(
    layouts: Sequence[MatrixLayout],
    updates: Sequence[Tensor],
    config: NSConfig,
    stats: MuonStepStats,
    plan_cache: dict[tuple[MatrixLayout, ...], ExchangePlan],
    sync: Callable[[], None] = lambda: None,
) -> list[Tensor]:
    """Return the orthogonalised local part of every update (``updates[k]`` is ``[num_local, a, b]``).

    Matrices that are whole on this rank are orthogonalised here. Sharded matrices are grouped by
    shard group; each group makes one all-to-all to the owners and one back, whatever the number of
    parameters. Local work runs while the first exchange is in flight.
    """
    outputs = [torch.empty(u.shape, dtype=config.dtype, device=u.device) for u in updates]
    by_group: dict[int, list[int]] = {}
    local: list[int] = []
    for k, layout in enumerate(layouts):
        if layout.sharded:
            by_group.setdefault(id(layout.group), []).append(k)
        else:
            local.append(k)

    exchanges: list[tuple[list[int], ShardExchange]] = []
    for members in by_group.values():
        key = tuple(layouts[k] for k in members)
        plan = plan_cache.get(key)
        if plan is None:
            if len(plan_cache) >= 16:
                plan_cache.clear()
            plan = plan_cache[key] = plan_exchange(key)
        exchange = ShardExchange(plan, stats)
        exchange.start_scatter([updates[k] for k in members], config.dtype)
        exchanges.append((members, exchange))

    _run_batched([(updates[k], outputs[k].copy_) for k in local], config, stats, sync)

    owned_results: list[dict[int, Tensor]] = []
    jobs: list[tuple[Tensor, Callable[[Tensor], object]]] = []
    for _, exchange in exchanges:
        results: dict[int, Tensor] = {}
        owned_results.append(results)
        for item, matrix in exchange.finish_scatter():
            jobs.append((matrix.unsqueeze(0), _store(results, item)))
    _run_batched(jobs, config, stats, sync)

    for (_, exchange), results in zip(exchanges, owned_results, strict=True):
        exchange.start_return(results)
    for members, exchange in exchanges:
        exchange.finish_return([outputs[k] for k in members])
    return outputs


def _store(results: dict[int, Tensor], item: int) -> Callable[[Tensor], None]:
    def put(value: Tensor) -> None:
        results[item] = value[0]

    return put
