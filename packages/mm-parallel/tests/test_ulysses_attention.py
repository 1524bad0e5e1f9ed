"""Ulysses all-to-all attention, alone and combined with ring attention, against plain full attention,
including grouped-query attention with fewer key/value heads than the Ulysses size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _muon_dist_utils import run_ranks
from test_ring_attention import _check_against_reference

from mm_parallel.context import heads_to_seq, seq_to_heads
from mm_parallel.context.ulysses import kv_repeats


def _worker(rank: int, world: int, ring: int, ulysses: int, heads: int, kv_heads: int) -> None:
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float64, 1e-10, tile=5)
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float32, 2e-5, tile=1024)
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float64, 1e-10, tile=5, plain=True)


@pytest.mark.parametrize(
    ("ring", "ulysses", "heads", "kv_heads"),
    [
        (1, 2, 4, 2),  # kv heads split evenly
        (1, 2, 4, 1),  # fewer kv heads than Ulysses ranks: repeated before the all-to-all
        (1, 4, 8, 2),
        (2, 2, 4, 1),  # hybrid: Ulysses inside ring
    ],
)
def test_ulysses_matches_full_attention(ring, ulysses, heads, kv_heads):
    run_ranks(_worker, ring * ulysses, ring, ulysses, heads, kv_heads, timeout=60)


def _latent_worker(rank: int, world: int, ring: int, ulysses: int, v_dim: int) -> None:
    _check_against_reference(ring, ulysses, 4, 2, torch.float64, 1e-10, tile=5, v_dim=v_dim)


@pytest.mark.parametrize(("ring", "ulysses", "v_dim"), [(1, 2, 6), (2, 1, 12)])
def test_values_of_another_width_than_queries(ring, ulysses, v_dim):
    """Multi-head latent attention (DeepSeek-V3, Kimi K2.5): values narrower or wider than queries/keys."""
    run_ranks(_latent_worker, ring * ulysses, ring, ulysses, v_dim, timeout=60)


def _roundtrip_worker(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    x = torch.randn(2, 4, 3, 5, requires_grad=True)
    y = seq_to_heads(x, dist.group.WORLD, world)
    assert y.shape == (2, 4 // world, 3 * world, 5)
    # rank r now holds head group r of every rank's slice, in rank order
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.detach())
    full = torch.cat(gathered, dim=2)
    per = 4 // world
    torch.testing.assert_close(y.detach(), full[:, rank * per : (rank + 1) * per])
    z = heads_to_seq(y, dist.group.WORLD, world)
    torch.testing.assert_close(z, x)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_all_to_all_roundtrip_and_gradient():
    run_ranks(_roundtrip_worker, 2, timeout=60)


def test_kv_repeats():
    assert kv_repeats(8, 8, 4) == 1
    assert kv_repeats(8, 2, 4) == 2
    assert kv_repeats(8, 1, 4) == 4
    assert kv_repeats(12, 6, 4) == 2
    with pytest.raises(ValueError, match="must divide the number of attention heads 6"):
        kv_repeats(6, 2, 4)
