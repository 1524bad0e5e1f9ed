"""Step 3.7 VL (``model.model_id: step3p7``): transformers' ``Step3p7ForConditionalGeneration`` with mm's
plans.

The model: a ViT (``model.vision_model``: patch-embedding conv, 2-D RoPE encoder layers, then two stride-2
conv downsamplers) sees each image twice, as a fixed-size global view (``pixel_values [images, 3, S, S]``)
and as zero or more local crops (``pixel_values_local [crops, 3, P, P]``, ``num_local_patches [images]``
crops per image); a linear projector maps its rows into a language model whose layers are dense or
mixture-of-experts (sigmoid router with a load-balancing bias, fused routed experts, an always-on shared
expert, optional SwiGLU clamping per layer).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.step3p7 import Step3p7ForConditionalGeneration

from mm_core.models import ModelPlan, TransformersExperts, init_expert_adapters
from mm_parallel.moe import ExpertParallelExperts

#: ``model.freeze`` patterns for the parts users commonly freeze (see the package README)
VISION_TOWER = "model.vision_model"
PROJECTOR = "model.multi_modal_projector"

LANGUAGE_MODEL = "model.language_model"
VISION_LAYERS = "model.vision_model.layers.{*}"
DECODER_LAYERS = "model.language_model.layers.{*}"
EXPERTS = "model.language_model.layers.{*}.mlp.experts"
ROUTERS = "model.language_model.layers.{*}.mlp.gate"


class Step3p7ExpertParallelExperts(ExpertParallelExperts):
    """mm's expert-parallel adapter for Step 3.7's routed experts (``Step3p7Experts``).

    Same fused layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, no bias), same SiLU, same call;
    what differs is the SwiGLU clamp of the layers with a ``swiglu_limits`` entry (Step-3.7-Flash: the last
    two layers, bound 7): the gated unit is ``min(silu(gate), limit) * clamp(up, -limit, limit)``. Routing,
    dispatchers and grouped products are the base adapter's; an unclamped layer is exactly the base one."""

    #: the clamp bound of this layer's experts (``inf``: none)
    limit: float = math.inf

    def adopt(self, experts: nn.Module) -> None:
        limit = getattr(experts, "limit", None)
        self.limit = math.inf if limit is None else float(limit)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if math.isinf(self.limit) or self.act_fn is None:
            return super().glu(gate, up)
        return self.act_fn(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if math.isinf(self.limit) else f", swiglu_limit={self.limit}")


#: Vision encoder layers and decoder layers (attention, router, routed and shared experts of a layer
#: together) are FSDP and recompute units; the patch embedding, downsamplers, projector, embeddings and head
#: stay in the root unit. The fused routed experts of the MoE layers are the expert-parallel plan (dense
#: layers and the shared experts stay dense). Context parallelism splits the sequence at the language
#: model's input, after the image rows are merged into the embeddings.
STEP3P7_PLAN = ModelPlan(
    fsdp_units=(VISION_LAYERS, DECODER_LAYERS),
    recompute_units=(VISION_LAYERS, DECODER_LAYERS),
    expert_modules=(EXPERTS,),
    expert_adapter=Step3p7ExpertParallelExperts,
    cp_split_module=LANGUAGE_MODEL,
    muon_exclude_modules=(
        ROUTERS,
        "model.vision_model.embeddings",  # patch-embedding conv and position embedding
        "model.vision_model.downsampler1",
        "model.vision_model.downsampler2",
        "model.language_model.embed_tokens",
    ),
    output_head="lm_head",
    input_embedding="model.language_model.embed_tokens",
    output_norm="model.language_model.norm",
    router_loss_refusal="routes by sigmoid scores plus a balancing bias and has no auxiliary loss",
    init_weights=init_expert_adapters,
)


class Step3p7ForTraining(TransformersExperts, Step3p7ForConditionalGeneration):
    """Exactly ``Step3p7ForConditionalGeneration`` (same weights and names) plus default plans
    (:data:`STEP3P7_PLAN`) and the idle-vision-tower rule.

    Meta-device init: transformers' ``init_weights()`` reaches the routers, the ``e_score_correction_bias``
    buffers, the fused experts and the vision layer scales; the plan's hook initialises the expert-parallel
    adapters (:func:`~mm_core.models.init_expert_adapters`).

    Router loss: Step 3.7 balances its experts without an auxiliary loss (sigmoid scores plus the
    ``e_score_correction_bias`` buffer, which pretraining updates outside the gradient); transformers
    computes none for it, and mm's ``model.loss_cfg.router_aux_loss_coef`` (the softmax Switch loss) does
    not describe its routing, so the coefficient must stay 0 (mm refuses another value: the text config
    has no ``num_experts``). Fine-tuning keeps the bias buffers as loaded."""

    mm_plan: ClassVar[ModelPlan] = STEP3P7_PLAN

    def _idle_vision_tower(self, views: int) -> torch.Tensor:
        """Run the vision tower and projector ``views`` times on a blank one-patch image and return 0 × the
        outputs.

        Under FSDP every rank must run the same units each step, the same number of times: the vision
        layers run once for the global views and once for the local crops of a micro-batch. A micro-batch
        without images (2 views missing) or without crops (1 missing) runs the missing calls here, before
        the language model, so the units run in the same order on every rank."""
        vision = self.model.vision_model
        weight = vision.embeddings.patch_embedding.weight
        side = vision.config.patch_size  # one patch: the downsamplers (stride 2, padding 1) keep one row
        blank = torch.zeros(
            1, vision.config.num_channels, side, side, dtype=weight.dtype, device=weight.device
        )
        total = torch.zeros((), dtype=weight.dtype, device=weight.device)
        for _ in range(views):
            rows = self.model.multi_modal_projector(vision(blank).last_hidden_state)
            total = total + rows.sum()
        return total * 0.0

    def forward(
        self,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: torch.Tensor | list[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        if pixel_values is None or (pixel_values_local is not None and pixel_values_local.shape[0] == 0):
            pixel_values_local = None  # a micro-batch whose images have no crops (or no image at all)
        if isinstance(num_local_patches, torch.Tensor):
            num_local_patches = [int(n) for n in num_local_patches.tolist()]
        idle = None
        if pixel_values is not None:
            # the vision tower before the token embedding (transformers runs it after), as the idle tower
            # below: every rank runs the FSDP units (the embedding is one) in one order, whatever it holds
            features = self.model.get_image_features(
                pixel_values, pixel_values_local, num_local_patches, return_dict=True
            )
            kwargs["mm_encoder_outputs"] = {"image": features}
        if self.training and torch.is_grad_enabled():
            missing = (pixel_values is None) + (pixel_values_local is None)
            if missing:
                idle = self._idle_vision_tower(missing)  # before the embedding, after the views that ran
        out = super().forward(*args, **kwargs)
        if idle is not None:  # in the logits (mm's loss) and in the model's own loss (loss_type raw)
            out.logits = out.logits + idle
            if out.loss is not None:
                out.loss = out.loss + idle
        return out
