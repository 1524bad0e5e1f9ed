"""mm's document-aware attention (mm_core.models.varlen, ``model.attn_implementation: mm_varlen`` / ``auto``)
on a tiny Qwen3: packed and padded rows against each document run alone (per-token losses and gradients,
fp32, forward and backward on CPU), no sequence-sized mask, and the CUDA kernel chosen under FakeTensorMode;
plus the RMSNorm kernel switch and the Ascend peaks of ``mfu``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny import QWEN3
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3VLForConditionalGeneration
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mm_core.models.device_kernels import use_device_kernels
from mm_core.models.varlen import (
    LENGTHS_KWARG,
    ROWS_KWARG,
    VARLEN_ATTENTION,
    auto_applies,
    document_kwargs,
    document_lengths,
    one_document_rows,
    resolve_attn_implementation,
)
from mm_core.train.flops import peak_tflops

DOCS = (5, 9, 4)


def _model(attn: str = "auto") -> Qwen3ForCausalLM:
    config = Qwen3Config(**QWEN3)
    torch.manual_seed(0)
    name = resolve_attn_implementation(attn, Qwen3ForCausalLM, config)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation=name, dtype=torch.float32)
    return model


def _documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, QWEN3["vocab_size"], (n,), generator=g) for n in DOCS]


def _token_losses(model: Qwen3ForCausalLM, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token loss of every position of every row (``[batch, seq - 1]``)."""
    logits = model(**batch).logits
    targets = batch["input_ids"][:, 1:]
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
    return losses


def _alone(
    model: Qwen3ForCausalLM, docs: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token losses of each document run alone and the gradients of their sum."""
    model.zero_grad()
    losses = [_token_losses(model, {"input_ids": d[None]})[0] for d in docs]
    torch.stack([x.sum() for x in losses]).sum().backward()
    return losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("with_kwargs", [True, False], ids=["collated", "from_position_ids"])
def test_packed_row_equals_each_document_alone(with_kwargs: bool) -> None:
    model = _model()
    assert model.config._attn_implementation == VARLEN_ATTENTION  # auto picks it for a text causal LM
    docs = _documents()
    ref_losses, ref_grads = _alone(model, docs)

    batch: dict[str, Any] = {
        "input_ids": torch.cat(docs)[None],
        "position_ids": torch.cat([torch.arange(n) for n in DOCS])[None],
    }
    if with_kwargs:
        batch.update(document_kwargs(batch))
        assert batch[LENGTHS_KWARG] == DOCS and batch["max_length_q"] == max(DOCS)
        assert batch["cu_seq_lens_q"].tolist() == [0, 5, 14, 18]
    model.zero_grad()
    losses = _token_losses(model, batch)[0]
    starts = [0, 5, 14]
    # positions predicting inside their own document (a document's last token predicts the next one's first)
    picked = [losses[s : s + n - 1] for s, n in zip(starts, DOCS)]
    torch.stack([x.sum() for x in picked]).sum().backward()
    for got, ref in zip(picked, ref_losses):
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
    for p, ref in zip(model.parameters(), ref_grads):
        assert torch.allclose(p.grad, ref, atol=1e-5, rtol=0), (p.grad - ref).abs().max()


def test_sdpa_without_documents_mixes_them() -> None:
    """The check above can fail: plain causal attention over the packed row (no documents) differs."""
    model = _model("sdpa")
    docs = _documents()
    ref_losses, _ = _alone(model, docs)
    losses = _token_losses(model, {"input_ids": torch.cat(docs)[None]})[0]
    assert not torch.allclose(losses[5:13], ref_losses[1], atol=1e-3)


class _Ops(TorchDispatchMode):
    """Records the name of every operator that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_equal_each_document_alone(side: str) -> None:
    """Right padding through the collated kwargs; left padding from the 2-D mask inside the model."""
    model = _model()
    docs = _documents()
    ref_losses, ref_grads = _alone(model, docs)
    width = max(DOCS)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    pos = torch.zeros(len(docs), width, dtype=torch.long)
    spans = []
    for row, d in enumerate(docs):
        lo = 0 if side == "right" else width - len(d)
        spans.append(slice(lo, lo + len(d) - 1))
        ids[row, lo : lo + len(d)], mask[row, lo : lo + len(d)] = d, 1
        pos[row, lo : lo + len(d)] = torch.arange(len(d))
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    if side == "right":
        batch.update(document_kwargs(batch))
        assert batch[LENGTHS_KWARG] == (5, 4, 9, 4, 5)  # each padding run is a document of its own
        assert batch[ROWS_KWARG] is True  # one document per row, then padding: one causal SDPA on CPU
    model.zero_grad()
    with _Ops() as calls:
        losses = _token_losses(model, batch)
    # right: one SDPA per layer over the batch; left: one per document and padding run (5 per layer)
    per_layer = 1 if side == "right" else 5
    sdpa = calls.ops.count("aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert sdpa == per_layer * QWEN3["num_hidden_layers"]
    picked = [losses[row, span] for row, span in enumerate(spans)]
    torch.stack([x.sum() for x in picked]).sum().backward()
    for got, ref in zip(picked, ref_losses):
        assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    for p, ref in zip(model.parameters(), ref_grads):
        assert torch.allclose(p.grad, ref, atol=1e-5, rtol=0)


def test_whole_rows_are_the_sdpa_call_bit_for_bit() -> None:
    ids = torch.randint(0, QWEN3["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    ours, sdpa = _model(), _model("sdpa")
    batch: dict[str, Any] = {"input_ids": ids}
    batch.update(document_kwargs(batch))
    assert torch.equal(ours(**batch).logits, sdpa(input_ids=ids).logits)


def test_document_rules() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 0, 1]])
    assert document_lengths(pos, None, 2, 6) == [3, 2, 1, 4, 2]
    # multi-axis rope positions [3, batch, seq]: a document starts where every axis is 0
    rope = torch.stack([pos[:1], pos[:1] * 0 + torch.tensor([[0, 1, 1, 0, 2, 0]]), pos[:1]])
    assert document_lengths(rope, None, 1, 6) == [3, 2, 1]
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1]])
    assert document_lengths(None, left_padded, 1, 6) == [2, 4]
    with pytest.raises(ValueError, match="padding between tokens"):
        document_lengths(None, torch.tensor([[1, 1, 0, 1, 0, 0]]), 1, 6)
    # one document per row from its first column, then padding: the one-SDPA case on CPU
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert one_document_rows(None, right) and one_document_rows(torch.tensor([[0, 1, 2, 3]] * 2), right)
    assert not one_document_rows(torch.tensor([[0, 1, 0, 0], [0, 1, 2, 3]]), right)  # two documents in row 0
    assert not one_document_rows(None, left_padded)
    assert not one_document_rows(None, torch.tensor([[1, 1, 0, 1]]))
    assert not one_document_rows(pos, None)  # no mask: packed rows go by their lengths


def test_the_mask_step_builds_no_sequence_sized_mask() -> None:
    model = _model()
    embeds = torch.zeros(2, 16, QWEN3["hidden_size"])
    pos = torch.cat([torch.arange(n) for n in (5, 11)])[None].expand(2, 16)
    mask2d = torch.ones(2, 16, dtype=torch.long)
    assert create_causal_mask(model.config, embeds, None, None, position_ids=pos) is None
    got = create_causal_mask(model.config, embeds, mask2d, None, position_ids=pos)
    assert got.shape == (2, 16) and got.dtype == torch.bool and bool(got.all())  # the padding mask, 2-D


def test_model_attention_runs_the_cuda_varlen_kernel_under_fake_tensors() -> None:
    """The attention function the model dispatches to, given CUDA q/k/v ([batch, heads, seq, dim]) and the
    collated document kwargs, runs torch's varlen kernel (no SDPA, no mask)."""
    model = _model()
    layer = model.model.layers[0].self_attn
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    host = document_kwargs(
        {
            "input_ids": torch.zeros(2, 9, dtype=torch.long),
            "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]),
        }
    )
    heads, kv_heads, dim = QWEN3["num_attention_heads"], QWEN3["num_key_value_heads"], QWEN3["head_dim"]
    with FakeTensorMode():
        q = torch.empty(2, heads, 9, dim, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2, kv_heads, 9, dim, dtype=torch.bfloat16, device="cuda")
        kwargs = {
            k: torch.tensor(v.tolist(), dtype=v.dtype, device="cuda") if isinstance(v, torch.Tensor) else v
            for k, v in host.items()
        }
        with _Ops() as ops:
            out, _ = attention(layer, q, kv, kv, None, scaling=layer.scaling, **kwargs)
    assert out.shape == (2, 9, heads, dim) and out.device.type == "cuda"
    assert ops.ops.count("torch_attn._varlen_attn.default") == 1
    assert not [op for op in ops.ops if "scaled_dot_product" in op or "repeat" in op or "expand" in op]


def test_auto_applies_to_text_causal_models_only() -> None:
    assert auto_applies(Qwen3ForCausalLM, Qwen3Config(**QWEN3))
    from mm_core.registry import model_register

    for model_id in ("qwen3", "qwen3_moe"):  # mm's registered subclasses of transformers' causal LMs
        cls = model_register.get(model_id)
        assert auto_applies(cls, cls.config_class()), model_id
    from transformers import Qwen3VLConfig

    assert not auto_applies(Qwen3VLForConditionalGeneration, Qwen3VLConfig())
    assert resolve_attn_implementation("auto", Qwen3VLForConditionalGeneration, Qwen3VLConfig()) == "sdpa"
    # asked for by name, a model with towers gets it for its language model only
    chosen = resolve_attn_implementation(VARLEN_ATTENTION, Qwen3VLForConditionalGeneration, Qwen3VLConfig())
    assert chosen == {"text_config": VARLEN_ATTENTION}


def test_rms_norm_switch_keeps_numbers_and_weights() -> None:
    """The classes the plugin's plan lists (``rms_norm_classes``) are switched; a model without a plan keeps
    every module."""
    from mm_core.models import plan_of
    from mm_core.registry import model_register

    assert use_device_kernels(_model(), "cpu", force=True) == []  # transformers' class: no plan, no names
    cls = model_register.get("qwen3")
    assert plan_of(cls).rms_norm_classes == ("Qwen3RMSNorm",)
    torch.manual_seed(0)
    model = cls._from_config(Qwen3Config(**QWEN3), dtype=torch.float32)
    ids = torch.randint(0, QWEN3["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
    before, keys = model(input_ids=ids).logits, list(model.state_dict())
    assert use_device_kernels(model, "cpu") == []  # a CPU keeps transformers' modules
    switched = use_device_kernels(model, "cpu", force=True)
    # per layer: input, post-attention, query and key norms; then the final norm
    assert len(switched) == 4 * QWEN3["num_hidden_layers"] + 1
    assert {"model.norm", "model.layers.1.self_attn.k_norm"} <= set(switched)
    assert type(model.model.norm).__name__ == "KernelQwen3RMSNorm"
    assert list(model.state_dict()) == keys
    assert torch.equal(model(input_ids=ids).logits, before)


def test_ascend_peaks() -> None:
    class _Npu:
        @staticmethod
        def get_device_name(device: object) -> str:
            return "Ascend910B2"

    npu = SimpleNamespace(type="npu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "npu", _Npu, raising=False)
        assert peak_tflops(npu, torch.bfloat16, None) == 313.0  # type: ignore[arg-type]
        mp.setattr(_Npu, "get_device_name", staticmethod(lambda device: "Ascend910_9392"))
        assert peak_tflops(npu, torch.bfloat16, None) == 781.0  # type: ignore[arg-type]
        assert peak_tflops(npu, torch.float32, None) is None  # type: ignore[arg-type]


def test_table_norm_and_rotary_are_transformers_own_numbers() -> None:
    """The torch entries of the table give transformers' Qwen3 RMSNorm and rotary results bit for bit."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from mm_parallel.kernels import kernel

    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 1, 7, 16, generator=g)
    cos, sin = torch.randn(2, 7, 16, generator=g), torch.randn(2, 7, 16, generator=g)
    rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
    rotary = kernel("rotary", "cpu")
    assert torch.equal(rotary(q, cos[:, None], sin[:, None]), rq)
    assert torch.equal(rotary(k, cos[:, None], sin[:, None]), rk)
    norm = Qwen3RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.randn(16, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = q.to(dtype)
        assert torch.equal(kernel("rms_norm", "cpu")(x, norm.weight.to(dtype), 1e-6), norm.to(dtype)(x))


def test_decoding_with_a_cache_matches_sdpa() -> None:
    """After a key/value cache (generation) the queries attend to every cached key, left padding masked."""
    ours, sdpa = _model(), _model("sdpa")
    ids = torch.randint(0, QWEN3["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    outs = []
    for model in (ours, sdpa):
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step = first.logits[:, -1:].argmax(-1)
            nxt = model(
                input_ids=step,
                attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                past_key_values=first.past_key_values,
                use_cache=True,
            )
        outs.append((first.logits[mask.bool()], nxt.logits))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5)
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-5)
