"""A stand-in ``torch_npu`` for CPU tests: the operators mm's kernel table calls, written in plain torch after
their documented semantics, strict about the arguments and layouts mm may pass.

It checks mm's *calls* (argument names, transposes, cumulative versus per-group counts, the TND packing, the
mask conventions) against what the documentation promises, not Ascend's kernels: those await a device. Every
operator raises on an argument, layout or dtype outside the documented case it emulates, so a call of mm that
the real operator would refuse (or read differently) fails here too. Sources (torch_npu's op-plugin
documentation, https://gitcode.com/Ascend/op-plugin, ``docs/context/``, mirrored on hiascend.com):

- ``torch_npu-npu_grouped_matmul.md``: ``npu_grouped_matmul(x, weight, *, bias=None, ..., group_list=None,
  ..., split_item=0, group_type=-1, group_list_type=0, act_type=0, output_dtype=None, ...)``; non-quantized
  ``y_i = x_i @ weight_i``; ``group_list`` a 1-D int64 tensor, cumulative (``group_list_type=0``) or per-group
  (``1``) sizes of the grouped axis; ``group_type`` 0 groups m (``x`` 2-D untransposed, ``weight`` one 3-D
  tensor ``[g, k, n]`` that may be a transposed view, ``y`` 2-D), 2 groups k (``x`` 2-D and transposed,
  ``weight`` 2-D untransposed, ``y`` 3-D ``[g, m, n]``); ``split_item`` 2/3 for a single output tensor.
- ``torch_npu-npu_rms_norm.md``: ``npu_rms_norm(self, gamma, epsilon=1e-06) -> (Tensor, Tensor)``, ``y =
  x / sqrt(mean(x^2) + eps) * gamma`` and the reciprocal RMS; ``gamma`` of ``self``'s dtype.
- ``torch_npu-npu_rotary_mul.md``: ``npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``, half mode
  ``r1 * x + r2 * cat(-x2, x1)``; 4-D tensors, ``r1``/``r2`` broadcast as 11SD/B1SD/BNSD (BNSD input),
  1S1D/BS1D/BSND (BSND) or S11D/SB1D/SBND (SBND).
- ``torch_npu-npu_fusion_attention.md``: ``npu_fusion_attention(query, key, value, head_num, input_layout,
  pse=None, padding_mask=None, atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
  next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
  sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="")`` returning 7 values (output,
  softmax max, softmax sum, a reserved tensor, seed, offset, mask length); ``atten_mask`` True = masked; TND
  ("varlen") with ``actual_seq_qlen``/``actual_seq_kvlen`` the *cumulative* lengths (``2 2 2`` -> ``2 4 6``);
  ``sparse_mode`` 3 (rightDownCausal) and 4 (band, ``pre_tockens``/``next_tockens`` from the bottom-right
  corner) with the compressed 2048 x 2048 ``triu(1)`` mask; grouped-query heads when ``Nq / Nkv`` is whole.
  Only the TND layout is emulated (the one the varlen entry uses).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: the compressed causal mask of sparse modes 2-4 (torch_npu-npu_fusion_attention.md): 2048 x 2048, triu(1)
MASK_SIZE = 2048


class Refused(ValueError):
    """A call outside the documented case the stand-in emulates."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise Refused(message)


def _transposed(t: torch.Tensor) -> bool:
    """A 2-D (or batched) tensor stored with its last two axes swapped (the documentation's "转置")."""
    return t.dim() >= 2 and not t.is_contiguous() and t.transpose(-2, -1).is_contiguous()


def _sizes(group_list: torch.Tensor, group_list_type: int, total: int) -> list[int]:
    """Per-group sizes of the grouped axis from ``group_list`` (cumulative or per group), checked."""
    _require(
        isinstance(group_list, torch.Tensor) and group_list.dim() == 1 and group_list.dtype == torch.int64,
        "group_list: a 1-D int64 tensor (the tensor form, which group_type needs)",
    )
    values = [int(v) for v in group_list.tolist()]
    _require(all(v >= 0 for v in values), f"group_list must be non-negative, got {values}")
    if group_list_type == 0:
        _require(values == sorted(values), f"group_list_type=0 takes a non-decreasing cumsum, got {values}")
        _require(values[-1] == total, f"group_list_type=0: the last value {values[-1]} must be {total}")
        return [b - a for a, b in zip([0, *values[:-1]], values)]
    _require(group_list_type == 1, f"group_list_type {group_list_type} (2 is for int8 only)")
    _require(sum(values) == total, f"group_list_type=1: the sizes sum to {sum(values)}, not {total}")
    return values


def _grouped_matmul(record: list[dict[str, Any]]) -> Any:
    def npu_grouped_matmul(
        x: Sequence[torch.Tensor],
        weight: Sequence[torch.Tensor],
        *,
        bias: Any = None,
        scale: Any = None,
        offset: Any = None,
        antiquant_scale: Any = None,
        antiquant_offset: Any = None,
        per_token_scale: Any = None,
        group_list: Any = None,
        activation_input: Any = None,
        activation_quant_scale: Any = None,
        activation_quant_offset: Any = None,
        split_item: int = 0,
        group_type: int | None = -1,
        group_list_type: int = 0,
        act_type: int = 0,
        output_dtype: torch.dtype | None = None,
        tuning_config: Any = None,
    ) -> list[torch.Tensor]:
        quant = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input)
        _require(all(q is None for q in quant), "only the non-quantized case is emulated")
        _require(activation_quant_scale is None and activation_quant_offset is None, "reserved arguments")
        _require(bias is None and act_type == 0 and tuning_config is None, "no bias / activation here")
        _require(len(x) == 1 and len(weight) == 1, "the single-tensor case: one x and one weight")
        _require(split_item in (2, 3), f"one output tensor needs split_item 2 or 3, got {split_item}")
        a, b = x[0], weight[0]
        _require(a.dtype == b.dtype and a.dtype in FLOATS[:3], f"x/weight dtypes {a.dtype}, {b.dtype}")
        _require(output_dtype in (None, a.dtype), f"output_dtype {output_dtype} for {a.dtype} inputs")
        _require(a.dim() == 2, f"x must be 2-D, got {tuple(a.shape)}")
        record.append({"group_type": group_type, "group_list_type": group_list_type, "x": a, "weight": b})
        if group_type == 0:  # m grouped: x [m, k] untransposed, weight [g, k, n], y [m, n]
            _require(not _transposed(a) and a.is_contiguous(), "group_type 0: x must not be transposed")
            _require(b.dim() == 3 and b.shape[1] == a.shape[1], f"weight [g, k, n] for x {tuple(a.shape)}")
            sizes = _sizes(group_list, group_list_type, a.shape[0])
            _require(len(sizes) == b.shape[0] <= 1024, "one group_list entry per weight (<= 1024)")
            rows = torch.split(a, sizes, dim=0)
            return [torch.cat([r @ b[e] for e, r in enumerate(rows)], dim=0)]
        if group_type == 2:  # k grouped: x [m, k] transposed, weight [k, n] untransposed, y [g, m, n]
            _require(_transposed(a), "group_type 2: x must be transposed")
            _require(b.dim() == 2 and b.is_contiguous(), "group_type 2: weight 2-D and not transposed")
            _require(b.shape[0] == a.shape[1], f"k of x {tuple(a.shape)} and weight {tuple(b.shape)}")
            sizes = _sizes(group_list, group_list_type, a.shape[1])
            _require(len(sizes) <= 1024, "at most 1024 groups")
            parts = zip(torch.split(a, sizes, dim=1), torch.split(b, sizes, dim=0))
            return [torch.stack([xa @ wb for xa, wb in parts])]
        raise Refused(f"group_type {group_type}: only 0 (m) and 2 (k) are emulated")

    return npu_grouped_matmul


def _rms_norm(record: list[dict[str, Any]]) -> Any:
    def npu_rms_norm(
        self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _require(self.dtype in FLOATS[:3], f"dtype {self.dtype}: float16, bfloat16 or float32")
        _require(gamma.dtype == self.dtype, f"gamma {gamma.dtype} must have the input's dtype {self.dtype}")
        _require(
            gamma.dim() <= self.dim() and tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim() :]),
            f"gamma {tuple(gamma.shape)} must match the last dims of {tuple(self.shape)}",
        )
        record.append({"op": "npu_rms_norm", "epsilon": epsilon})
        dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
        h = self.to(torch.float32)
        rstd = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + epsilon)
        return (h * rstd * gamma.to(torch.float32)).to(self.dtype), rstd

    return npu_rms_norm


def _rotary_mul(record: list[dict[str, Any]]) -> Any:
    def npu_rotary_mul(
        input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
    ) -> torch.Tensor:
        _require(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}")
        _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "input, r1 and r2 must be 4-D")
        _require(r1.shape == r2.shape, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
        _require(input.dtype in FLOATS[:3] and r1.dtype == r2.dtype == input.dtype, "one float dtype")
        b, n, s, d = input.shape
        _require(d % 2 == 0, f"D must be even, got {d}")
        layouts = {(1, 1, s, d), (b, 1, s, d), (b, n, s, d), (1, n, 1, d), (b, n, 1, d), (b, 1, 1, d)}
        _require(tuple(r1.shape) in layouts, f"r1/r2 {tuple(r1.shape)} do not broadcast as documented")
        record.append({"op": "npu_rotary_mul", "rotary_mode": rotary_mode})
        if rotary_mode == "half":
            x1, x2 = torch.chunk(input, 2, -1)
            x_new = torch.cat((-x2, x1), dim=-1)
        else:
            x_new = torch.stack((-input[..., 1::2], input[..., ::2]), dim=-1).flatten(-2)
        return r1 * input + r2 * x_new

    return npu_rotary_mul


def _cumulative(name: str, lengths: Any, total: int) -> list[int]:
    _require(
        isinstance(lengths, (list, tuple)) and all(isinstance(v, int) for v in lengths),
        f"{name}: a host list of ints (cumulative lengths), got {type(lengths).__name__}",
    )
    values = list(lengths)
    _require(1 <= len(values) <= 1024, f"{name}: 1 to 1024 batches")
    _require(values == sorted(values) and values[0] >= 0, f"{name} must be cumulative, got {values}")
    _require(values[-1] == total, f"{name} ends at {values[-1]}, the tensors hold {total} tokens")
    return [b - a for a, b in zip([0, *values[:-1]], values)]


def _fusion_attention(record: list[dict[str, Any]]) -> Any:
    def npu_fusion_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        head_num: int,
        input_layout: str,
        pse: Any = None,
        padding_mask: Any = None,
        atten_mask: torch.Tensor | None = None,
        scale: float = 1.0,
        keep_prob: float = 1.0,
        pre_tockens: int = 2147483647,
        next_tockens: int = 2147483647,
        inner_precise: int = 0,
        prefix: Any = None,
        actual_seq_qlen: Any = None,
        actual_seq_kvlen: Any = None,
        sparse_mode: int = 0,
        gen_mask_parallel: bool = True,
        sync: bool = False,
        softmax_layout: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
        _require(input_layout == "TND", f"only the TND (varlen) layout is emulated, got {input_layout!r}")
        _require(pse is None and padding_mask is None and prefix is None, "no pse / padding_mask / prefix")
        _require(keep_prob == 1.0, "dropout (keep_prob < 1) is not emulated")
        _require(query.dtype in FLOATS and key.dtype == value.dtype == query.dtype, "one float dtype")
        _require(query.dim() == key.dim() == value.dim() == 3, "TND takes [T, N, D] tensors")
        _require(key.shape == value.shape, "key and value shapes must match")
        t, nq, d = query.shape
        nkv = key.shape[1]
        _require(head_num == nq, f"head_num {head_num} must be the query's N {nq}")
        _require(nq % nkv == 0, f"Nq {nq} must be a whole multiple of Nkv {nkv}")
        _require(key.shape[2] == d, "Dq must equal Dk")
        q_lens = _cumulative("actual_seq_qlen", actual_seq_qlen, t)
        kv_lens = _cumulative("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
        _require(len(q_lens) == len(kv_lens), "actual_seq_qlen and actual_seq_kvlen name the same batches")
        if sparse_mode in (2, 3, 4):
            _require(atten_mask is not None and atten_mask.dtype == torch.bool, "a bool compressed mask")
            assert atten_mask is not None
            expected = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device).triu(1)
            _require(torch.equal(atten_mask, expected), "sparse modes 2-4 take the 2048 x 2048 triu(1) mask")
        else:
            _require(sparse_mode == 0 and atten_mask is None, f"sparse_mode {sparse_mode} is not emulated")
        record.append({"op": "npu_fusion_attention", "sparse_mode": sparse_mode, "scale": scale})
        outs = []
        q_start = kv_start = 0
        for sq, skv in zip(q_lens, kv_lens):
            q = query[q_start : q_start + sq].transpose(0, 1)  # [N, Sq, D]
            k = key[kv_start : kv_start + skv].transpose(0, 1).repeat_interleave(nq // nkv, 0)
            v = value[kv_start : kv_start + skv].transpose(0, 1).repeat_interleave(nq // nkv, 0)
            # positions from the bottom-right corner: key j against query i at offset j - i - (Skv - Sq)
            i = torch.arange(sq, device=query.device)[:, None]
            j = torch.arange(skv, device=query.device)[None, :]
            offset = j - i - (skv - sq)
            if sparse_mode == 3:  # rightDownCausal (pre/next ignored)
                allowed = offset <= 0
            elif sparse_mode == 4:  # band between pre_tockens and next_tockens
                allowed = (offset >= -pre_tockens) & (offset <= next_tockens)
            elif sparse_mode == 2:  # leftUpCausal
                allowed = j <= i
            else:
                allowed = torch.ones(sq, skv, dtype=torch.bool, device=query.device)
            scores = (q @ k.transpose(-2, -1)) * scale
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            outs.append((probs @ v).transpose(0, 1))
            q_start, kv_start = q_start + sq, kv_start + skv
        out = torch.cat(outs, dim=0)
        empty = query.new_zeros(0)
        return out, empty, empty, empty, 0, 0, 0

    return npu_fusion_attention


def torch_npu_stand_in() -> types.ModuleType:
    """A fresh stand-in module; ``module.calls`` records every call's arguments of interest."""
    module = types.ModuleType("torch_npu", "stand-in torch_npu (documented semantics in plain torch)")
    calls: list[dict[str, Any]] = []
    module.calls = calls  # type: ignore[attr-defined]
    module.npu_grouped_matmul = _grouped_matmul(calls)  # type: ignore[attr-defined]
    module.npu_rms_norm = _rms_norm(calls)  # type: ignore[attr-defined]
    module.npu_rotary_mul = _rotary_mul(calls)  # type: ignore[attr-defined]
    module.npu_fusion_attention = _fusion_attention(calls)  # type: ignore[attr-defined]
    return module
