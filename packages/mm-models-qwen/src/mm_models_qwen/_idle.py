"""The idle-tower rule shared by the Qwen models with towers (vision, audio).

Under FSDP every rank must run the same units, in the same order, each step: a micro-batch without images
(or without audio) would otherwise skip the tower's all-gathers on one rank while another rank waits in
them. A model runs a missing tower on a blank minimal input and adds ``0 ×`` its output to the logits and
the loss, so the tower's parameters take (zero) gradients on every rank. The blank input is created before
the towers that do run, in the order the model's forward runs them: the backward then reduces the units'
gradients in the same order on every rank too (autograd runs later-created nodes first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def idle_vision_tower(visual: nn.Module) -> torch.Tensor:
    """Run a Qwen-VL vision tower (``visual(pixels, grid_thw=...)``, outputs with ``pooler_output`` and
    optional ``deepstack_features``) on one blank ``merge × merge`` patch image; returns 0 × its outputs."""
    cfg: Any = visual.config
    merge = cfg.spatial_merge_size
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    weight: Any = visual.get_submodule("patch_embed.proj").weight
    pixels = torch.zeros(merge * merge, dim, dtype=weight.dtype, device=weight.device)
    grid = torch.tensor([[1, merge, merge]], device=weight.device)
    out = visual(pixels, grid_thw=grid)
    total = out.pooler_output.sum()
    for feature in getattr(out, "deepstack_features", None) or []:
        total = total + feature.sum()
    return total * 0.0


def idle_audio_tower(model: nn.Module, frames: int) -> torch.Tensor:
    """Run a Qwen audio tower through ``model.get_audio_features(features, mask)`` (Qwen3-ASR: tower and
    projector; Qwen3-Omni's thinker: tower with its output projection) on a blank clip of ``frames`` mel
    frames of which the first is valid (one output row); returns 0 × its outputs.

    ``frames``: the padded length the tower accepts (Qwen3-ASR: a multiple of ``2 * n_window``)."""
    tower: Any = model.get_submodule("model.audio_tower")
    weight = tower.conv2d1.weight
    features = torch.zeros(1, tower.config.num_mel_bins, frames, dtype=weight.dtype, device=weight.device)
    mask = torch.zeros(1, frames, dtype=torch.long, device=weight.device)
    mask[0, 0] = 1
    get_audio_features: Any = model.get_audio_features
    out = get_audio_features(features, mask, return_dict=True)
    rows = out.pooler_output if out.pooler_output is not None else out.last_hidden_state
    return rows.sum() * 0.0


def embed_first(model: nn.Module, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    """Set ``kwargs["inputs_embeds"]`` to the token embeddings of ``input_ids`` (unless given), before a
    model runs an idle audio tower: transformers' forward embeds the tokens before it runs the real audio
    tower, and the embedding is an FSDP unit, so it must run before the idle tower too."""
    if input_ids is not None and kwargs.get("inputs_embeds") is None:
        get_input_embeddings: Any = model.get_input_embeddings
        kwargs["inputs_embeds"] = get_input_embeddings()(input_ids)


def add_idle(out: Any, idle: torch.Tensor | None) -> Any:
    """Add an idle tower's ``0 × output`` to the logits and, when present, the model's own loss (``loss_type:
    raw`` back-propagates the model's ``.loss``); returns ``out``."""
    if idle is None:
        return out
    out.logits = out.logits + idle
    if out.loss is not None:
        out.loss = out.loss + idle
    return out
