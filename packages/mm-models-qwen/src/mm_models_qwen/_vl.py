"""Shared by the Qwen vision-language models in mm: per-tower default plan, the idle-vision-tower rule, and
one vision-tower pass per forward when a micro-batch holds videos (with or without images)."""

from __future__ import annotations

import copy
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

    def forward(
        self,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        position_ids = kwargs.get("position_ids")
        if (
            isinstance(position_ids, torch.Tensor)
            and position_ids.dim() == 2
            and position_ids.shape[0] == 1
            and kwargs.get("attention_mask") is None
        ):
            kwargs = self._packed_positions(kwargs)  # a packed row (data.dataloader_param.packing)
        idle = None
        if pixel_values is not None or pixel_values_videos is not None:
            # the vision tower first (before the token embedding, an FSDP unit of its own) and once, over the
            # images and videos together: every rank runs the units in one order and as often, whatever its
            # micro-batch holds (images, videos, both, or neither: the idle tower below)
            kwargs["mm_encoder_outputs"] = self._vision_features(
                pixel_values, kwargs.get("image_grid_thw"), pixel_values_videos, kwargs.get("video_grid_thw")
            )
        elif self.training and torch.is_grad_enabled():  # type: ignore[attr-defined]
            idle = self._idle_vision_tower()  # first, so every rank runs the FSDP units in the same order
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        return add_idle(out, idle)

    def _packed_positions(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A packed row's ``position_ids`` [4, 1, T] from its text positions [1, T] (restarting at 0 at every
        sample): row 0 those positions (which transformers' masks read to keep attention inside each sample),
        rows 1-3 the model's own ``get_rope_index`` run on each sample separately (the 3-D positions of the
        unpacked run). transformers' document kwargs (``cu_seq_lens_*``, ``max_length_*``) are taken out: the
        vision tower would read them as its own with flash attention; the language model finds the same
        documents from the positions."""
        model: Any = self.model  # type: ignore[attr-defined]
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(key, None)
        input_ids, text = kwargs["input_ids"], kwargs["position_ids"]
        if input_ids.shape[0] != 1 or text.shape != input_ids.shape:
            raise ValueError(
                "a packed batch (position_ids without attention_mask) holds one row: input_ids and "
                f"position_ids [1, T]; got {tuple(input_ids.shape)} and {tuple(text.shape)}"
            )
        types = kwargs.get("mm_token_type_ids")
        if types is None:
            if kwargs.get("image_grid_thw") is not None or kwargs.get("video_grid_thw") is not None:
                raise ValueError("a packed batch with images or videos needs mm_token_type_ids")
            types = torch.zeros_like(input_ids)
        starts = (text[0] == 0).nonzero().flatten().tolist()
        bounds = [*starts, text.shape[1]] if starts and starts[0] == 0 else [0, *starts, text.shape[1]]
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ()
        if len(lengths) > 1 and "linear_attention" in layer_types:
            raise ValueError(
                "data.dataloader_param.packing: the linear-attention (Gated DeltaNet) layers of "
                f"{type(self).__name__} carry their state across the samples of a packed row; set packing: "
                "false for this model"
            )
        ids = input_ids.new_zeros(len(lengths), max(lengths))
        each_types = types.new_zeros(ids.shape)
        mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        for i, (start, n) in enumerate(zip(bounds[:-1], lengths)):
            ids[i, :n] = input_ids[0, start : start + n]
            each_types[i, :n] = types[0, start : start + n]
            mask[i, :n] = True
        rope, _ = model.get_rope_index(
            ids,
            mm_token_type_ids=each_types,
            image_grid_thw=kwargs.get("image_grid_thw"),
            video_grid_thw=kwargs.get("video_grid_thw"),
            attention_mask=mask,
        )
        rope = rope[:, mask].unsqueeze(1)  # the samples' positions in row order: [3, 1, T]
        kwargs["position_ids"] = torch.cat([text.unsqueeze(0).to(rope), rope])
        return kwargs

    def _vision_features(
        self,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
    ) -> dict[str, Any]:
        """:func:`vision_features` of this model."""
        model: Any = self.model  # type: ignore[attr-defined]
        return vision_features(model, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)


def vision_features(
    model: Any,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
) -> dict[str, Any]:
    """transformers' ``mm_encoder_outputs`` (``"image"``, ``"video"``, each where given) from one pass of the
    vision tower of ``model`` (a transformers ``*Model`` with ``get_image_features``) over the images and
    videos together (each image or video attends within itself, so its features are those of separate
    passes). Shared by the Qwen-VL models and Qwen3-Omni's thinker."""
    parts: list[tuple[str, Any, Any]] = [
        (k, p, g)
        for k, p, g in (
            ("image", pixel_values, image_grid_thw),
            ("video", pixel_values_videos, video_grid_thw),
        )
        if p is not None
    ]
    pixels = torch.cat([p for _, p, _ in parts]) if len(parts) > 1 else parts[0][1]
    grid = torch.cat([g for _, _, g in parts]) if len(parts) > 1 else parts[0][2]
    both = model.get_image_features(pixels, grid, return_dict=True)
    out, start = {}, 0
    for kind, _, g in parts:
        count = len(g)
        out[kind] = _items(both, start, start + count)
        start += count
    return out


def _items(features: Any, start: int, stop: int | None) -> Any:
    """A copy of a vision-tower output (per-item ``pooler_output`` and, where present, per-layer
    ``deepstack_features``, each a tuple over images/videos) holding items ``start:stop``."""
    part = copy.copy(features)
    part.pooler_output = tuple(features.pooler_output[start:stop])
    deepstack = getattr(features, "deepstack_features", None)
    if deepstack is not None:
        part.deepstack_features = [tuple(layer[start:stop]) for layer in deepstack]
    return part
