"""Qwen3-ASR (``model.model_id: qwen3_asr``): transformers' ``Qwen3ASRForConditionalGeneration`` with mm's
plans.

The model: a Whisper-style audio encoder (``model.audio_tower``: a stem of three stride-2 Conv2d over the
128-bin log-mel spectrogram in chunks of ``2 * n_window`` frames and a linear ``conv_out``, then encoder
layers with windowed attention), a two-layer projector (``model.multi_modal_projector``) and a Qwen3
language model; audio features replace the ``<|audio_pad|>`` tokens' embeddings. Its inputs are
``input_features`` [audios, mels, frames] and ``input_features_mask`` [audios, frames] (the ``qwen3_asr``
format of mm-data-audio).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.models.qwen3_asr import Qwen3ASRForConditionalGeneration

from mm_core.models import ModelPlan

from ._idle import add_idle, embed_first, idle_audio_tower

#: ``model.freeze`` pattern of the audio tower (the projector ``model.multi_modal_projector`` stays trainable)
AUDIO_TOWER = "model.audio_tower"
#: the audio tower's stem: mel spectrogram in, token embeddings out (the audio counterpart of a vision
#: patch embedding). Its kernels take AdamW by mm's rule for convolutions anyway; naming the whole stem keeps
#: ``conv_out``, the stem's 2-D output projection, off Muon as well
AUDIO_STEM = ("model.audio_tower.conv2d*", "model.audio_tower.conv_out")

#: Audio encoder layers and decoder layers are separate FSDP (and recompute) units; the stem, projector,
#: embeddings and head stay in the root unit. Context parallelism: the audio tower sees the whole sequence;
#: mm splits it at the language model's input (plain 1-D positions).
QWEN3_ASR_PLAN = ModelPlan(
    fsdp_units=("model.audio_tower.layers.{*}", "model.language_model.layers.{*}"),
    recompute_units=("model.audio_tower.layers.{*}", "model.language_model.layers.{*}"),
    muon_exclude_modules=AUDIO_STEM,
    cp_split_module="model.language_model",
    output_head="lm_head",
    input_embedding="model.language_model.embed_tokens",
    output_norm="model.language_model.norm",
)


class Qwen3ASRForTraining(Qwen3ASRForConditionalGeneration):
    """Exactly ``Qwen3ASRForConditionalGeneration`` (same weights and names; exports as that class) plus
    per-tower default plans: ``model.audio_tower.layers.{*}`` and ``model.language_model.layers.{*}`` are
    FSDP units. Freeze the audio tower with ``model.freeze: [model.audio_tower]``.

    A training micro-batch without audio runs the audio tower and projector on a blank one-frame clip and
    adds ``0 ×`` their output, so every rank runs the same FSDP units (see :mod:`._idle`)."""

    mm_plan: ClassVar[ModelPlan] = QWEN3_ASR_PLAN

    def _idle_audio_tower(self) -> torch.Tensor:
        """0 × the audio tower's (and projector's) output for a blank clip of one encoder chunk."""
        return idle_audio_tower(self, 2 * self.config.audio_config.n_window)

    def forward(self, *args: Any, input_features: torch.Tensor | None = None, **kwargs: Any) -> Any:
        idle = None
        if self.training and input_features is None and torch.is_grad_enabled():
            embed_first(self, kwargs.get("input_ids", args[0] if args else None), kwargs)
            idle = self._idle_audio_tower()  # after the embedding and before the decoder, as the real tower
        out = super().forward(*args, input_features=input_features, **kwargs)
        return add_idle(out, idle)
