"""Model FLOPs per step (``tflops_per_s``, ``mfu``): 6 per matrix weight and token, routed experts at the
share a token uses, causal attention over half the sequence, the vision units' weights per row they see in the
forward (a recompute in the backward is not counted), and the peak table only for known accelerators."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from mm_core.models import ModelPlan
from mm_core.train.flops import PEAK_TFLOPS, StepFlops, peak_tflops

SMALL = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4}


def _matrices(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def test_dense_tied_model_counts_every_matrix_once_and_causal_attention():
    config = Qwen3Config(
        **SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True
    )
    model = Qwen3ForCausalLM(config)
    counter = StepFlops.of(model)
    assert counter.text_params == _matrices(model)  # the tied embedding counted once, as the head
    assert (counter.attn_layers, counter.attn_width) == (2, 4 * 8)
    ids = torch.zeros(3, 10, dtype=torch.long)
    out, flops = counter.forward_flops(lambda: model(input_ids=ids), torch.tensor(30.0), context=10)
    assert out.logits.shape == (3, 10, 64)
    assert flops.item() == pytest.approx(30 * (6 * _matrices(model) + 12 * 2 * 32 * 5))


def test_untied_head_counts_and_the_embedding_does_not():
    model = Qwen3ForCausalLM(
        Qwen3Config(
            **SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False
        )
    )
    assert StepFlops.of(model).text_params == _matrices(model) - 64 * 16


class MoePlugin(Qwen3MoeForCausalLM):
    mm_plan: ClassVar[ModelPlan] = ModelPlan(expert_modules=("model.layers.{*}.mlp.experts",))


def test_routed_experts_count_at_the_share_a_token_uses():
    config = Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8
    )
    model = MoePlugin(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n and p.dim() >= 2)
    assert experts == 2 * 8 * (2 * 8 * 16 + 16 * 8)
    expected = _matrices(model) - 64 * 16  # untied by default: the embedding is a lookup, the head a product
    expected -= experts * (1 - 2 / 8)
    assert StepFlops.of(model).text_params == pytest.approx(expected)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


class TinyVLM(torch.nn.Module):
    """A vision tower of two blocks and a language model, with the plan a vision-language model declares."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("visual.blocks.{*}", "language.{*}"), cp_split_module="language"
    )

    def __init__(self) -> None:
        super().__init__()
        self.visual = torch.nn.Module()
        self.visual.blocks = torch.nn.ModuleList([Block(), Block()])
        self.language = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = pixels
        for block in self.visual.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # recomputed in backward
        return self.language(tokens).sum() + x.sum()


def test_vision_rows_count_once_per_forward_not_again_in_a_recompute():
    model = TinyVLM()
    counter = StepFlops.of(model)
    assert counter.text_params == 2 * 16 and [n for _, n in counter.vision_units] == [16, 16]
    pixels, tokens = torch.randn(2, 5, 4, requires_grad=True), torch.randn(1, 3, 4)
    loss, flops = counter.forward_flops(lambda: model(pixels, tokens), torch.tensor(3.0), context=3)
    loss.backward()  # the checkpointed blocks run forward again: not model work
    assert counter.vision_rows == 20  # seen during the recompute, dropped by the next forward
    assert flops.item() == pytest.approx(3 * 6 * 32 + 6 * 10 * 32)
    _, shared = counter.forward_flops(lambda: model(pixels, tokens), torch.tensor(3.0), 3, vision_share=0.5)
    assert shared.item() == pytest.approx(3 * 6 * 32 + 6 * 10 * 32 * 0.5)


def test_peak_comes_from_the_setting_or_the_table_of_known_accelerators():
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, torch.bfloat16, None) is None  # a CPU: no mfu unless tools.peak_tflops
    assert peak_tflops(cpu, torch.float32, 12.5) == 12.5
    assert dict(PEAK_TFLOPS)["H100"] == 989.0 and dict(PEAK_TFLOPS)["A100"] == 312.0
