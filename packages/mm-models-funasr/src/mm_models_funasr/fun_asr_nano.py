"""Fun-ASR-Nano (``model.model_id: fun_asr_nano``): transformers' ``FunAsrNanoForConditionalGeneration`` with
mm's plans.

The model: a SenseVoice SAN-M audio encoder (``model.audio_tower``: ``layers.{*}``, each self-attention with
an FSMN memory, a depthwise ``Conv1d`` over time whose weight is ``[H, 1, K]``; the first layer reads the
560-value low-frame-rate rows), a projector (``model.multi_modal_projector``: two linears and a few
bidirectional Transformer layers at the text width) and a Qwen3 language model (``model.language_model``).
Every LFR row of a clip becomes one audio-token embedding: the encoder does not subsample.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.models.fun_asr_nano import FunAsrNanoForConditionalGeneration

from mm_core.models import ModelPlan

#: ``model.freeze`` patterns for the parts users commonly freeze (see the package README)
AUDIO_TOWER = "model.audio_tower"
PROJECTOR = "model.multi_modal_projector"

#: Encoder layers and decoder layers are the FSDP and recompute units; the projector (small: two linears and
#: the adaptor layers at the text width), embeddings and head stay in the root unit. The FSMN convolutions
#: (depthwise ``[H, 1, K]`` kernels, not matrices) never take Muon; embeddings and the head are AdamW's by
#: mm's own rules. Context parallelism splits the sequence at the language model's input, after the audio
#: rows are merged into the embeddings (the audio tower sees whole clips).
FUN_ASR_NANO_PLAN = ModelPlan(
    fsdp_units=("model.audio_tower.layers.{*}", "model.language_model.layers.{*}"),
    recompute_units=("model.audio_tower.layers.{*}", "model.language_model.layers.{*}"),
    muon_exclude_modules=("model.audio_tower.layers.{*}.self_attn.fsmn",),
    cp_split_module="model.language_model",
    output_head="lm_head",
    input_embedding="model.language_model.embed_tokens",
    output_norm="model.language_model.norm",
)


class FunAsrNanoForTraining(FunAsrNanoForConditionalGeneration):
    """Exactly ``FunAsrNanoForConditionalGeneration`` (same weights, names and exports) plus default plans
    (:data:`FUN_ASR_NANO_PLAN`) and the idle-audio-tower rule.

    Inputs (mm-data-audio's ``fun-asr-nano`` format): ``input_features`` [clips, rows, 560] and
    ``input_features_mask`` [clips, rows]; one ``<|object_ref_start|>`` (``config.audio_token_id``) per valid
    row. ``lm_head`` is called once and its output returned unchanged, so mm may compute the loss there in
    chunks (``model.loss_cfg.chunked_loss``).

    Under FSDP every rank must run the same units each step: a training micro-batch without audio (text-only
    ``audio_sft`` samples) runs the audio tower and projector on one silent row and adds 0 × the result to
    the logits and to the model's own ``.loss`` (:meth:`_idle_audio_tower`)."""

    mm_plan: ClassVar[ModelPlan] = FUN_ASR_NANO_PLAN

    def _idle_audio_tower(self) -> torch.Tensor:
        """Run the audio tower and projector on one all-zero LFR row; return 0 × the sum of the outputs."""
        tower = self.model.audio_tower
        weight = tower.layers[0].input_layernorm.weight
        features = torch.zeros(1, 1, tower.config.input_size, dtype=weight.dtype, device=weight.device)
        mask = torch.ones(1, 1, dtype=torch.long, device=weight.device)
        out = self.model.get_audio_features(features, mask, return_dict=True)
        return out.pooler_output.sum() * 0.0

    def forward(self, *args: Any, input_features: torch.Tensor | None = None, **kwargs: Any) -> Any:
        idle = None
        if self.training and input_features is None and torch.is_grad_enabled():
            idle = self._idle_audio_tower()  # first, so every rank runs the FSDP units in the same order
        out = super().forward(*args, input_features=input_features, **kwargs)
        if idle is not None:  # into the loss too: loss_type raw backpropagates the model's own .loss
            out.logits = out.logits + idle
            if out.loss is not None:
                out.loss = out.loss + idle
        return out
