"""Dense Qwen3 (``model.model_id: qwen3``): transformers' ``Qwen3ForCausalLM`` with mm's default plans."""

from __future__ import annotations

from typing import ClassVar

from transformers import Qwen3ForCausalLM

from mm_core.models import ModelPlan


class Qwen3ForTraining(Qwen3ForCausalLM):
    """Exactly ``Qwen3ForCausalLM`` (same weights, same names, exports as ``Qwen3ForCausalLM``), plus the
    plans mm uses when the YAML leaves them out: each decoder layer is one FSDP unit and one recompute
    unit; the embedding is a unit of its own, and so are the final norm with the head (one unit with the
    embedding when they are tied, as in small Qwen3 models)."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("model.layers.{*}",),
        recompute_units=("model.layers.{*}",),
        output_head="lm_head",
        input_embedding="model.embed_tokens",
        output_norm="model.norm",
        rms_norm_classes=("Qwen3RMSNorm",),
    )
