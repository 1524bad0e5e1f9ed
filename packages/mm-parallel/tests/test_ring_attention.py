"""Ring attention (and the shared masked-attention kernel) against plain full attention: forward output
and gradients of q, k, v, on real gloo ranks, with packed documents, padding and grouped-query heads."""

from __future__ import annotations

import pytest
import torch
from _cp_utils import layout_for, packed_segments, reference_attention
from _muon_dist_utils import run_ranks

from mm_parallel.context import SequenceLayout, context_parallel_attention, zigzag_index
from mm_parallel.context.layout import allowed


def _check_against_reference(
    ring: int,
    ulysses: int,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    tol: float,
    tile: int,
    v_dim: int = 8,
    plain: bool = False,
) -> None:
    """``plain``: one document per row and padding at its end (the fused kernels run without a mask);
    else packed documents (masked, ``tile`` query rows at a time)."""
    torch.manual_seed(0)
    b, s, d = 2, 48, 8
    q = torch.randn(b, heads, s, d, dtype=dtype)
    k = torch.randn(b, kv_heads, s, d, dtype=dtype)
    v = torch.randn(b, kv_heads, s, v_dim, dtype=dtype)
    w = torch.randn(b, s, heads, v_dim, dtype=dtype)
    segments = packed_segments(b, s, pad=5, seed=1)
    if plain:
        segments = torch.where(segments >= 0, 0, segments)
    scale = d**-0.5

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*full, segments, scale)
    (ref * w).sum().backward()

    layout = layout_for(segments, ring, ulysses)
    assert layout.is_causal_only() == plain
    local = [layout.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, layout, scale, tile=tile)
    (out * layout.shard(w, dim=1)).sum().backward()

    torch.testing.assert_close(out, layout.shard(ref.detach(), dim=1), rtol=tol, atol=tol)
    for name, mine, theirs in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad, layout.shard(theirs.grad, dim=2), rtol=tol, atol=tol, msg=name)


def _ring_worker(rank: int, world: int, ring: int, ulysses: int, heads: int, kv_heads: int) -> None:
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float64, 1e-10, tile=7)
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float32, 2e-5, tile=1024)
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float64, 1e-10, tile=7, plain=True)
    _check_against_reference(ring, ulysses, heads, kv_heads, torch.float32, 2e-5, tile=1024, plain=True)


@pytest.mark.parametrize("ring", [2, 4])
def test_ring_matches_full_attention(ring):
    run_ranks(_ring_worker, ring, ring, 1, 4, 2, timeout=60)


def test_single_rank_kernel_matches_full_attention():
    """ring = ulysses = 1: the masked tiled kernel alone, no process group needed."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 40, 8
    segments = packed_segments(b, s, pad=3, seed=2)
    q, k, v = (
        torch.randn(b, h if i == 0 else 1, s, d, dtype=torch.float64, requires_grad=True) for i in range(3)
    )
    layout = SequenceLayout(segments, 1, 0, 1, 0)
    out = context_parallel_attention(q, k, v, layout, 0.3, tile=6)
    ref = reference_attention(q, k, v, segments, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_padding_rows_are_zero_and_finite():
    b, h, s, d = 1, 2, 8, 4
    segments = torch.tensor([[0, 0, 0, 0, 0, -1, -1, -1]])
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    out = context_parallel_attention(q, k, v, SequenceLayout(segments, 1, 0, 1, 0))
    assert torch.all(out[:, 5:] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(k.grad[:, :, 5:] == 0) and torch.all(v.grad[:, :, 5:] == 0)


@pytest.mark.parametrize("ring", [2, 3, 4])
def test_zigzag_split_partitions_and_balances(ring):
    s = 2 * ring * 16
    parts = [zigzag_index(s, ring, r) for r in range(ring)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(s))
    seg = torch.zeros(1, s, dtype=torch.long)
    full = torch.arange(s)
    work = [int(allowed(p, seg[:, p], full, seg).sum()) for p in parts]
    # causal work per rank is equal under the zigzag split (a contiguous split would differ ~2*ring-fold)
    assert max(work) == min(work), work


def test_layout_rejects_unpadded_length():
    with pytest.raises(ValueError, match="multiple of 8"):
        SequenceLayout(torch.zeros(1, 12, dtype=torch.long), 2, 0, 2, 0)
