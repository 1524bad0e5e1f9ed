"""Kimi K2.5 (``model.model_id: kimi_k25``): transformers' ``Kimi_K25ForConditionalGeneration`` with mm's
plans.

The model: a MoonViT-style vision tower (``model.vision_tower``: patch embedding with a learned, bicubically
resampled position grid, ``layers.{*}`` encoder layers, a 2 × 2 patch merge), a projector
(``model.mm_projector``: LayerNorm, Linear, GELU, Linear) and a DeepSeek-V3 language model
(``model.language_model``): multi-head latent attention (MLA) in every layer, the first
``first_k_dense_replace`` layers with a dense MLP, the others a ``DeepseekV3MoE``: a sigmoid top-k router
(``mlp.gate``), fused routed experts (``mlp.experts``) and an always-on dense ``mlp.shared_experts``.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

from mm_core.models import ModelPlan, TransformersExperts, init_expert_adapters

#: ``model.freeze`` patterns for the parts users commonly freeze (see the package README)
VISION_TOWER = "model.vision_tower"
PROJECTOR = "model.mm_projector"


class KimiK25ForTraining(TransformersExperts, Kimi_K25ForConditionalGeneration):
    """Exactly ``Kimi_K25ForConditionalGeneration`` (same weights, names and exports) plus per-tower default
    plans and the idle-vision-tower rule.

    Plans: vision encoder layers (``model.vision_tower.layers.{*}``) and decoder layers
    (``model.language_model.layers.{*}``: MLA attention, router, routed and shared experts of a layer
    together) are the FSDP and recompute units; the patch embedding (conv + position grid), projector,
    embeddings and head stay in the root unit. Expert parallelism takes the fused routed experts
    ``model.language_model.layers.{*}.mlp.experts`` (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
    SiLU, no bias: mm's default adapter). It matches only the MoE layers: the first
    ``first_k_dense_replace`` layers have a plain ``mlp`` (``gate_proj``/``up_proj``/``down_proj``) and the
    shared experts are a dense MLP beside the routed ones, both FSDP-sharded with their layer. Routers
    (``mlp.gate``), the patch embedding (its position grid is a 3-D ``[h, w, dim]`` table, not a batch of
    matrices) and the projector's LayerNorm never take Muon. Context parallelism splits the sequence at the
    input of ``model.language_model``, after the image features are merged into the embeddings.

    Routing and load balancing: DeepSeek-V3's router scores experts with a sigmoid, adds
    ``e_score_correction_bias`` for the choice only (group-limited top-k, ``n_group``/``topk_group``) and
    weighs the chosen experts by their normalised scores × ``routed_scaling_factor``. That bias is a buffer,
    not a parameter: no gradient reaches it and neither transformers nor mm updates it (DeepSeek's
    auxiliary-loss-free balancing adjusts it outside back-propagation), so it keeps its checkpoint values
    (zeros from scratch). The router weight is trained through the expert weights. mm's router loss
    (``model.loss_cfg.router_aux_loss_coef``) is the Switch-Transformer softmax loss, which does not describe
    this sigmoid, bias-corrected routing; the plan's ``router_loss_refusal`` says so and mm refuses a non-zero
    coefficient, so train with ``router_aux_loss_coef: 0``.

    Under FSDP every rank must run the same units each step: a training micro-batch without images runs the
    vision tower and projector on one blank minimal image and adds 0 × the result to the logits and to the
    model's own ``.loss`` (:meth:`_idle_vision_tower`)."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("model.vision_tower.layers.{*}", "model.language_model.layers.{*}"),
        recompute_units=("model.vision_tower.layers.{*}", "model.language_model.layers.{*}"),
        expert_modules=("model.language_model.layers.{*}.mlp.experts",),
        cp_split_module="model.language_model",
        muon_exclude_modules=(
            "model.vision_tower.patch_embed",
            "model.mm_projector.pre_norm",
            "model.language_model.layers.{*}.mlp.gate",
        ),
        output_head="lm_head",
        input_embedding="model.language_model.embed_tokens",
        output_norm="model.language_model.norm",
        router_loss_refusal=(
            "routes DeepSeek-V3 style (sigmoid scores, top-k chosen with the e_score_correction_bias buffer: "
            "auxiliary-loss-free balancing)"
        ),
        init_weights=init_expert_adapters,
    )

    def _idle_vision_tower(self) -> torch.Tensor:
        """Run the vision tower and projector on a blank minimal image (one merge window of patches, one image
        token) and return 0 × the sum of the result.

        Under FSDP every rank must run the same units each step; a micro-batch without images would otherwise
        skip the vision layers' all-gathers on one rank while another rank waits in them."""
        model = cast(Any, self.model)  # nn.Module.__getattr__ types submodules as Tensor | Module
        tower = model.vision_tower
        merge_h, merge_w = (int(k) for k in tower.merge_kernel_size)
        patch = int(tower.config.patch_size)
        weight = tower.patch_embed.proj.weight
        pixels = torch.zeros(merge_h * merge_w, 3, patch, patch, dtype=weight.dtype, device=weight.device)
        grid = torch.tensor([[1, merge_h, merge_w]], device=weight.device)
        features = model.mm_projector(tower(pixels, grid_thw=grid).pooler_output)
        return features.sum() * 0.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``Kimi_K25ForConditionalGeneration.forward`` with the vision tower run before the token embedding
        (as ``mm_encoder_outputs``); a training forward with grad and no ``pixel_values`` runs
        :meth:`_idle_vision_tower` first and adds its 0 × result to the logits (mm's own loss) and to
        ``.loss`` when labels were given (``loss_type: raw``), so the vision units' backward runs on every
        rank either way. (Under context parallelism mm passes the whole sequence's positions to the language
        model, which would otherwise number each rank's shard from 0.)"""
        idle = None
        pixel_values = kwargs.pop("pixel_values", None)
        if pixel_values is not None:
            # the vision tower before the token embedding (transformers runs it after), as the idle tower
            # below: every rank runs the FSDP units (the embedding is one) in one order, whatever it holds
            kwargs["mm_encoder_outputs"] = {
                "image": cast(Any, self.model).get_image_features(
                    pixel_values, kwargs.get("image_grid_thw"), return_dict=True
                )
            }
        elif self.training and torch.is_grad_enabled():
            idle = self._idle_vision_tower()  # first, so every rank runs the FSDP units in the same order
        out = super().forward(*args, **kwargs)
        if idle is not None:
            out.logits = out.logits + idle
            if out.loss is not None:  # loss_type raw trains on the model's own .loss
                out.loss = out.loss + idle
        return out
