"""Causal attention over packed documents ("varlen"), one fused kernel per device type.

All entries take the TND layout: ``query`` ``[total, q_heads, dim]``, ``key``/``value`` ``[total, kv_heads,
dim]`` (``q_heads`` a multiple of ``kv_heads``: grouped-query attention without repeating K/V), where the
tokens of every document lie one after another and ``cu_seqlens`` (int32 ``[docs + 1]``, on the tensors'
device) holds the cumulative document lengths ``0, l0, l0 + l1, ..., total``. Each query attends causally to
the keys of its own document only (within ``window`` tokens back when set: key ``j`` is seen by query ``i``
when ``0 <= i - j < window``), so no ``total x total`` (or ``seq x seq``) mask is ever built and no work is
spent across document boundaries. The output has the query's shape.

- ``cuda``: torch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen kernel inside torch),
  else ``flash_attn.flash_attn_varlen_func`` when the flash-attn package is installed.
- ``npu``: ``torch_npu.npu_fusion_attention`` with ``input_layout="TND"`` and the cumulative lengths as
  ``actual_seq_qlen``/``actual_seq_kvlen`` (host lists), causal through ``sparse_mode=3`` and its compressed
  2048 x 2048 mask (``sparse_mode=4`` with ``pre_tockens`` for a window).
- anything else (``cpu``): :func:`per_document_attention`, torch's fused ``scaled_dot_product_attention``
  once per document (causal, grouped-query), so a document's cost is its own length squared.

``lengths`` (the document lengths as host integers) and ``max_len`` let a caller that already knows them on
the host spare the kernels a device-to-host read; ``max_len`` may be an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from importlib.util import find_spec
from typing import Any

import torch
import torch.nn.functional as F


def _host_lengths(cu_seqlens: torch.Tensor, lengths: Sequence[int] | None) -> list[int]:
    if lengths is not None:
        return [int(n) for n in lengths]
    return [int(n) for n in torch.diff(cu_seqlens).tolist()]


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            "varlen attention takes [total, heads, dim] (TND) query/key/value; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of key/value heads {key.shape[1]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor of docs + 1 offsets; got {tuple(cu_seqlens.shape)}"
        )


def per_document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int | None = None,
    *,
    lengths: Sequence[int] | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen attention as torch's fused SDPA over each document in turn (any device; the CPU entry)."""
    _check(query, key, value, cu_seqlens)
    gqa = query.shape[1] != key.shape[1]
    outs: list[torch.Tensor] = []
    start = 0
    for n in _host_lengths(cu_seqlens, lengths):
        stop = start + n
        q, k, v = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        mask = None
        if window is not None and n > window:
            i = torch.arange(n, device=query.device)
            back = i[:, None] - i[None, :]
            mask = (back >= 0) & (back < window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        outs.append(out.squeeze(0).transpose(0, 1))
        start = stop
    if start != query.shape[0]:
        raise ValueError(f"document lengths sum to {start}, but the tensors hold {query.shape[0]} tokens")
    return torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()


@lru_cache(maxsize=1)
def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn


def cuda_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int | None = None,
    *,
    lengths: Sequence[int] | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen attention on CUDA: torch's ``varlen_attn``, else flash-attn's ``flash_attn_varlen_func``."""
    _check(query, key, value, cu_seqlens)
    if max_len is None:
        max_len = max(_host_lengths(cu_seqlens, lengths))
    cu = cu_seqlens.to(torch.int32)
    left = -1 if window is None else window - 1
    varlen_attn = _torch_varlen()
    if varlen_attn is not None:
        out: torch.Tensor = varlen_attn(
            query,
            key,
            value,
            cu,
            cu,
            max_len,
            max_len,
            scale=scale,
            window_size=(left, 0),
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out
    if find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func

        result: torch.Tensor = flash_attn_varlen_func(
            query,
            key,
            value,
            cu,
            cu,
            max_len,
            max_len,
            softmax_scale=scale,
            causal=True,
            window_size=(left, 0),
        )
        return result
    return per_document_attention(
        query, key, value, cu_seqlens, max_len, lengths=lengths, scale=scale, window=window
    )


#: size of ``npu_fusion_attention``'s compressed causal mask (sparse modes 2-4), True above the diagonal
NPU_MASK_SIZE = 2048


def npu_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int | None = None,
    *,
    lengths: Sequence[int] | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen attention on Ascend: ``torch_npu.npu_fusion_attention`` in the TND layout."""
    import torch_npu

    _check(query, key, value, cu_seqlens)
    ends: list[int] = []
    total = 0
    for n in _host_lengths(cu_seqlens, lengths):
        total += n
        ends.append(total)
    ones = torch.ones(NPU_MASK_SIZE, NPU_MASK_SIZE, dtype=torch.bool, device=query.device)
    extra: dict[str, Any] = {"sparse_mode": 3}
    if window is not None:
        extra = {"sparse_mode": 4, "pre_tockens": window - 1, "next_tockens": 0}
    outs = torch_npu.npu_fusion_attention(
        query,
        key,
        value,
        query.shape[1],
        "TND",
        atten_mask=torch.triu(ones, diagonal=1),
        scale=query.shape[-1] ** -0.5 if scale is None else scale,
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
        **extra,
    )
    out: torch.Tensor = outs[0]
    return out
