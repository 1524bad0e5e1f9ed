"""What a Qwen3-TTS micro-batch keeps for backward: ``ModelPlan.activations`` of ``qwen3_tts`` (``mm check``'s
memory estimate; :mod:`mm_core.parallel.layer_bytes`).

The talker's Qwen3 layers run over the micro-batch's ``T`` positions; the code predictor's Qwen3 layers run
over ``G`` positions per frame (the talker state before the frame and its codebooks 0..G-2), ``F·G``
positions for ``F`` frames, at its own width. Outside the layers: the text and codec embeddings (indices,
the text projection's inputs, the masks), the frames' codes, both stacks' rotary tables and final norms, the
codebook-0 head and loss over the ``L`` label positions, the projection into the code predictor and its
``G - 1`` heads and loss per frame. A frame is one position of the talker's sequence, so ``F <= T``: the
estimate takes ``F = L = T`` (every position a frame), an upper bound, since each sample also holds its role,
control and text positions. The attention mask of a padded micro-batch is not counted (docs/memory.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mm_core.parallel.layer_bytes import (
    FP32,
    INDEX,
    ActivationCount,
    ActivationQuery,
    DecoderSizes,
    decoder_layer_bytes,
    rms_norm_bytes,
    rotary_bytes,
)

from .qwen3_tts_config import DecoderConfig, Qwen3TTSConfig


def _sizes(stack: DecoderConfig) -> DecoderSizes:
    return DecoderSizes(
        stack.hidden_size,
        stack.intermediate_size,
        stack.num_attention_heads,
        stack.num_key_value_heads,
        stack.head_dim,
    )


def tts_activations(
    config: Qwen3TTSConfig, positions: int, frames: int, labels: int, s: int
) -> ActivationCount:
    """The count for ``positions`` talker positions holding ``frames`` frames and ``labels`` codebook-0 label
    positions (the frames and each sample's ``codec_eos``), in a compute dtype of ``s`` bytes (module
    docstring)."""
    talker, predictor, groups = config.talker, config.code_predictor, config.num_code_groups
    t, f, n = positions, frames, labels
    h, hp = talker.hidden_size, predictor.hidden_size
    inner = f * groups  # the code predictor's positions
    talker_layer = decoder_layer_bytes(_sizes(talker), t, s, qk_norm=True)
    predictor_layer = decoder_layer_bytes(_sizes(predictor), inner, s, qk_norm=True)
    layers = {f"talker.model.layers.{i}": talker_layer for i in range(talker.num_hidden_layers)}
    layers.update(
        {
            f"talker.code_predictor.model.layers.{i}": predictor_layer
            for i in range(predictor.num_hidden_layers)
        }
    )
    inputs = (
        2 * t * INDEX  # text and codec ids
        + 3 * t * config.text_hidden_size * s  # the text projection: its input, SiLU's input, fc2's input
        + 2 * t * s  # the attention and codec masks, as multipliers
        + f * groups * INDEX  # the frames' codes
        + 2 * f * INDEX  # where the frames are
    )
    talker_out = (
        rotary_bytes(t, talker.head_dim, s)
        + t * rms_norm_bytes(h, s)  # the final norm (its weighted output is only indexed)
        + t  # the positions before each frame (bool)
        + n * (2 * INDEX + h * s + talker.vocab_size * FP32 + INDEX)  # label positions, head input, log-probs
    )
    predictor_out = (
        (inner * h * s if config.has_projection else 0)  # the projection's input
        + rotary_bytes(inner, predictor.head_dim, s)
        + inner * (rms_norm_bytes(hp, s) + hp * s)  # the final norm and the heads' input
        + f * (groups - 1) * (predictor.vocab_size * FP32 + INDEX)  # log-probabilities, targets
    )
    means = f * (INDEX + FP32) + n * FP32  # each sample's mean of its losses
    start = 2 * FP32 * (n * talker.vocab_size + f * (groups - 1) * predictor.vocab_size)
    return ActivationCount(layers, inputs + talker_out + predictor_out + means, backward_start=start)


def count_activations(model: nn.Module, query: ActivationQuery) -> ActivationCount:
    """``ModelPlan.activations`` of ``qwen3_tts``: :func:`tts_activations` with every one of the
    micro-batch's positions a frame and a label (the upper bound of the module docstring)."""
    config: Any = model.config
    tokens = query.local_tokens
    return tts_activations(config, tokens, tokens, tokens, query.itemsize)
