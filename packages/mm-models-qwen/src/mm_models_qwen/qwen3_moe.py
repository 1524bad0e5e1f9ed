"""Qwen3-MoE (``model.model_id: qwen3_moe``): transformers' ``Qwen3MoeForCausalLM`` with mm's plans."""

from __future__ import annotations

from typing import ClassVar

from transformers import Qwen3MoeForCausalLM

from mm_core.models import ModelPlans
from mm_parallel.moe import ExpertParallelExperts


class Qwen3MoeForTraining(Qwen3MoeForCausalLM, ModelPlans):
    """Exactly ``Qwen3MoeForCausalLM`` (same weights and names; its experts are the fused 3-D
    ``gate_up_proj``/``down_proj``), plus mm's default plans: each decoder layer is one FSDP unit and one
    recompute unit, the fused experts of every MoE layer are expert-parallel when
    ``parallel.expert_parallel_size > 1``, and the routers stay out of Muon."""

    mm_fsdp_modules: ClassVar[list[str]] = ["model.layers.{*}"]
    mm_recompute_modules: ClassVar[list[str]] = ["model.layers.{*}"]
    mm_ep_modules: ClassVar[list[str]] = ["model.layers.{*}.mlp.experts"]
    mm_muon_exclude_modules: ClassVar[list[str]] = ["model.layers.{*}.mlp.gate"]

    def initialize_weights(self) -> None:
        """transformers' initialisation, plus the expert-parallel adapters (which live inside the base model,
        whose own ``_init_weights`` does not know them): used by meta-device init."""
        super().initialize_weights()
        for module in self.modules():
            if isinstance(module, ExpertParallelExperts):
                module.reset_parameters(self.config.initializer_range)
