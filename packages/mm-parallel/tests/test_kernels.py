"""The kernel table (mm_parallel.kernels): every entry's interface against its torch definition on CPU, and
the CUDA varlen entry's dispatch under FakeTensorMode (the device kernels themselves await a device)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mm_parallel.kernels import DEFAULT, KERNELS, kernel, norm, rotary, varlen
from mm_parallel.kernels import grouped_mm as grouped_mm_module
from mm_parallel.kernels.grouped_mm import grouped_mm_reference


class _Ops(TorchDispatchMode):
    """Records the name of every operator that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_table_picks_per_device_type() -> None:
    assert set(KERNELS) == {"varlen_attention", "rms_norm", "rotary", "grouped_mm", "attention_lse"}
    assert kernel("varlen_attention", "cuda") is varlen.cuda_varlen_attention
    assert kernel("varlen_attention", "npu") is varlen.npu_varlen_attention
    assert kernel("varlen_attention", "cpu") is varlen.per_document_attention
    assert kernel("rms_norm", "npu") is norm.npu_rms_norm
    assert kernel("rms_norm", "cuda") is norm.rms_norm is kernel("rms_norm", "cpu")
    assert kernel("rotary", "npu") is rotary.npu_rotary and kernel("rotary", "cpu") is rotary.rotary
    assert kernel("grouped_mm", "npu") is grouped_mm_module.npu_grouped_mm
    assert kernel("grouped_mm", "cpu") is grouped_mm_module.grouped_mm
    assert all(DEFAULT in entries for entries in KERNELS.values())
    with pytest.raises(KeyError, match="no kernel 'layer_norm'"):
        kernel("layer_norm", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_decoders_formula_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(3, 5, 64).to(dtype), torch.randn(64).to(dtype)
    h = x.to(torch.float32)
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(kernel("rms_norm", "cpu")(x, weight, 1e-6), expected)


def test_rotary_is_a_rotation_of_each_half_pair() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    angle = torch.randn(2, 1, 7, 4, dtype=torch.float64)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    got = kernel("rotary", "cpu")(x, cos, sin)
    # the pair (x[i], x[i + half]) as the complex number x[i] + j x[i + half], turned by the angle
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)
    assert torch.allclose(got, torch.cat([z.real, z.imag], -1), atol=1e-12)


@pytest.mark.parametrize("out", [8, 5])  # 5 fp32 columns are not 16-byte rows: the loop runs
def test_grouped_mm_matches_one_matmul_per_expert_with_gradients(out: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(11, 8, requires_grad=True)
    w = torch.randn(3, 8, out, requires_grad=True)
    offsets = torch.tensor([4, 4, 11], dtype=torch.int32)  # the second expert gets no row
    got = kernel("grouped_mm", "cpu")(x, w, offsets)
    gx, gw = torch.autograd.grad(got.square().sum(), (x, w))
    ref = grouped_mm_reference(x, w, offsets)
    rx, rw = torch.autograd.grad(ref.square().sum(), (x, w))
    for a, b in ((got, ref), (gx, rx), (gw, rw)):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.count_nonzero(gw[1]) == 0
    with pytest.raises(ValueError, match="offsets"):
        kernel("grouped_mm", "cpu")(x, w, offsets[:2])


def _dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], window: int | None
) -> torch.Tensor:
    """Attention over all tokens with the block-diagonal causal mask written out (the definition)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(q.shape[0])
    back = i[:, None] - i[None, :]
    mask = (doc[:, None] == doc[None, :]) & (back >= 0)
    if window is not None:
        mask &= back < window
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


@pytest.mark.parametrize("window", [None, 3])
def test_per_document_attention_matches_the_block_diagonal_mask(window: int | None) -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 7, 3]
    total = sum(lengths)
    q = torch.randn(total, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    run = kernel("varlen_attention", "cpu")
    got = run(q, k, v, cu, 7, window=window)
    assert got.shape == q.shape
    grads = torch.autograd.grad(got.sin().sum(), (q, k, v))
    ref = _dense_reference(q, k, v, lengths, window)
    ref_grads = torch.autograd.grad(ref.sin().sum(), (q, k, v))
    assert torch.allclose(got, ref, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10)
    # host lengths given: the same result without reading cu_seqlens
    assert torch.allclose(run(q, k, v, cu, 7, lengths=lengths, window=window), ref, atol=1e-10)
    with pytest.raises(ValueError, match="sum to 15"):
        run(q, k, v, cu, 7, lengths=[5, 1, 7, 2])


def test_cuda_entry_runs_torch_varlen_kernel_under_fake_tensors() -> None:
    with FakeTensorMode():
        q = torch.empty(16, 4, 8, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(16, 2, 8, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32, device="cuda")
        with _Ops() as ops:
            out = kernel("varlen_attention", "cuda")(q, kv, kv, cu, 7, scale=0.3)
    assert out.shape == (16, 4, 8) and out.device.type == "cuda"
    assert "torch_attn._varlen_attn.default" in ops.ops
    assert not [op for op in ops.ops if "scaled_dot_product" in op]


def test_npu_entries_need_torch_npu_only_when_called() -> None:
    x = torch.randn(2, 4)
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="torch_npu"):
            kernel("rms_norm", "npu")(x, torch.ones(4), 1e-6)
    else:
        pytest.skip("torch_npu is installed here")
    assert torch.equal(kernel("rms_norm", "cpu")(x, torch.ones(4), 1e-6), F.rms_norm(x, (4,), eps=1e-6))
