"""Masked attention on one query block against one key/value block, returning the log-sum-exp so partial
results can be merged (online softmax), and its hand-written backward.

Shapes: queries ``[batch, kv_heads, group, q_len, dim]`` (``group`` query heads share one key/value head),
keys and values ``[batch, kv_heads, k_len, dim]``. Work is tiled over queries and keys so no more than
``tile x tile`` scores exist at once, and tiles with no allowed pair (e.g. above the causal diagonal) are
skipped. Arithmetic is fp32 (fp64 for fp64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import torch

from mm_parallel.context.layout import allowed


def _safe(x: torch.Tensor) -> torch.Tensor:
    """``-inf`` -> 0 (rows or tiles without any allowed key), so ``x - safe(x)`` never makes NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def merge(
    out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax-attention results over disjoint key sets (the online-softmax rule)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    base = _safe(new_lse)
    w_old = torch.exp(lse - base).unsqueeze(-1)
    w_new = torch.exp(blk_lse - base).unsqueeze(-1)
    return out * w_old + blk_out * w_new, new_lse


def _tiles(n: int, tile: int) -> list[slice]:
    return [slice(i, min(i + tile, n)) for i in range(0, n, tile)]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and accumulators use: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    s = torch.einsum("bhgqd,bhkd->bhgqk", q.to(acc), k.to(acc)) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: tuple[torch.Tensor, torch.Tensor],
    k_pos: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    tile: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge the attention of ``q`` over this key/value block into ``out``/``lse`` (accumulators, in place).

    ``q_pos``/``k_pos`` are (global token index ``[len]``, segment id ``[batch, len]``)."""
    q_index, q_seg = q_pos
    k_index, k_seg = k_pos
    for qs in _tiles(q.shape[3], tile):
        for ks in _tiles(k.shape[2], tile):
            mask = allowed(q_index[qs], q_seg[:, qs], k_index[ks], k_seg[:, ks])
            if not bool(mask.any()):
                continue
            s = _scores(q[:, :, :, qs], k[:, :, ks], mask, scale)
            mx = _safe(s.amax(-1))
            p = torch.exp(s - mx.unsqueeze(-1))
            denom = p.sum(-1)
            blk = torch.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, ks].to(p.dtype))
            blk = blk / denom.clamp_min(torch.finfo(p.dtype).tiny).unsqueeze(-1)
            blk_lse = mx + torch.log(denom)
            out[:, :, :, qs], lse[:, :, :, qs] = merge(out[:, :, :, qs], lse[:, :, :, qs], blk, blk_lse)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_pos: tuple[torch.Tensor, torch.Tensor],
    k_pos: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    tile: int,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add this block's gradients to ``dq``/``dk``/``dv`` (accumulators, in place). ``lse`` is the final
    log-sum-exp of each query over all keys, ``delta`` = rowsum(dout * out); probabilities are recomputed."""
    q_index, q_seg = q_pos
    k_index, k_seg = k_pos
    acc = acc_dtype(q.dtype)
    dout = dout.to(acc)
    for qs in _tiles(q.shape[3], tile):
        for ks in _tiles(k.shape[2], tile):
            mask = allowed(q_index[qs], q_seg[:, qs], k_index[ks], k_seg[:, ks])
            if not bool(mask.any()):
                continue
            qt, kt, vt, dot = (
                q[:, :, :, qs].to(acc),
                k[:, :, ks].to(acc),
                v[:, :, ks].to(acc),
                dout[:, :, :, qs],
            )
            s = _scores(qt, kt, mask, scale)
            p = torch.exp(s - lse[:, :, :, qs].unsqueeze(-1)).masked_fill(~mask[:, None, None], 0.0)
            dv[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", p, dot)
            dp = torch.einsum("bhgqd,bhkd->bhgqk", dot, vt)
            ds = p * (dp - delta[:, :, :, qs].unsqueeze(-1))
            dq[:, :, :, qs] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kt) * scale
            dk[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qt) * scale
