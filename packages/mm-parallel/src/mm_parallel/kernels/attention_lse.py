"""Fused attention that also returns the log-sum-exp of every query row, and its backward, per device type.

Ring attention computes the attention of its queries over one key/value block at a time and merges the partial
results with their log-sum-exps (online softmax); the backward of each block is the kernel's own backward
given the *merged* output and log-sum-exp (the softmax of a block, recomputed as ``exp(scores - lse)``, is
then the block's part of the softmax over all keys). Every entry keeps the inputs' dtype inside the kernel
(bf16 stays bf16; the kernels accumulate in fp32 themselves) and reads nothing back to the host.

- ``cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (grouped-query heads
  natively, an additive mask, fp64/fp32/bf16/fp16).
- ``cuda``: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``) for fp16/bf16 without a mask
  (grouped-query heads natively); fp16/bf16 with a mask: ``aten._scaled_dot_product_cudnn_attention``
  (+ ``_backward``, an additive bias) where cuDNN's fused attention is available (compute capability 9.0
  or later, cuDNN SDPA enabled in ``torch.backends.cuda``), else — and for fp32 —
  ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``), which takes an additive bias and
  fp32; key/value heads are repeated for grouped-query attention on both.
- ``npu``: ``torch_npu.npu_fusion_attention`` (+ ``npu_fusion_attention_grad``), BNSD layout, grouped-query
  heads natively; causal through ``sparse_mode=3`` and its compressed 2048 x 2048 mask, other masks as a
  boolean ``atten_mask`` (True = masked); the log-sum-exp is ``softmax_max + log(softmax_sum)``.
- any other device type: the composite formula in plain torch operations (not fused).

Shapes: ``q`` ``[batch, heads, q_len, dim]``, ``k``/``v`` ``[batch, kv_heads, k_len, dim]`` (``heads`` a
multiple of ``kv_heads``); ``mask`` (optional) ``[batch, q_len, k_len]`` booleans, True where the query may
attend to the key; ``causal`` means the top-left aligned causal mask of a square block. The output has
``q``'s shape and dtype, the log-sum-exp is ``[batch, heads, q_len]`` in fp32 (fp64 for fp64 inputs), ``-inf``
on rows where the mask allows no key (whose output is 0).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: sparse_mode of npu_fusion_attention for a causal (lower-triangular) block, and its compressed mask's side
NPU_CAUSAL_SPARSE_MODE = 3
NPU_CAUSAL_MASK_SIZE = 2048


class AttentionLse(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> Grads: ...


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp (and of ring attention's accumulators): fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _bias(mask: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """``[batch, 1, q, k]`` additive bias: 0 where allowed, a large finite negative elsewhere (finite so that
    a row without any allowed key stays NaN-free in every kernel; such rows are overwritten afterwards). With
    ``align`` the storage's last dimension is padded to a multiple of it (the view keeps ``k`` columns)."""
    b, n, m = mask.shape
    width = -(-m // align) * align
    bias = mask.new_zeros((b, 1, n, width), dtype=dtype).narrow(-1, 0, m)
    return bias.masked_fill_(mask.unsqueeze(1).logical_not(), torch.finfo(dtype).min / 2)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradient of repeated key/value heads back to ``kv_heads`` heads."""
    b, h, n, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, n, d).sum(2)


class CpuFlash:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bias = None if mask is None else _bias(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> Grads:
        bias = None if mask is None else _bias(mask, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
        return dq, dk, dv


def _use_cuda_flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The flash kernel takes no mask, only 16-bit inputs and heads up to 256 wide."""
    dim = q.shape[-1]
    return mask is None and q.dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= 256


def cudnn_attention_available() -> bool:
    """Whether cuDNN's fused attention can run here: a CUDA device of compute capability 9.0 or later
    (Hopper, Blackwell), cuDNN present and cuDNN SDPA not switched off (``torch.backends.cuda``)."""
    return (
        torch.cuda.is_available()
        and bool(torch.backends.cudnn.is_available())  # type: ignore[no-untyped-call]
        and bool(torch.backends.cuda.cudnn_sdp_enabled())  # type: ignore[no-untyped-call]
        and torch.cuda.get_device_capability() >= (9, 0)
    )


class CudaSdpa:
    """Flash attention (16-bit, no mask), cuDNN attention (16-bit with a mask, where available) or
    memory-efficient attention (fp32, or a mask without cuDNN) on CUDA. ``cudnn``: None decides by
    :func:`cudnn_attention_available` at the first masked 16-bit call; True/False fix the choice."""

    def __init__(self, cudnn: bool | None = None) -> None:
        self.cudnn = cudnn

    def _use_cudnn(self, q: torch.Tensor, mask: torch.Tensor | None) -> bool:
        if mask is None or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 128:
            return False
        if self.cudnn is None:
            self.cudnn = cudnn_attention_available()
        return bool(self.cudnn)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _use_cuda_flash(q, mask):
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        heads = q.shape[1]
        bias = None if mask is None else _bias(mask, q.dtype, align=16).expand(-1, heads, -1, -1)
        k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        if self._use_cudnn(q, mask):
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, causal, False, scale=scale
            )
            return res[0], res[1].squeeze(-1)  # the log-sum-exp comes as [batch, heads, q_len, 1]
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )
        # the log-sum-exp comes padded to a multiple of 32 rows
        return res[0], res[1].narrow(-1, 0, q.shape[2])

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> Grads:
        b, heads, n, _ = q.shape
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        if _use_cuda_flash(q, mask):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, n, k.shape[2], 0.0, causal, seed, offset, scale=scale
            )
            return dq, dk, dv
        bias = None if mask is None else _bias(mask, q.dtype, align=16).expand(-1, heads, -1, -1)
        kv_heads, k_len = k.shape[1], k.shape[2]
        k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        if self._use_cudnn(q, mask):
            # no dropout: the random-state tensors and the sequence offsets (nested inputs only) are unused
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout,
                q,
                k,
                v,
                out,
                lse.unsqueeze(-1),
                seed,
                offset,
                bias,
                None,
                None,
                n,
                k_len,
                0.0,
                causal,
                scale=scale,
            )
            return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)
        padded = torch.cat([lse, lse.new_zeros(b, heads, -n % 32)], dim=-1)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            bias,
            out,
            padded,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)


def npu_fusion_arguments(
    q: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None
) -> dict[str, Any]:
    """Keyword arguments of ``torch_npu.npu_fusion_attention`` (and of its ``_grad``, with ``scale`` renamed
    ``scale_value``) for one block: BNSD layout, the query head count, no dropout; a causal block through
    ``sparse_mode=3`` with the compressed ``2048 x 2048`` upper-triangular mask, an explicit mask as
    ``atten_mask`` (``[batch, 1, q, k]``, True = masked) with ``sparse_mode=0``."""
    if causal and mask is not None:
        raise ValueError("a block is either causal or explicitly masked (fold causality into the mask)")
    args: dict[str, Any] = {
        "head_num": q.shape[1],
        "input_layout": "BNSD",
        "scale": scale,
        "keep_prob": 1.0,
        "sparse_mode": 0,
        "atten_mask": None,
    }
    if causal:
        size = NPU_CAUSAL_MASK_SIZE
        args["sparse_mode"] = NPU_CAUSAL_SPARSE_MODE
        args["atten_mask"] = torch.ones(size, size, dtype=torch.bool, device=q.device).triu_(1)
    elif mask is not None:
        args["atten_mask"] = mask.unsqueeze(1).logical_not()
    return args


class NpuFusion:
    """``torch_npu.npu_fusion_attention`` and ``npu_fusion_attention_grad`` (torch_npu imported lazily)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch_npu

        res = torch_npu.npu_fusion_attention(q, k, v, **npu_fusion_arguments(q, scale, causal, mask))
        out, softmax_max, softmax_sum = res[0], res[1], res[2]
        # [batch, heads, q_len, 8]: the same value repeated over the last dimension
        return out, softmax_max[..., 0] + torch.log(softmax_sum[..., 0])

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> Grads:
        import torch_npu

        args = npu_fusion_arguments(q, scale, causal, mask)
        args["scale_value"] = args.pop("scale")
        # the merged log-sum-exp as the softmax maximum with a sum of one: exp(s - max) / sum = exp(s - lse)
        softmax_max = lse.float().unsqueeze(-1).expand(*lse.shape, 8).contiguous()
        softmax_sum = torch.ones_like(softmax_max)
        res = torch_npu.npu_fusion_attention_grad(
            q, k, v, dout, softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, **args
        )
        return res[0], res[1], res[2]


class Composite:
    """Attention in plain torch operations (accumulating in fp32), for device types without a fused entry."""

    def _probs(
        self, q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None
    ) -> torch.Tensor:
        acc = lse_dtype(q.dtype)
        s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), _repeat_kv(k, q.shape[1]).to(acc)) * scale
        if causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
        if mask is not None:
            s = s.masked_fill(mask.unsqueeze(1).logical_not(), float("-inf"))
        return s

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._probs(q, k, scale, causal, mask)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - _finite(lse).unsqueeze(-1))
        out = torch.einsum("bhqk,bhkd->bhqd", p, _repeat_kv(v, q.shape[1]).to(p.dtype))
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> Grads:
        heads, acc = q.shape[1], lse_dtype(q.dtype)
        s = self._probs(q, k, scale, causal, mask)
        p = torch.exp(s - lse.unsqueeze(-1))
        do, kr, vr = dout.to(acc), _repeat_kv(k, heads).to(acc), _repeat_kv(v, heads).to(acc)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, vr) - delta) * scale
        dq = torch.einsum("bhqk,bhkd->bhqd", ds, kr)
        dk = _sum_kv(torch.einsum("bhqk,bhqd->bhkd", ds, q.to(acc)), k.shape[1])
        dv = _sum_kv(torch.einsum("bhqk,bhqd->bhkd", p, do), k.shape[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: device type -> fused attention returning the log-sum-exp
IMPLEMENTATIONS: dict[str, AttentionLse] = {"cpu": CpuFlash(), "cuda": CudaSdpa(), "npu": NpuFusion()}
_COMPOSITE = Composite()


def implementation(device_type: str) -> AttentionLse:
    """The entry for a device type (the composite one for types without a fused kernel)."""
    return IMPLEMENTATIONS.get(device_type, _COMPOSITE)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``-inf`` (rows without any key) -> 0, so ``exp(scores - lse)`` stays 0 there instead of NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block on ``q``'s device type (see the module docstring for shapes)."""
    out, lse = implementation(q.device.type).forward(q, k, v, scale, causal, mask)
    lse = lse.to(lse_dtype(q.dtype))
    if mask is not None:
        # rows without any allowed key: output 0 and log-sum-exp -inf, whatever the kernel gives there
        seen = mask.any(-1).unsqueeze(1)
        lse = torch.where(seen, lse, float("-inf"))
        out = torch.where(seen.unsqueeze(-1), out, out.new_zeros(()))
    return out, lse


def attention_lse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> Grads:
    """Gradients of one block given the (merged) output and log-sum-exp of its queries over all keys."""
    impl = implementation(q.device.type)
    lse = _finite(lse).to(lse_dtype(q.dtype)).contiguous()  # a slice of the merged rows
    return impl.backward(dout, q, k, v, out.to(q.dtype), lse, scale, causal, mask)
