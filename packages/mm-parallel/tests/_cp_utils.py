"""Shared pieces of the context-parallel tests: a reference attention and test sequences."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mm_parallel.context import PAD_SEGMENT, SequenceLayout


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain full attention, causal within segments, padding keys masked, rows with no key -> 0.
    ``q`` ``[b, h, s, d]``, ``k``/``v`` ``[b, kv_heads, s, d]``; returns ``[b, s, h, d]``."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    n = q.shape[2]
    idx = torch.arange(n)
    mask = (
        (segments[:, :, None] == segments[:, None, :])
        & (idx[None, None, :] <= idx[None, :, None])
        & (segments >= 0)[:, None, :]
    )
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v).transpose(1, 2)


def packed_segments(batch: int, seq_len: int, pad: int, seed: int) -> torch.Tensor:
    """Segment ids of packed rows (random document lengths) with ``pad`` padding tokens at the end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < seq_len - pad:
            ids += [doc] * int(torch.randint(3, 17, (1,), generator=g))
            doc += 1
        rows.append(ids[: seq_len - pad] + [PAD_SEGMENT] * pad)
    return torch.tensor(rows)


def make_groups(
    ring: int, ulysses: int
) -> tuple[int, int, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Rank = ring_rank x ulysses + ulysses_rank (Ulysses innermost, as mm's world mesh). Every rank creates
    every group, as ``new_group`` requires."""
    rank = dist.get_rank()
    ring_rank, uly_rank = divmod(rank, ulysses)
    ring_group = uly_group = None
    for u in range(ulysses):
        g = dist.new_group([r * ulysses + u for r in range(ring)])
        if u == uly_rank:
            ring_group = g
    for r in range(ring):
        g = dist.new_group([r * ulysses + u for u in range(ulysses)])
        if r == ring_rank:
            uly_group = g
    return ring_rank, uly_rank, (ring_group if ring > 1 else None), (uly_group if ulysses > 1 else None)


def layout_for(segments: torch.Tensor, ring: int, ulysses: int) -> SequenceLayout:
    ring_rank, uly_rank, ring_group, uly_group = make_groups(ring, ulysses)
    return SequenceLayout(segments, ring, ring_rank, ulysses, uly_rank, ring_group, uly_group)
