"""The kernel table (mm_parallel.kernels): every entry's interface against its torch definition on CPU, and
the CUDA varlen entry's dispatch under FakeTensorMode.

The ``npu`` entries run here against a stand-in ``torch_npu`` (``_npu_emulation``: each operator they call,
written in plain torch after torch_npu's documentation and strict about arguments and layouts), installed in
``sys.modules`` for one test only. That checks mm's calls against the documented semantics (argument layout,
transposes, cumulative versus per-group counts, the TND packing, mask conventions) and each entry's values and
gradients against the torch entry; Ascend's kernels themselves, their rounding and speed, await a device."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from _npu_emulation import Refused, torch_npu_stand_in
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


def _documents() -> tuple[list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """4 documents in TND layout (fp64, grouped-query heads 4 over 2, with grad): their lengths, q/k/v and
    the cumulative lengths."""
    torch.manual_seed(0)
    lengths = [5, 1, 7, 3]
    total = sum(lengths)
    q = torch.randn(total, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    return lengths, (q, k, v), cu


@pytest.mark.parametrize("window", [None, 3])
def test_per_document_attention_matches_the_block_diagonal_mask(window: int | None) -> None:
    lengths, (q, k, v), cu = _documents()
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


@pytest.fixture
def torch_npu(monkeypatch: pytest.MonkeyPatch) -> object:
    """The stand-in ``torch_npu`` (documented semantics in plain torch), importable for this test only."""
    module = torch_npu_stand_in()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_grouped_mm_matches_torch_with_gradients(torch_npu: object, dtype: torch.dtype) -> None:
    """Forward and both gradients through the autograd function: rows grouped (group_type 0) for the output
    and dx, the token axis grouped (group_type 2, x transposed) for dW, cumulative int64 offsets always."""
    torch.manual_seed(0)
    x = torch.randn(13, 16).to(dtype).requires_grad_()
    w = torch.randn(4, 8, 16).to(dtype)  # [experts, out, in]: the entry gets the transposed view
    w.requires_grad_()
    offsets = torch.tensor([5, 5, 9, 13], dtype=torch.int32)  # the second expert gets no row
    dy = torch.randn(13, 8).to(dtype)
    got = kernel("grouped_mm", "npu")(x, w.transpose(1, 2), offsets)
    gx, gw = torch.autograd.grad(got, (x, w), dy)
    ref = grouped_mm_reference(x, w.transpose(1, 2), offsets)
    rx, rw = torch.autograd.grad(ref, (x, w), dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in ((got, ref), (gx, rx), (gw, rw)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
    assert torch.count_nonzero(gw[1]) == 0
    calls = torch_npu.calls  # type: ignore[attr-defined]
    assert [c["group_type"] for c in calls] == [0, 0, 2] and {c["group_list_type"] for c in calls} == {0}
    # only the needed gradient is computed
    x2 = x.detach().requires_grad_()
    (gx_only,) = torch.autograd.grad(
        kernel("grouped_mm", "npu")(x2, w.detach().transpose(1, 2), offsets), x2, dy
    )
    assert torch.allclose(gx_only.float(), rx.float(), atol=tol, rtol=tol)
    assert [c["group_type"] for c in calls[3:]] == [0, 0]


def test_npu_stand_in_refuses_undocumented_calls(torch_npu: object) -> None:
    """The stand-in is strict: per-group counts called cumulative, an untransposed x for k-grouping, a mask
    other than the compressed one, a host tensor for the sequence lengths."""
    gmm = torch_npu.npu_grouped_matmul  # type: ignore[attr-defined]
    x, w = torch.randn(6, 4), torch.randn(2, 4, 3)
    counts = torch.tensor([2, 4])
    with pytest.raises(Refused, match="last value 4 must be 6"):
        gmm([x], [w], group_list=counts, split_item=3, group_type=0, group_list_type=0)
    assert gmm([x], [w], group_list=counts, split_item=3, group_type=0, group_list_type=1)[0].shape == (6, 3)
    with pytest.raises(Refused, match="must be transposed"):
        gmm(
            [x.t().contiguous()], [torch.randn(6, 3)], group_list=counts.cumsum(0), split_item=3, group_type=2
        )
    with pytest.raises(Refused, match="group_list"):
        gmm([x], [w], group_list=[2, 6], split_item=3, group_type=0)
    fa = torch_npu.npu_fusion_attention  # type: ignore[attr-defined]
    q = torch.randn(6, 2, 8)
    ones = torch.ones(2048, 2048, dtype=torch.bool)
    with pytest.raises(Refused, match="triu"):
        fa(
            q,
            q,
            q,
            2,
            "TND",
            atten_mask=ones.tril(),
            actual_seq_qlen=[6],
            actual_seq_kvlen=[6],
            sparse_mode=3,
        )
    with pytest.raises(Refused, match="cumulative"):
        fa(
            q,
            q,
            q,
            2,
            "TND",
            atten_mask=ones.triu(1),
            actual_seq_qlen=[4, 2],
            actual_seq_kvlen=[4, 2],
            sparse_mode=3,
        )
    with pytest.raises(Refused, match="host list"):
        fa(
            q,
            q,
            q,
            2,
            "TND",
            atten_mask=ones.triu(1),
            actual_seq_qlen=torch.tensor([6]),
            actual_seq_kvlen=[6],
            sparse_mode=3,
        )
    with pytest.raises(Refused, match="gamma"):
        torch_npu.npu_rms_norm(torch.randn(2, 4), torch.ones(4, dtype=torch.float64))  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_rms_norm_matches_torch(torch_npu: object, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64).to(dtype).requires_grad_()
    weight = torch.randn(64).to(dtype)
    got = kernel("rms_norm", "npu")(x, weight, 1e-6)
    ref = kernel("rms_norm", "cpu")(x, weight, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert got.dtype == ref.dtype == dtype and torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (rx,) = torch.autograd.grad(ref.sum(), x)
    assert torch.allclose(gx.float(), rx.float(), atol=tol * 10, rtol=tol * 10)
    assert torch_npu.calls == [{"op": "npu_rms_norm", "epsilon": 1e-6}] * 1  # type: ignore[attr-defined]
    # an fp32 weight on bf16 inputs: the result has the dtype the formula promotes to
    mixed = kernel("rms_norm", "npu")(x.detach().bfloat16(), weight.float(), 1e-6)
    assert mixed.dtype == kernel("rms_norm", "cpu")(x.detach().bfloat16(), weight.float(), 1e-6).dtype


def test_npu_rotary_matches_torch(torch_npu: object) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8, requires_grad=True)
    angle = torch.randn(2, 1, 7, 4)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # B1SD for BNSD
    got = kernel("rotary", "npu")(x, cos, sin)
    ref = kernel("rotary", "cpu")(x, cos, sin)
    assert torch.equal(got, ref)
    assert torch.equal(*(torch.autograd.grad(t.sin().sum(), x)[0] for t in (got, ref)))
    assert torch_npu.calls == [{"op": "npu_rotary_mul", "rotary_mode": "half"}]  # type: ignore[attr-defined]


@pytest.mark.parametrize("window", [None, 3])
def test_npu_varlen_attention_matches_per_document_attention(torch_npu: object, window: int | None) -> None:
    """TND packing, cumulative actual_seq_qlen/kvlen, sparse_mode 3 (causal) or 4 (band) with the compressed
    mask, the scale, grouped-query heads: values and gradients equal the CPU entry's."""
    _, (q, k, v), cu = _documents()
    for scale in (None, 0.3):
        got = kernel("varlen_attention", "npu")(q, k, v, cu, 7, scale=scale, window=window)
        ref = kernel("varlen_attention", "cpu")(q, k, v, cu, 7, scale=scale, window=window)
        assert torch.allclose(got, ref, atol=1e-10)
        for a, b in zip(
            torch.autograd.grad(got.sin().sum(), (q, k, v)), torch.autograd.grad(ref.sin().sum(), (q, k, v))
        ):
            assert torch.allclose(a, b, atol=1e-10)
    calls = torch_npu.calls  # type: ignore[attr-defined]
    assert [c["sparse_mode"] for c in calls] == [3 if window is None else 4] * 2
    assert calls[0]["scale"] == 8**-0.5 and calls[1]["scale"] == 0.3


def test_expert_mlp_takes_the_fused_entry_without_a_host_sync(
    torch_npu: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mm's expert MLP on a device type whose table entry is fused: the grouped product with cumulative
    offsets on the device, no host read of the counts; values and gradients equal the loop's. A CPU tensor
    cannot report the device type npu, so the choice (``fused_grouped_mm``, checked on its own) is given
    the npu entry for "cpu" here."""
    from mm_parallel.moe import expert_mlp, grouped_linear, tokens_per_expert
    from mm_parallel.moe import grouped as grouped_module

    assert grouped_module.fused_grouped_mm("npu") is grouped_mm_module.npu_grouped_mm
    assert grouped_module.fused_grouped_mm("cpu") is None and grouped_module.fused_grouped_mm("cuda") is None
    torch.manual_seed(0)
    counts = tokens_per_expert(torch.tensor([0, 2, 2, 3, 0, 3, 3, 2, 0]), 4)  # expert 1 gets no row
    x = torch.randn(9, 16, requires_grad=True)
    gate_up = torch.randn(4, 2 * 8, 16, requires_grad=True)  # [experts, 2 * inter, hidden]
    down = torch.randn(4, 16, 8, requires_grad=True)

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def run(**kw: object) -> list[torch.Tensor]:
        y = expert_mlp(x, gate_up, down, counts, glu, **kw)  # type: ignore[arg-type]
        return [y, *torch.autograd.grad(y.sin().sum(), (x, gate_up, down))]

    ref = run(use_grouped_mm=False)  # the loop
    monkeypatch.setattr(
        grouped_module, "fused_grouped_mm", lambda device_type: grouped_mm_module.npu_grouped_mm
    )

    def no_host_read(counts: torch.Tensor) -> list[int]:
        raise AssertionError("the fused path read the counts on the host")

    monkeypatch.setattr(grouped_module, "read_once", no_host_read)
    got = run()
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)
    calls = torch_npu.calls  # type: ignore[attr-defined]
    assert [c["group_type"] for c in calls] == [0, 0, 0, 2, 0, 2]  # two products, then their backwards
    assert torch.equal(calls[0]["weight"], gate_up.detach().transpose(1, 2))  # [experts, in, out] views
    assert grouped_linear(x, gate_up, counts, use_grouped_mm=False, host_counts=[3, 0, 3, 3]).shape == (9, 16)
