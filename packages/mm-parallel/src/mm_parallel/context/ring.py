"""Ring attention: key/value blocks travel around the ring group while every rank merges the partial
attention of its queries with the online-softmax (log-sum-exp) rule.

Forward: ``ring`` steps; at step ``s`` a rank holds the key/value block of ring rank ``rank - s`` and sends
it on to ``rank + 1`` while it computes (point-to-point ``batch_isend_irecv``, which gloo, nccl and hccl
all provide). Backward: the key/value blocks go round again together with their gradient accumulators,
so after ``ring`` hops every block's gradient arrives back at its owner. Which keys a query may see comes
from the :class:`SequenceLayout` (global indices and segment ids), known on every rank without
communication.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mm_parallel.context.kernel import acc_dtype, block_backward, block_forward
from mm_parallel.context.layout import SequenceLayout

# the requests of one shift, and the tensors they receive into
_Pending = tuple[list[dist.Work], list[torch.Tensor]]


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
        q_pos = _positions(layout, rank)
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            pending = _start_shift([kv], group, rank, size) if step < size - 1 else None
            src = (rank - step) % size
            block_forward(q, kv[0], kv[1], q_pos, _positions(layout, src), scale, tile, out, lse)
            if pending is not None:
                (kv,) = _finish(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.tile = layout, scale, tile
        return out.to(q.dtype)

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, tile = ctx.layout, ctx.scale, ctx.tile
        size, rank, group = layout.ring_size, layout.ring_rank, layout.ring_group
        q_pos = _positions(layout, rank)
        acc = out.dtype
        delta = (dout.to(acc) * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for step in range(size):
            pending_kv = _start_shift([kv], group, rank, size) if step < size - 1 else None
            src = (rank - step) % size
            block_backward(
                q,
                kv[0],
                kv[1],
                dout,
                lse,
                delta,
                q_pos,
                _positions(layout, src),
                scale,
                tile,
                dq,
                dkv[0],
                dkv[1],
            )
            if size > 1:
                (dkv,) = _finish(_start_shift([dkv], group, rank, size))
            if pending_kv is not None:
                (kv,) = _finish(pending_kv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, scale: float, tile: int = 1024
) -> torch.Tensor:
    """Attention of this ring rank's queries over the whole sequence.

    ``q``: ``[batch, kv_heads, group, len, dim]``; ``k``, ``v``: ``[batch, kv_heads, len, dim]``, where
    ``len`` is ``layout.ring_index(layout.ring_rank)`` tokens. Returns ``[batch, kv_heads, group, len, dim]``.
    With ``layout.ring_size == 1`` it is plain masked attention (no communication)."""
    if layout.ring_size > 1 and layout.ring_group is None:
        raise ValueError(f"ring size {layout.ring_size} needs the ring process group in SequenceLayout")
    # torch.autograd.Function.apply is unannotated (returns what forward returns)
    out: torch.Tensor = _RingAttention.apply(q, k, v, layout, scale, tile)  # type: ignore[no-untyped-call]
    return out
