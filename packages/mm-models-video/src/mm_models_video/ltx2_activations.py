"""What an LTX-2 micro-batch keeps for backward: ``ModelPlan.activations`` of ``ltx2`` (``mm check``'s memory
estimate; :mod:`mm_core.parallel.layer_bytes`).

Counted from diffusers' ``LTX2VideoTransformerBlock`` as it runs, each saved tensor with its dtype (``s``
bytes for the compute dtype, 4 for fp32). Per block, for a video token (width ``D``, ``H`` heads, feed-forward
``4D``) and an audio token (width ``A``, ``Ha`` heads):

- four RMSNorms without weights (self-attention, text cross-attention, audio-video attention, feed-forward),
  each saving its input, its fp32 copy and the reciprocal root (:func:`diffusers_norm_bytes`), and the
  normalised and modulated outputs that the modulation and the projections keep;
- per attention the q/k RMSNorms (``torch.nn.RMSNorm``: input and reciprocal root with CUDA's fused kernel,
  fp32 input and output elsewhere), the queries, keys, values, output and log-sum-exp that attention saves,
  and the gated output projection's output;
- audio-to-video attention (video queries, audio keys and values, at the audio width) and video-to-audio
  attention (audio queries, video keys and values);
- the feed-forward: GELU's input and output (``4D`` wide).

Outside the blocks: the patch embeddings' inputs, the caption projections, the rotary tables (fp32 cosines and
sines: video and audio self-attention, and the audio-video attention's own), the output norms and
projections, the fp32 difference of each flow-matching loss, and per sample the timestep embeddings and the
blocks' modulation parameters. ``mm check`` knows neither the data's text length nor how many samples share a
token budget: it counts one sample and no text tokens, which leaves out per sample and block
``L·(6D + 6A)·s`` for ``L`` text tokens (~19 MiB for LTX-2 at 256 text tokens).

Under Ulysses context parallelism (``U`` ranks; :mod:`mm_models_video.ulysses_ltx2`) a rank holds ``1/U`` of
the video tokens and the whole audio stream; the video-to-audio attention keeps the gathered keys and values
of every video token, the loss is computed on the whole sample on every rank, the self-attention's output is
kept both before and after its exchange, and the rotary tables and the patch embedding's output stay whole
(this rank's part is a view of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from mm_core.parallel.layer_bytes import (
    FP32,
    ActivationCount,
    ActivationQuery,
    LayerBytes,
    torch_rms_norm_bytes,
)


def diffusers_norm_bytes(width: int, s: int) -> int:
    """Per row: diffusers' ``RMSNorm`` without weight saves its input, its fp32 copy (none when the input is
    fp32) and the reciprocal root."""
    return width * s + (width * FP32 if s < FP32 else 0) + FP32


@dataclass(frozen=True)
class _Stream:
    """One modality's sizes: width, heads, feed-forward width, patch embedding input, output channels."""

    width: int
    heads: int
    ff: int
    channels_in: int
    channels_out: int


def _streams(config: Any) -> tuple[_Stream, _Stream]:
    video_width = int(config.num_attention_heads) * int(config.attention_head_dim)
    audio_width = int(config.audio_num_attention_heads) * int(config.audio_attention_head_dim)
    video = _Stream(
        video_width,
        int(config.num_attention_heads),
        4 * video_width,
        int(config.in_channels),
        int(config.out_channels or config.in_channels),
    )
    audio = _Stream(
        audio_width,
        int(config.audio_num_attention_heads),
        4 * audio_width,
        int(config.audio_in_channels),
        int(config.audio_out_channels or config.audio_in_channels),
    )
    return video, audio


def ltx2_activations(
    config: Any,
    video: int,
    audio: int,
    text: int,
    s: int,
    device_type: str,
    ulysses: int = 1,
    cross_modal: bool = True,
    samples: int = 1,
) -> ActivationCount:
    """The count for a micro-batch of ``samples`` samples holding ``video`` video tokens and ``audio`` audio
    tokens (after patchify, every sample together) and ``text`` text tokens (every sample's padded text), in
    a compute dtype of ``s`` bytes on ``device_type``, with the video split over ``ulysses`` ranks;
    ``cross_modal=False``: text-to-video (no audio-video attention). Module docstring."""
    v_, a_ = _streams(config)
    d, a = v_.width, a_.width
    v = -(-video // ulysses)  # this rank's video tokens

    def qk(width: int) -> int:
        return torch_rms_norm_bytes(width, s, device_type)

    def stream(x: _Stream) -> int:
        """Per token of one stream: self-attention, text cross-attention and feed-forward."""
        w, lse = x.width, x.heads * FP32
        norm = diffusers_norm_bytes(w, s)
        self_attention = norm + 7 * w * s + 2 * qk(w) + lse  # normalised, modulated, q k v out, gated output
        text_attention = norm + 3 * w * s + qk(w) + lse  # normalised (the query's input), q, out
        feed_forward = norm + 3 * w * s + 2 * x.ff * s  # normalised, modulated, output; GELU's input, output
        return self_attention + text_attention + feed_forward

    ha = a_.heads * FP32
    video_token = stream(v_)
    audio_token = stream(a_)
    gathered = 0
    if cross_modal:
        # video: the norm, its output (both modulations), the a2v query's input, q norm, q, out, log-sum-exp,
        # gated output; the v2a keys' input and k norm (their keys and values: of every video token, below)
        video_token += diffusers_norm_bytes(d, s) + 4 * d * s + 2 * qk(a) + 2 * a * s + ha
        # audio: the norm, its output, both modulated inputs, a2v k norm, k, v; v2a q norm, q, out, gated out
        audio_token += diffusers_norm_bytes(a, s) + 8 * a * s + 2 * qk(a) + ha
        gathered = video * 2 * a * s
    if ulysses > 1:
        video_token += d * s  # self-attention's output after the exchange back (the one before is SDPA's)
    text_token = qk(d) + 2 * d * s + qk(a) + 2 * a * s + (v_.heads + a_.heads) * s  # keys, values, mask
    # per sample: the modulation parameters and (1 + scale) factors the blocks' products keep
    modulation = samples * (11 if cross_modal else 8) * (d + a) * s
    saved = v * video_token + audio * audio_token + gathered + text * text_token + modulation
    selective = v * (2 * (d * s + v_.heads * FP32)) + audio * 2 * (a * s + ha)
    if cross_modal:
        selective += v * (a * s + ha) + audio * (a * s + ha)
    block = LayerBytes(saved, selective, v * d * s + audio * a * s)
    layers = {f"transformer_blocks.{i}": block for i in range(int(config.num_layers))}
    stats = 2 * (FP32 if device_type == "cuda" else s)  # the output LayerNorm's mean and reciprocal deviation
    outside = (
        video * v_.channels_in * s
        + audio * a_.channels_in * s  # the patch embeddings' inputs
        + (video - v) * d * s  # the patch embedding's whole output, of which this rank's part is a view
        + text * s * (2 * int(config.caption_channels) + 3 * d + 3 * a)  # caption projections, their outputs
        + 2 * FP32 * (video * d + audio * a)  # rotary tables of self-attention
        + (2 * FP32 * (video + audio) * a if cross_modal else 0)  # and of the audio-video attention
        + v * (3 * d * s + stats)
        + audio * (3 * a * s + stats)  # output norms, modulated outputs, the projections' inputs
        + FP32 * (video * v_.channels_out + audio * a_.channels_out)  # the losses' fp32 differences
        + samples * (6 * 256 + 12 * (d + a)) * s  # timestep embeddings (6 of 256 sinusoids) and modulations
    )
    return ActivationCount(layers, outside)


def count_activations(model: nn.Module, query: ActivationQuery) -> ActivationCount:
    """``ModelPlan.activations`` of ``ltx2``: the micro-batch's tokens all video tokens, or all audio tokens,
    whichever keeps more (the budget of ``data.dataloader_param.max_tokens_per_batch`` counts both and a
    count is linear in each, so no split of the tokens between them keeps more), with the audio-video
    attention on; one sample, no text tokens (module docstring)."""
    config: Any = model.config
    s, device = query.itemsize, query.device_type

    def total(count: ActivationCount) -> float:
        return count.outside + sum(layer.saved for layer in count.layers.values())

    as_video = ltx2_activations(config, query.tokens, 0, 0, s, device, query.cp)
    as_audio = ltx2_activations(config, 0, query.tokens, 0, s, device, query.cp)
    return as_video if total(as_video) >= total(as_audio) else as_audio
