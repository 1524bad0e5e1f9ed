"""MiniMax-M3-VL (``model.model_id: minimax_m3_vl``): transformers'
``MiniMaxM3SparseForConditionalGeneration`` with mm's plans, an expert-parallel adapter for its SwiGLU-OAI
experts and the sparse-attention indexer policy.

The model: a CLIP-like vision tower (Conv3d patch embedding, 3-D RoPE), a two-stage projector that merges
``spatial_merge_size²`` patches into one token, and a decoder whose layers mix dense and mixture-of-experts
MLPs (sigmoid router with a score-correction bias, fused routed experts, one dense shared expert) and full
and block-sparse attention. A sparse layer's *lightning indexer* (``self_attn.indexer``: two small
projections and two RMSNorms) scores key blocks and returns the *indices* of the blocks each query attends
to; the indices select, they carry no gradient, so the language-model loss never reaches the indexer.

Indexer policy: transformers has no loss that trains the indexer (no distillation of the attention
distribution into the indexer scores, as DeepSeek-V3.2 trains its own), and mm adds none, so the indexer
parameters are frozen when the model is built (``requires_grad=False``: no optimizer state, no gradient
reduction, no Muon decision) and one log line says so. There is no switch to train them: with the
indices as the only output there is nothing a gradient could flow through. Frozen, they keep their loaded
values (fine-tuning from a checkpoint keeps its trained selection); from scratch they stay at their
random initialisation, which selects blocks by fixed random projections. ``mm check`` lists them with
this reason (:attr:`ModelPlan.frozen_reasons` of its plan).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLIndexer,
)

from mm_core.models import ModelPlan, TransformersExperts, init_expert_adapters
from mm_parallel.moe import ExpertParallelExperts

log = logging.getLogger(__name__)

#: the decoder layers' lightning indexers (present on layers whose ``layer_types`` entry is sparse)
INDEXER = "model.language_model.layers.{*}.self_attn.indexer"
#: ``model.freeze`` patterns for the parts users commonly freeze (see the package README)
VISION_TOWER = "model.vision_tower"
PROJECTOR = "model.multi_modal_projector"

INDEXER_REASON = (
    "lightning indexer of the sparse attention: it returns the indices of the key blocks each query "
    "attends to, which carry no gradient, and transformers provides no loss that trains it"
)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """MiniMax-M3's gated unit of the gate and up halves of the fused product:
    ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class MiniMaxM3ExpertParallelExperts(ExpertParallelExperts):
    """:class:`~mm_parallel.moe.ExpertParallelExperts` for MiniMax-M3's routed experts.

    Same call, parameter names and fused layout as the base adapter (``gate_up_proj [E, 2I, H]``, gate rows
    first, and ``down_proj [E, H, I]``), same dispatchers; only the gated unit differs: the base computes
    ``act(gate) * up``, MiniMax-M3 :func:`swiglu_oai` (the up half clamped and shifted by one), with the
    experts module's ``swiglu_alpha`` and ``swiglu_limit``."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def adopt(self, experts: nn.Module) -> None:
        missing = [a for a in ("swiglu_alpha", "swiglu_limit") if not hasattr(experts, a)]
        if missing:
            raise TypeError(
                f"{type(experts).__name__} has no {', '.join(missing)}; {type(self).__name__} adapts "
                "MiniMax-M3's fused experts"
            )
        self.swiglu_alpha = float(cast(float, experts.swiglu_alpha))
        self.swiglu_limit = float(cast(float, experts.swiglu_limit))

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_oai(gate, up, self.swiglu_alpha, self.swiglu_limit)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, swiglu_alpha={self.swiglu_alpha}, swiglu_limit={self.swiglu_limit}"


def init_minimax_m3_vl(model: nn.Module) -> None:
    """The :attr:`ModelPlan.init_weights` hook: the expert-parallel adapters (normal(0, std), as
    transformers initialises the fused experts). transformers' ``init_weights()`` reaches every other tensor
    of MiniMax-M3-VL itself (routers and their score-correction bias, RMSNorms, the indexers, the rotary
    frequencies); the meta-init test checks that nothing is left uninitialised."""
    init_expert_adapters(model)


class MiniMaxM3VLForTraining(TransformersExperts, MiniMaxM3SparseForConditionalGeneration):
    """Exactly ``MiniMaxM3SparseForConditionalGeneration`` (same weights and names, exports load in plain
    transformers) plus:

    - default plans: vision encoder layers and decoder layers (attention, indexer, router, routed and shared
      experts of a layer together) are FSDP and recompute units; the fused routed experts are the
      expert-parallel plan (adapter :class:`MiniMaxM3ExpertParallelExperts`; the shared expert stays dense
      in its layer); routers (``mlp.gate``) and the Conv3d patch embedding never take Muon; context
      parallelism splits the sequence at the language model's input;
    - the indexer policy: every ``self_attn.indexer`` parameter is frozen at build (and again after
      ``from_pretrained``, which recreates parameters), with one log line (see the module docstring);
    - the idle-vision-tower rule: a training micro-batch without images runs the vision tower and projector
      on a blank minimal image and adds ``0 ×`` their output, so every FSDP rank runs the same units.
    """

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("model.vision_tower.layers.{*}", "model.language_model.layers.{*}"),
        recompute_units=("model.vision_tower.layers.{*}", "model.language_model.layers.{*}"),
        expert_modules=("model.language_model.layers.{*}.mlp.experts",),
        expert_adapter=MiniMaxM3ExpertParallelExperts,
        cp_split_module="model.language_model",
        muon_exclude_modules=(
            "model.vision_tower.embeddings.proj",
            "model.language_model.layers.{*}.mlp.gate",
        ),
        output_head="lm_head",
        input_embedding="model.language_model.embed_tokens",
        output_norm="model.language_model.norm",
        init_weights=init_minimax_m3_vl,
        frozen_reasons=((INDEXER, INDEXER_REASON),),
    )

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.freeze_indexers(announce=True)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``from_pretrained``, then the indexer policy again: loading replaces parameters
        with new ones that require gradients."""
        model = super().from_pretrained(*args, **kwargs)
        if isinstance(model, tuple):  # output_loading_info=True
            model[0].freeze_indexers(announce=False)
        else:
            model.freeze_indexers(announce=False)
        return model

    def freeze_indexers(self, *, announce: bool) -> list[str]:
        """Set ``requires_grad=False`` on every indexer parameter; returns their names. ``announce`` logs
        the policy once (rank 0 only when a process group is up)."""
        names: list[str] = []
        count = layers = 0
        for module_name, module in self.named_modules():
            if not isinstance(module, MiniMaxM3VLIndexer):
                continue
            layers += 1
            for param_name, param in module.named_parameters():
                param.requires_grad_(False)
                names.append(f"{module_name}.{param_name}")
                count += param.numel()
        if announce and names and (not dist.is_initialized() or dist.get_rank() == 0):
            log.warning(
                "minimax_m3_vl: %d indexer parameters (%d tensors in %d sparse-attention layer%s, %s) "
                "frozen: the lightning indexer selects key blocks by index, which carries no gradient, and "
                "transformers provides no indexer loss; they keep their initial or loaded values",
                count,
                len(names),
                layers,
                "" if layers == 1 else "s",
                INDEXER,
            )
        return names

    def _idle_vision_tower(self) -> torch.Tensor:
        """Run the vision tower and projector on a blank minimal image (one merged token) and return 0 × its
        output. Under FSDP every rank must run the same units each step; a micro-batch without images would
        otherwise skip the vision layers' all-gathers on one rank while another rank waits in them."""
        vision: Any = self.model.vision_tower
        cfg = vision.config
        merge = int(cfg.spatial_merge_size)
        dim = cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size**2
        weight = vision.embeddings.proj.weight
        pixels = torch.zeros(merge * merge, dim, dtype=weight.dtype, device=weight.device)
        grid = torch.tensor([[1, merge, merge]], device=weight.device)
        features = self.model.get_image_features(pixels, grid, return_dict=True).pooler_output
        total = torch.stack([f.sum() for f in features]).sum()
        return total * 0.0

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' forward (same parameters, in the same order) with the vision tower run before the
        token embedding (as ``mm_encoder_outputs``; transformers runs it after) and, in training, the idle
        vision tower: every rank runs the FSDP units (the embedding is one) in one order."""
        idle = None
        model: Any = self.model
        encoders = dict(kwargs.pop("mm_encoder_outputs", None) or {})
        if pixel_values is not None:
            encoders["image"] = model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        if pixel_values_videos is not None:
            videos = model.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True)
            encoders["video"] = videos
        if self.training and torch.is_grad_enabled() and not encoders:
            idle = self._idle_vision_tower()  # first, so every rank runs the FSDP units in the same order
        out = super().forward(
            input_ids=input_ids,
            mm_encoder_outputs=encoders or None,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        if idle is not None:
            out.logits = out.logits + idle
            if out.loss is not None:
                out.loss = out.loss + idle
        return out
