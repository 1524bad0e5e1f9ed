"""The fused attention-with-log-sum-exp entries (mm_parallel.kernels.attention_lse): CPU kernel against a
float64 reference (output, log-sum-exp, gradients through the kernel's backward given out and lse), which aten
op the CUDA path calls and in which dtype (on fake CUDA tensors), the NPU argument construction, and that
context-parallel attention reads nothing back to the host (fake tensors refuse data-dependent reads)."""

from __future__ import annotations

import pytest
import torch
from _cp_utils import packed_segments
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mm_parallel.context import SequenceLayout, context_parallel_attention
from mm_parallel.kernels.attention_lse import (
    NPU_CAUSAL_MASK_SIZE,
    CudaSdpa,
    attention_lse,
    attention_lse_backward,
    npu_fusion_arguments,
)


class _Record(TorchDispatchMode):
    """Names and tensor-argument dtypes of the aten ops called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append((str(func), [a.dtype for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))

    def attention_ops(self) -> list[tuple[str, list[torch.dtype]]]:
        return [c for c in self.calls if "attention" in c[0]]


def _reference(q, k, v, scale, causal, mask):  # type: ignore[no-untyped-def]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    n, m = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v), lse


@pytest.mark.parametrize("kind", ["causal", "full", "mask"])
def test_cpu_kernel_matches_float64_reference(kind):
    torch.manual_seed(0)
    b, h, kv, n, d, scale = 2, 4, 2, 24, 8, 0.3
    q, k, v = (torch.randn(b, heads, n, d) for heads in (h, kv, kv))
    mask = None
    if kind == "mask":
        seg = packed_segments(b, n, pad=3, seed=4)
        idx = torch.arange(n)
        mask = (
            (seg[:, :, None] == seg[:, None, :])
            & (idx[None, None] <= idx[None, :, None])
            & (seg >= 0)[:, None]
        )
        mask[0, 5] = False  # a row without any key: output 0, log-sum-exp -inf
    causal = kind == "causal"
    w = torch.randn(b, h, n, d)

    with _Record() as rec:
        out, lse = attention_lse(q, k, v, scale, causal, mask)
        grads = attention_lse_backward(w, q, k, v, out, lse, scale, causal, mask)
    names = [c[0] for c in rec.attention_ops()]
    assert names == [
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    ]

    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _reference(*ref_in, scale, causal, mask)
    (ref * w.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for name, mine, theirs in zip("qkv", grads, ref_in):
        assert mine.shape == theirs.shape, name  # grouped-query heads: dk/dv come back with kv heads
        torch.testing.assert_close(mine.double(), theirs.grad, rtol=1e-5, atol=1e-5, msg=name)
    if mask is not None:
        assert torch.all(out[0, :, 5] == 0) and torch.all(lse[0, :, 5] == float("-inf"))


def test_cpu_kernel_keeps_bf16():
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    with _Record() as rec:
        out, lse = attention_lse(q, k, v, 0.3, True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rec.attention_ops() == [
        ("aten._scaled_dot_product_flash_attention_for_cpu.default", [torch.bfloat16] * 3)
    ]


def _fake_cuda_block() -> tuple[torch.Tensor, ...]:
    """bf16 q [2, 8, 64, 64], k/v with 2 key/value heads and an all-true mask, on (fake) cuda."""
    q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    return q, k, v, torch.ones(2, 64, 64, dtype=torch.bool, device="cuda")


def test_cuda_path_calls_fused_sdpa_in_bf16():
    """On (fake) CUDA tensors: flash attention for bf16 without a mask (grouped-query heads unrepeated),
    memory-efficient attention with a mask; bf16 reaches both, forward and backward."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        q, k, v, mask = _fake_cuda_block()
        with _Record() as rec:
            out, lse = attention_lse(q, k, v, 0.1, True)
            dq, dk, dv = attention_lse_backward(out, q, k, v, out, lse, 0.1, True)
        ops = rec.attention_ops()
        assert [c[0] for c in ops] == [
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_flash_attention_backward.default",
        ]
        assert ops[0][1] == [torch.bfloat16] * 3 and ops[1][1][:5] == [torch.bfloat16] * 5
        assert out.dtype == torch.bfloat16 and out.device.type == "cuda" and lse.shape == (2, 8, 64)
        assert dk.shape == k.shape and dq.dtype == torch.bfloat16
        with _Record() as rec:
            out, lse = attention_lse(q, k, v, 0.1, False, mask)
            dq, dk, dv = attention_lse_backward(out, q, k, v, out, lse, 0.1, False, mask)
        ops = rec.attention_ops()
        assert [c[0] for c in ops] == [
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_efficient_attention_backward.default",
        ]
        assert ops[0][1][:3] == [torch.bfloat16] * 3 and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 64) and dk.shape == k.shape and dv.shape == v.shape


def test_cuda_masked_16bit_uses_cudnn_where_available():
    """With cuDNN attention available (fixed here: the choice is made from the device otherwise), a masked
    bf16 block runs cuDNN's fused attention and its backward with the additive bias, bf16 in; fp32 keeps the
    memory-efficient kernel and an unmasked bf16 block flash attention."""
    cuda = CudaSdpa(cudnn=True)
    with FakeTensorMode(allow_non_fake_inputs=False):
        q, k, v, mask = _fake_cuda_block()
        with _Record() as rec:
            out, lse = cuda.forward(q, k, v, 0.1, False, mask)
            dq, dk, dv = cuda.backward(out, q, k, v, out, lse, 0.1, False, mask)
        ops = rec.attention_ops()
        assert [c[0] for c in ops] == [
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._scaled_dot_product_cudnn_attention_backward.default",
        ]
        assert ops[0][1][:4] == [torch.bfloat16] * 4  # q, k, v and the bias
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 64)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dk.dtype == torch.bfloat16
        with _Record() as rec:
            cuda.forward(q.float(), k.float(), v.float(), 0.1, False, mask)
            cuda.forward(q, k, v, 0.1, True, None)
        assert [c[0] for c in rec.attention_ops()] == [
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_flash_attention.default",
        ]


def test_npu_arguments():
    """The documented npu_fusion_attention arguments (the call itself awaits an Ascend device)."""
    q = torch.randn(2, 6, 10, 8)
    args = npu_fusion_arguments(q, 0.25, True, None)
    assert args["head_num"] == 6 and args["input_layout"] == "BNSD" and args["keep_prob"] == 1.0
    assert args["scale"] == 0.25 and args["sparse_mode"] == 3
    causal_mask = args["atten_mask"]
    assert (
        causal_mask.shape == (NPU_CAUSAL_MASK_SIZE, NPU_CAUSAL_MASK_SIZE) and causal_mask.dtype == torch.bool
    )
    assert bool(causal_mask[0, 1]) and not bool(causal_mask[1, 0]) and not bool(causal_mask.diagonal().any())
    assert npu_fusion_arguments(q, 0.25, False, None)["atten_mask"] is None
    allowed = torch.rand(2, 10, 7) > 0.5
    args = npu_fusion_arguments(q, 0.25, False, allowed)
    assert args["sparse_mode"] == 0 and torch.equal(args["atten_mask"], ~allowed[:, None])  # True = masked
    with pytest.raises(ValueError, match="either causal or explicitly masked"):
        npu_fusion_arguments(q, 0.25, True, allowed)


@pytest.mark.parametrize("causal_only", [True, False])
def test_attention_reads_nothing_back_to_the_host(causal_only):
    """Forward and backward on fake tensors, which raise on any data-dependent host read (``bool(t)``,
    ``.item()``, ``.tolist()``); once the layout knows whether it is plain causal, none happens."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        segments = torch.zeros(2, 32, dtype=torch.long)
        q = torch.randn(2, 4, 32, 8, requires_grad=True)
        k = torch.randn(2, 2, 32, 8, requires_grad=True)
        v = torch.randn(2, 2, 32, 8, requires_grad=True)
        layout = SequenceLayout(segments, 1, 0, 1, 0, causal_only=causal_only)
        out = context_parallel_attention(q, k, v, layout, 0.3, tile=8)
        out.sum().backward()
        assert q.grad is not None and k.grad is not None and k.grad.shape == k.shape
        unknown = SequenceLayout(segments, 1, 0, 1, 0)
        with pytest.raises(DataDependentOutputException):
            unknown.is_causal_only()  # the one read per micro-batch, which fake tensors refuse
