"""Ring attention: key/value blocks travel around the ring group while every rank merges the partial
attention of its queries with the online-softmax (log-sum-exp) rule.

Forward: ``ring`` steps; at step ``s`` a rank holds the key/value block of ring rank ``rank - s`` and sends
it on to ``rank + 1`` while it computes (point-to-point ``batch_isend_irecv``, which gloo, nccl and hccl
all provide). Each block's attention is one fused kernel returning its log-sum-exp
(:mod:`mm_parallel.kernels.attention_lse`); the partial results are merged with those. Backward: the
key/value blocks go round again together with their gradient accumulators, so after ``ring`` hops every
block's gradient arrives back at its owner; each block's gradients come from the kernel's backward given the
merged output and log-sum-exp.

Which work a step has follows from the zigzag layout alone (:mod:`mm_parallel.context.layout`): ring rank
``r`` holds chunks ``r`` and ``2R - 1 - r``. Against its own block the queries attend causally; against the
block of a lower ring rank every query sees exactly the block's first chunk (fully, no mask); against a higher
ring rank only the second chunk of queries attends, to the whole block (fully). When the micro-batch is one
document per row with padding only at the end (:meth:`SequenceLayout.is_causal_only`), that is all: no mask
is built. Otherwise (packed documents, padding elsewhere) each of those blocks is computed ``tile`` query rows
at a time with a boolean mask built on the device from the segment ids. No step reads anything back to the
host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mm_parallel.context.layout import SequenceLayout, allowed
from mm_parallel.kernels.attention_lse import attention_lse, attention_lse_backward, lse_dtype

# the requests of one shift, and the tensors they receive into
_Pending = tuple[list[dist.Work], list[torch.Tensor]]
# one kernel call: query rows, key rows, causal, mask ([batch, q, k] booleans or None)
_Block = tuple[slice, slice, bool, torch.Tensor | None]


def _start_shift(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, rank: int, size: int
) -> _Pending:
    """Send each tensor to ring rank ``rank + 1`` and receive its counterpart from ``rank - 1``."""
    assert group is not None  # ring_attention requires the ring group when there is more than one rank
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    recvs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in recvs]
    return dist.batch_isend_irecv(ops), recvs


def _finish(pending: _Pending) -> list[torch.Tensor]:
    reqs, recvs = pending
    for req in reqs:
        req.wait()
    return recvs


def _positions(layout: SequenceLayout, ring_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = layout.ring_index(ring_rank)
    return index, layout.segments[:, index]


def _blocks(layout: SequenceLayout, src: int, n: int, tile: int, device: torch.device) -> list[_Block]:
    """The kernel calls of this ring rank's queries against ring rank ``src``'s keys (``n`` tokens each)."""
    rank, half = layout.ring_rank, n // 2
    whole = slice(0, n)
    if layout.ring_size == 1 or src == rank:
        q_rows, k_rows, diagonal = whole, whole, True
    elif src < rank:  # every query sees the block's first chunk, none its second
        q_rows, k_rows, diagonal = whole, slice(0, half), False
    else:  # only the second chunk of queries attends, to the whole block
        q_rows, k_rows, diagonal = slice(half, n), whole, False
    if layout.is_causal_only():
        return [(q_rows, k_rows, diagonal, None)]
    q_index, q_seg = _positions(layout, rank)
    k_index, k_seg = _positions(layout, src)
    blocks: list[_Block] = []
    for start in range(q_rows.start, q_rows.stop, tile):
        qs = slice(start, min(start + tile, q_rows.stop))
        # on the diagonal, keys after the tile's last query are masked for all of its rows
        ks = slice(k_rows.start, qs.stop) if diagonal else k_rows
        mask = allowed(q_index[qs], q_seg[:, qs], k_index[ks], k_seg[:, ks])
        blocks.append((qs, ks, False, mask.to(device)))
    return blocks


def merge(
    out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax-attention results over disjoint key sets (the online-softmax rule);
    ``-inf`` log-sum-exps (no key yet) are handled without NaN."""
    new_lse = torch.logaddexp(lse, blk_lse)
    base = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - base).unsqueeze(-1)
    w_new = torch.exp(blk_lse - base).unsqueeze(-1)
    return out * w_old + blk_out.to(out.dtype) * w_new, new_lse


def _real_rows(layout: SequenceLayout, device: torch.device) -> torch.Tensor:
    """``[batch, 1, len, 1]``: 1 for this ring rank's real query rows, 0 for padding."""
    return (_positions(layout, layout.ring_rank)[1] >= 0).to(device)[:, None, :, None]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SequenceLayout,
        scale: float,
        tile: int,
    ) -> torch.Tensor:
        size, rank, group = layout.ring_size, layout.ring_rank, layout.ring_group
        n, acc = q.shape[2], lse_dtype(q.dtype)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            pending = _start_shift([kv], group, rank, size) if step < size - 1 else None
            src = (rank - step) % size
            for qs, ks, causal, mask in _blocks(layout, src, n, tile, q.device):
                blk_out, blk_lse = attention_lse(
                    q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, causal, mask
                )
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            if pending is not None:
                (kv,) = _finish(pending)
        if layout.is_causal_only():
            # padding queries (at the end) attended causally; they attend to nothing under the layout
            out = out * _real_rows(layout, q.device)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.tile = layout, scale, tile
        return out

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, tile = ctx.layout, ctx.scale, ctx.tile
        size, rank, group = layout.ring_size, layout.ring_rank, layout.ring_group
        n, acc = q.shape[2], lse.dtype
        dout = dout.to(q.dtype)
        if layout.is_causal_only():
            dout = dout * _real_rows(layout, q.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for step in range(size):
            pending_kv = _start_shift([kv], group, rank, size) if step < size - 1 else None
            src = (rank - step) % size
            for qs, ks, causal, mask in _blocks(layout, src, n, tile, q.device):
                dq_b, dk_b, dv_b = attention_lse_backward(
                    dout[:, :, qs],
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    scale,
                    causal,
                    mask,
                )
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if size > 1:
                (dkv,) = _finish(_start_shift([dkv], group, rank, size))
            if pending_kv is not None:
                (kv,) = _finish(pending_kv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, scale: float, tile: int = 1024
) -> torch.Tensor:
    """Attention of this ring rank's queries over the whole sequence.

    ``q``: ``[batch, heads, len, dim]``; ``k``, ``v``: ``[batch, kv_heads, len, dim]`` (``heads`` a multiple
    of ``kv_heads``: grouped-query heads go to the kernels unrepeated where they take them), where ``len`` is
    ``layout.ring_index(layout.ring_rank)`` tokens. Returns ``[batch, heads, len, dim]``. ``tile``: query rows
    per kernel call when a mask must be built (packed documents), bounding the mask to ``tile x len``. With
    ``layout.ring_size == 1`` it is plain masked attention (no communication)."""
    if layout.ring_size > 1 and layout.ring_group is None:
        raise ValueError(f"ring size {layout.ring_size} needs the ring process group in SequenceLayout")
    # torch.autograd.Function.apply is unannotated (returns what forward returns)
    out: torch.Tensor = _RingAttention.apply(q, k, v, layout, scale, tile)  # type: ignore[no-untyped-call]
    return out
