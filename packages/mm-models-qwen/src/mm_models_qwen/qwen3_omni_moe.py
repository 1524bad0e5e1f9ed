"""Qwen3-Omni-MoE's thinker (``model.model_id: qwen3_omni_moe``): transformers'
``Qwen3OmniMoeThinkerForConditionalGeneration`` with mm's plans. Text, images and audio in, text out (the
talker, which speaks, is not trained here).

The model: a vision tower as Qwen3-VL's (``model.visual``, deepstack features added to the first decoder
layers), an audio tower as Qwen3-ASR's with its output projection inside (``model.audio_tower``; input
``input_features`` [audios, 128, frames] + ``feature_attention_mask`` [audios, frames], the ``qwen3_omni``
format of mm-data-audio) and a mixture-of-experts decoder (``model.language_model``: softmax top-k router
``mlp.gate``, fused 3-D experts ``mlp.experts``, no shared expert) with 3-D (mRoPE) positions.

Five things differ from calling the transformers class as is, none of them in the weights:

- Tower order. Every training forward runs the vision tower once (on the images and videos together, else
  on a blank minimal image, ``0 ×`` its output), then the audio tower (on the audio, else on a blank
  one-frame clip), then the decoder,
  whatever the micro-batch holds, so every rank runs the FSDP units in one order (see :mod:`._idle`).
  transformers runs the audio tower first; the images' features are therefore computed first here and
  handed to its forward as ``mm_encoder_outputs``.
- Positions without ``attention_mask``. transformers computes the 3-D positions only when it gets an
  attention mask; mm's context parallelism sends none (the decoder sees only this rank's rows), so the
  positions are computed here over the whole sequence as if every token were real: padding comes at the
  end, so the real tokens keep their positions.
- Clips encoded as if alone. transformers pads every audio chunk of the micro-batch to the longest one, and
  its convolutions carry the padding into a shorter clip's real frames: a clip's features, so the loss,
  depended on the other clips of its micro-batch. Here the audio tower runs through
  :func:`._audio.encode_audio` (the same modules; each clip's features those of the tower on that clip
  alone) and its rows are placed at the audio tokens before the decoder runs.
- Videos (``pixel_values_videos``, ``video_grid_thw``; with ``use_audio_in_video`` their sound's rows among
  ``input_features``, its tokens interleaved with the video's) go through transformers' own code; the
  seconds per temporal group, ``video_second_per_grid``, may come as a list of floats (mm-data-audio's
  collator sends plain values, which the device move never casts to the training dtype) and become a
  float32 tensor here, as transformers' 3-D positions take it.
- A Qwen3-Omni checkpoint folder (``config.json`` of ``model_type: qwen3_omni_moe``, weights under
  ``thinker.``) loads directly: its ``thinker_config`` is taken, and transformers' own weight renaming of the
  thinker drops the prefix. Exports are thinker folders, which transformers loads as this class's base.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

from mm_core.models import ModelPlan, TransformersExperts

from ._audio import encode_audio
from ._idle import add_idle, embed_first, idle_audio_tower, idle_vision_tower
from ._moe import init_qwen3_omni_moe
from ._vl import QWEN_VL_PLAN, vision_features
from .qwen3_asr import AUDIO_STEM

#: the decoder layers' fused experts and routers
EXPERTS = "model.language_model.layers.{*}.mlp.experts"
ROUTERS = "model.language_model.layers.{*}.mlp.gate"

#: Vision blocks, audio encoder layers and decoder layers (attention, router and all experts of a layer
#: together) are FSDP and recompute units; the stems, projectors, embeddings and head stay in the root unit.
#: Context parallelism: the towers and the 3-D positions see the whole sequence; mm splits it at the
#: language model's input, deepstack features (one row per image token) included.
QWEN3_OMNI_MOE_PLAN = ModelPlan(
    fsdp_units=(
        "model.visual.blocks.{*}",
        "model.audio_tower.layers.{*}",
        "model.language_model.layers.{*}",
    ),
    recompute_units=(
        "model.visual.blocks.{*}",
        "model.audio_tower.layers.{*}",
        "model.language_model.layers.{*}",
    ),
    expert_modules=(EXPERTS,),
    muon_exclude_modules=(*QWEN_VL_PLAN.muon_exclude_modules, *AUDIO_STEM, ROUTERS),
    cp_split_module=QWEN_VL_PLAN.cp_split_module,
    cp_packed_inputs=QWEN_VL_PLAN.cp_packed_inputs,
    output_head="lm_head",
    input_embedding="model.language_model.embed_tokens",
    output_norm="model.language_model.norm",
    rms_norm_classes=("Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm"),
    init_weights=init_qwen3_omni_moe,
)


def thinker_config(config: Any) -> Any:
    """The thinker's config of a whole Qwen3-Omni config (``thinker_config``); any other config unchanged."""
    inner = getattr(config, "thinker_config", None)
    return inner if isinstance(inner, PretrainedConfig) else config


class Qwen3OmniMoeThinkerForTraining(TransformersExperts, Qwen3OmniMoeThinkerForConditionalGeneration):
    """Exactly ``Qwen3OmniMoeThinkerForConditionalGeneration`` (same weights and names; exports as that class)
    plus per-tower default plans: ``model.visual.blocks.{*}``, ``model.audio_tower.layers.{*}`` and
    ``model.language_model.layers.{*}`` are FSDP units; the experts are the expert-parallel plan; the routers
    (``mlp.gate``), the patch embedding and the audio stem never take Muon. Freeze the towers with
    ``model.freeze: [model.visual, model.audio_tower]``.

    Meta-device init: the plan's hook (:func:`._moe.init_qwen3_omni_moe`) initialises the routers and experts,
    which transformers' ``init_weights()`` does not reach in a subclass, and the expert-parallel adapters."""

    mm_plan: ClassVar[ModelPlan] = QWEN3_OMNI_MOE_PLAN

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> Any:
        return super()._from_config(thinker_config(config), **kwargs)

    @classmethod
    def from_pretrained(cls, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        return super().from_pretrained(*args, config=thinker_config(config), **kwargs)

    def _idle_vision_tower(self) -> torch.Tensor:
        """0 × the vision tower's outputs on a blank minimal image."""
        return idle_vision_tower(self.model.visual)

    def _idle_audio_tower(self) -> torch.Tensor:
        """0 × the audio tower's output on a blank one-frame clip."""
        return idle_audio_tower(self, 1)

    def _positions(self, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The 3-D positions ``[3, batch, seq]`` of the whole sequence, every token taken as real."""
        mask = inputs.get("feature_attention_mask")
        lengths = mask.sum(-1) if mask is not None else inputs.get("audio_feature_lengths")
        positions, _ = self.model.get_rope_index(
            input_ids,
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            torch.ones_like(input_ids),
            bool(inputs.get("use_audio_in_video")),
            lengths,
            inputs.get("video_second_per_grid"),
        )
        return positions

    def _embeds_with_audio(
        self,
        input_ids: torch.Tensor,
        input_features: torch.Tensor,
        mask: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """The token embeddings with each clip's audio rows (:func:`._audio.encode_audio`) at its audio
        tokens, as transformers merges them."""
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = self.get_input_embeddings()(input_ids)
        audio = encode_audio(self.model.audio_tower, input_features, mask).to(embeds.device, embeds.dtype)
        _, _, audio_mask = self.model.get_placeholder_mask(input_ids, inputs_embeds=embeds)
        merged: torch.Tensor = embeds.masked_scatter(audio_mask, audio)
        return merged

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        *,
        mm_encoder_outputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        seconds = kwargs.get("video_second_per_grid")
        if isinstance(seconds, (list, tuple)):  # plain floats from mm's collator, never cast to bf16
            kwargs["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float32)
        encoders = dict(mm_encoder_outputs or {})
        if pixel_values is not None or pixel_values_videos is not None:
            # vision first (its features go in precomputed) and once, over the images and videos together:
            # every rank runs the tower's FSDP units as often, whatever its micro-batch holds
            encoders.update(
                vision_features(
                    self.model,
                    pixel_values,
                    kwargs.get("image_grid_thw"),
                    pixel_values_videos,
                    kwargs.get("video_grid_thw"),
                )
            )
        idle = None
        if self.training and torch.is_grad_enabled():
            if not encoders:
                idle = self._idle_vision_tower()
            if input_features is None:
                embed_first(self, input_ids, kwargs)  # as before the real tower (_embeds_with_audio)
                audio = self._idle_audio_tower()
                idle = audio if idle is None else idle + audio
        given = ("position_ids", "attention_mask", "cache", "past_key_values")
        if input_ids is not None and all(kwargs.get(k) is None for k in given):
            kwargs["position_ids"] = self._positions(input_ids, **kwargs)
        mask = kwargs.get("feature_attention_mask")
        if input_features is not None and input_ids is not None and mask is not None:
            kwargs["inputs_embeds"] = self._embeds_with_audio(input_ids, input_features, mask, kwargs)
            input_features = None  # encoded: the rows are in inputs_embeds
        out = super().forward(
            input_ids=input_ids,
            input_features=input_features,
            mm_encoder_outputs=encoders or None,
            **kwargs,
        )
        return add_idle(out, idle)
