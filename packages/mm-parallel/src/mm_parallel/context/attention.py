"""Context-parallel attention: Ulysses all-to-all (optional) around ring attention (optional)."""

from __future__ import annotations

import torch

from mm_parallel.context.layout import SequenceLayout
from mm_parallel.context.ring import ring_attention
from mm_parallel.context.ulysses import heads_to_seq, kv_repeats, seq_to_heads


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout,
    scale: float | None = None,
    tile: int = 1024,
) -> torch.Tensor:
    """Attention of this rank's tokens over the whole (sharded) sequence.

    ``q``: ``[batch, heads, local_len, dim]``; ``k``, ``v``: ``[batch, kv_heads, local_len, dim]`` with
    ``heads % kv_heads == 0`` (grouped-query attention), the local tokens being ``layout.local_index()``.
    Returns ``[batch, local_len, heads, v_dim]`` (the layout transformers' attention functions return).
    Causal within segments, as described by ``layout``.

    The values may be narrower or wider than the queries and keys (multi-head latent attention: DeepSeek-V3
    and Kimi K2.5 attend with 192-wide queries and keys over 128-wide values): the narrower side is padded
    with zeros, which changes no score (zero columns of ``q``/``k``) and no output (zero columns of ``v`` are
    cut off again), so the kernels below see one width.

    Each block of work is one fused kernel call on the tensors' device type
    (:mod:`mm_parallel.kernels.attention_lse`), in the inputs' dtype; ``tile`` bounds the query rows per call
    when a mask must be built (packed documents)."""
    b, heads, _, dim = q.shape
    kv_heads, v_dim = k.shape[1], v.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of key/value heads {kv_heads}")
    scale = dim**-0.5 if scale is None else scale
    if v_dim != dim:
        width = max(dim, v_dim)
        q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        dim = width
    size = layout.ulysses_size
    if size > 1:
        if layout.ulysses_group is None:
            raise ValueError(f"Ulysses size {size} needs the Ulysses process group in SequenceLayout")
        rep = kv_repeats(heads, kv_heads, size)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        q = seq_to_heads(q, layout.ulysses_group, size)
        k = seq_to_heads(k, layout.ulysses_group, size)
        v = seq_to_heads(v, layout.ulysses_group, size)
    out = ring_attention(q, k, v, layout, scale, tile)
    if size > 1:
        assert layout.ulysses_group is not None  # checked above
        out = heads_to_seq(out, layout.ulysses_group, size)
    return out[..., :v_dim].transpose(1, 2).contiguous()
