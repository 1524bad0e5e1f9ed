"""Ulysses context parallelism for LTX-2's audio-video transformer: the video tokens are split, the audio
stream is computed whole on every rank.

An LTX-2 block (diffusers' ``LTX2VideoTransformerBlock``) runs, for the video tokens and the audio tokens
side by side: self-attention (``attn1`` / ``audio_attn1``), cross-attention to the text (``attn2`` /
``audio_attn2``), audio-to-video cross-attention (``audio_to_video_attn``: video queries, audio keys and
values), video-to-audio cross-attention (``video_to_audio_attn``: audio queries, video keys and values) and
the feed-forwards. With ``U`` ranks in the Ulysses group, rank ``r`` holds the contiguous video tokens
``[r·N/U, (r+1)·N/U)`` and all the audio tokens:

- ``proj_in``'s output (the video tokens) and the video rotary tables of ``rope`` (self-attention) and
  ``cross_attn_rope`` (audio-video attention) are cut to this rank's tokens by forward hooks;
- video self-attention (:class:`UlyssesLTX2AttnProcessor`, ``mode="self"``) exchanges heads for tokens with
  the all-to-all of :func:`mm_models_video.ulysses.ulysses_attention`;
- video-to-audio attention (``mode="video_kv"``) all-gathers the video keys and values (after their norm
  and rotary embedding, which are per token) so that the whole audio attends to the whole video;
- the text cross-attentions, audio-to-video attention (local video queries, whole audio) and the whole
  audio stream need no exchange;
- ``proj_out``'s output is all-gathered, so every rank computes the loss of the whole sample.

**Exact gradients.** Every rank computes the same loss. A video token exists on one rank and receives
``U ×`` its gradient (the gathers' backward sums over the group); a replicated tensor (the audio stream, the
timestep embeddings, the gathered video keys) receives on each rank a part whose sum over the group is
``U ×`` its gradient (the audio loss gives each rank the whole gradient; what flows back from the local video
queries of audio-to-video attention is that rank's share, ``U ×``). The video-key gather's backward sums
those parts, so the local video tokens again get ``U ×`` their gradient. Every parameter's gradients, summed
over the group, are therefore ``U ×`` one process's, and FSDP's average over ``dp_shard × cp`` gives exactly
one process's gradient (tested in fp32 within 1e-5).

Why the audio is not split: it is short (LTX-2: 25 latent frames per second against thousands of video
tokens), so computing it ``U`` times costs little, and a split would add an exchange to every audio
attention. Limits: Ulysses only (``ring_attention_size`` is refused); ``num_attention_heads`` and every
sample's video token count must be multiples of ``U``; timesteps are per sample (the video modulation is
per sample, not per token); no attention masks other than the text mask, no spatio-temporal guidance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .ulysses import gather_tokens, split_tokens, ulysses_attention, ulysses_group

MODES = ("self", "video_kv")


def _rotary(attn: Any, x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' LTX-2 rotary embedding of ``x`` [B, S, H·d] (interleaved or split: ``attn.rope_type``)."""
    from diffusers.models.transformers.transformer_ltx2 import (
        apply_interleaved_rotary_emb,
        apply_split_rotary_emb,
    )

    if attn.rope_type == "split":
        return apply_split_rotary_emb(x, freqs)
    return apply_interleaved_rotary_emb(x, freqs)


class UlyssesLTX2AttnProcessor:
    """A diffusers attention processor for ``LTX2Attention`` under a Ulysses split of the video tokens:
    ``mode="self"`` for video self-attention, ``"video_kv"`` for video-to-audio attention (module
    docstring). The projections, norms, rotary embeddings and gates are diffusers' own modules and
    functions, in the order of diffusers' ``LTX2AudioVideoAttnProcessor``."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}; accepted: {', '.join(MODES)}")
        self.group, self.rank, self.size, self.mode = group, rank, size, mode

    def __call__(
        self,
        attn: Any,  # a diffusers LTX2Attention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError(f"Ulysses {self.mode} attention of LTX-2 takes no attention mask")
        if perturbation_mask is not None or bool(all_perturbed):
            raise ValueError("spatio-temporal guidance (perturbed attention) is not supported under Ulysses")
        if (encoder_hidden_states is None) != (self.mode == "self"):
            raise ValueError(f"Ulysses {self.mode} attention called with the wrong inputs")
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(source))
        value = attn.to_v(source)
        if query_rotary_emb is not None:
            query = _rotary(attn, query, query_rotary_emb)
            key = _rotary(attn, key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
        heads = attn.heads
        query, key, value = (t.unflatten(2, (heads, -1)) for t in (query, key, value))  # [B, S, H, d]
        if self.mode == "self":
            out = ulysses_attention(query, key, value, self.group, self.size)
        else:
            key = gather_tokens(key, self.group, self.rank, self.size)
            value = gather_tokens(value, self.group, self.rank, self.size)
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False).transpose(1, 2)
        out = out.flatten(2, 3).to(query.dtype)
        if gate_logits is not None:  # diffusers: 2·sigmoid(logits) per head, 1 when the logits are 0
            gates = (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)
            out = (out.unflatten(2, (heads, -1)) * gates).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


class UlyssesLTX2Split:
    """The hooks and processors that split an LTX-2 transformer's video tokens (module docstring)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.handles = [
            model.get_submodule("proj_in").register_forward_hook(self._split_tokens),
            model.get_submodule("rope").register_forward_hook(self._split_rotary),
            model.get_submodule("cross_attn_rope").register_forward_hook(self._split_rotary),
            model.get_submodule("proj_out").register_forward_hook(self._gather),
        ]
        blocks: Any = model.get_submodule("transformer_blocks")
        for block in blocks:
            block.attn1.set_processor(UlyssesLTX2AttnProcessor(group, rank, size, "self"))
            block.video_to_audio_attn.set_processor(UlyssesLTX2AttnProcessor(group, rank, size, "video_kv"))

    def _split_tokens(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return split_tokens(output, self.rank, self.size)

    def _split_rotary(self, module: nn.Module, args: Any, output: Any) -> Any:
        # interleaved tables are [B, N, D]; split ones [B, heads, N, d/2]
        return tuple(split_tokens(t, self.rank, self.size, dim=1 if t.dim() == 3 else 2) for t in output)

    def _gather(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_tokens(output, self.group, self.rank, self.size)


def attach_ulysses_ltx2(model: nn.Module, mesh: DeviceMesh) -> UlyssesLTX2Split | None:
    """Make an ``LTX2VideoTransformer3DModel`` (sharded or not) split its video tokens over
    ``mesh["ulysses"]``; None when its size is 1."""
    config: Any = getattr(model, "config", None)
    found = ulysses_group(mesh, int(config.num_attention_heads), "LTX-2")
    if found is None:
        return None
    group, rank, size = found
    return UlyssesLTX2Split(model, group, rank, size)
