"""Shared by the Qwen vision-language models in mm: per-tower default plan, the idle-vision-tower rule."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from mm_core.models import ModelPlan

from ._idle import add_idle, idle_vision_tower

#: ``model.freeze`` patterns for the parts users commonly freeze (see the package README)
VISION_TOWER = "model.visual"
PROJECTOR = "model.visual.merger"


#: Vision blocks and language layers are separate FSDP (and recompute) units, and so are the token embedding
#: and the final norm with the head; the patch embedding and projector stay in the root unit. Context
#: parallelism: the vision tower and the 3-D (mRoPE) positions see the whole sequence; mm splits it at the
#: language model's input, deepstack features (one row per image token) included.
QWEN_VL_PLAN = ModelPlan(
    fsdp_units=("model.visual.blocks.{*}", "model.language_model.layers.{*}"),
    recompute_units=("model.visual.blocks.{*}", "model.language_model.layers.{*}"),
    muon_exclude_modules=("model.visual.patch_embed",),
    cp_split_module="model.language_model",
    cp_packed_inputs=(("deepstack_visual_embeds", "visual_pos_masks"),),
    output_head="lm_head",
    input_embedding="model.language_model.embed_tokens",
    output_norm="model.language_model.norm",
)


class QwenVLPlans:
    """The :data:`QWEN_VL_PLAN` and the idle-vision-tower rule. A mixin in front of a transformers
    ``*ForConditionalGeneration`` class, so weights, names and exports are exactly those of transformers."""

    mm_plan: ClassVar[ModelPlan] = QWEN_VL_PLAN

    def _idle_vision_tower(self) -> torch.Tensor:
        """0 × the vision tower's outputs on a blank minimal image (see :mod:`._idle`)."""
        return idle_vision_tower(self.model.visual)  # type: ignore[attr-defined]

    def forward(self, *args: Any, pixel_values: torch.Tensor | None = None, **kwargs: Any) -> Any:
        idle = None
        if self.training and pixel_values is None and torch.is_grad_enabled():  # type: ignore[attr-defined]
            idle = self._idle_vision_tower()  # first, so every rank runs the FSDP units in the same order
        out = super().forward(*args, pixel_values=pixel_values, **kwargs)  # type: ignore[misc]
        return add_idle(out, idle)
