"""Ulysses context parallelism over the video tokens of a Wan diffusion transformer.

The token sequence of a DiT exists only inside the model (after the patch embedding), so mm cannot split
the batch before the forward as it does for language models. Instead (``ModelPlan.context_parallel``) the
model is handed the context-parallel mesh once and splits itself, with forward hooks on diffusers' own
modules (the model's forward is diffusers' unchanged):

- ``rope``: its ``(cos, sin)`` tables ``[1, S, 1, d]`` are cut to this rank's tokens;
- ``blocks.0``: the patch-embedded tokens ``[B, S, D]`` entering the first block are cut the same way
  (rank ``r`` of ``U`` holds the contiguous tokens ``[r·S/U, (r+1)·S/U)``); the following blocks receive the
  previous block's local output;
- the attention processor (:class:`UlyssesWanAttnProcessor`, set with diffusers' ``set_attn_processor``):
  self-attention moves ``[B, heads, S/U, d]`` to ``[B, heads/U, S, d]`` with mm-parallel's all-to-all
  (:func:`mm_parallel.context.seq_to_heads`), attends with non-causal SDPA over the whole sequence and moves
  back; cross-attention needs no exchange (the local queries attend to the whole text, on every rank);
- ``proj_out``: its local output ``[B, S/U, C·p]`` is all-gathered along the tokens before diffusers'
  unpatchify, so the forward returns the whole prediction on every rank.

**Loss and gradients.** Every rank of a context-parallel group then computes the same loss of the whole
sample. The gather's backward sums the incoming gradients over the group (a reduce-scatter), so each rank's
share of the gradient is that of ``U ×`` the loss, and FSDP's average over the ``U`` ranks (it reduces over
``dp_shard × cp``) gives exactly the gradient of one process; the loss mean over ranks (``loss_type: raw``) is
the sample's loss. The timestep embedding is per sample (not per token), so it needs no split.

Only Ulysses is supported: ring attention (``parallel.ring_attention_size``) is refused, the number of heads
must be a multiple of the Ulysses size and the tokens of every sample (frames × height × width after
patchify) a multiple of it too (no padding: the attention is over every token).

The model-independent pieces (the token split, the gather, the all-to-all attention, the mesh checks) are
shared with LTX-2's split (:mod:`mm_models_video.ulysses_ltx2`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mm_core.errors import ConfigError, DataError
from mm_parallel.context import heads_to_seq, seq_to_heads


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 1 (equal shards, rank order); the backward sums the gradients over the group
    and keeps this rank's shard (a reduce-scatter, written as all-reduce + slice so that gloo runs it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
    """All ranks' tokens of ``x`` [B, S/U, ...] in rank order, [B, S, ...] (backward: see
    :class:`_GatherTokens`)."""
    gathered: torch.Tensor = _GatherTokens.apply(x, group, rank, size)
    return gathered


def split_tokens(
    x: torch.Tensor, rank: int, size: int, dim: int = 1, what: str = "video tokens"
) -> torch.Tensor:
    """This rank's contiguous ``1/size`` of ``x`` along ``dim``; a DataError when it does not divide."""
    n = x.shape[dim]
    if n % size:
        raise DataError(
            f"parallel.ulysses_parallel_size: a sample has {n} {what} after patchify (latent "
            f"frames × height × width over the patch size), not a multiple of the Ulysses size "
            f"{size}; use clip sizes whose token count it divides"
        )
    return x.chunk(size, dim=dim)[rank]


def ulysses_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup, size: int
) -> torch.Tensor:
    """Non-causal attention over the whole sequence for this rank's tokens: ``[B, S/U, H, d]`` in and out;
    heads are exchanged for tokens with mm-parallel's all-to-all around SDPA."""
    q, k, v = (seq_to_heads(t.transpose(1, 2), group, size) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)  # [B, H/U, S, d]
    return heads_to_seq(out, group, size).transpose(1, 2)


def ulysses_group(mesh: DeviceMesh, heads: int, family: str) -> tuple[dist.ProcessGroup, int, int] | None:
    """``(group, rank, size)`` of ``mesh["ulysses"]``, None when its size is 1; ring attention and a head
    count the size does not divide are ConfigErrors."""
    ring, ulysses = mesh["ring"].size(), mesh["ulysses"].size()
    if ring > 1:
        raise ConfigError(
            f"parallel.ring_attention_size: got {ring}; {family}'s video tokens are split with Ulysses only "
            "(use parallel.ulysses_parallel_size)"
        )
    if ulysses == 1:
        return None
    if heads % ulysses:
        raise ConfigError(
            f"parallel.ulysses_parallel_size: got {ulysses}; it must divide the model's num_attention_heads "
            f"{heads}"
        )
    return mesh["ulysses"].get_group(), mesh["ulysses"].get_local_rank(), ulysses


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding: channel pairs ``(2i, 2i+1)`` rotated by the angle whose cosine is
    ``cos[..., 2i]`` and sine ``sin[..., 2i+1]`` (diffusers stores both repeated per pair)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    return out.type_as(x)


class UlyssesWanAttnProcessor:
    """A diffusers attention processor for ``WanAttention``: Ulysses self-attention over the sharded tokens,
    cross-attention as diffusers' own processor computes it."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.group, self.size = group, size
        self.cross = WanAttnProcessor()

    def __call__(
        self,
        attn: Any,  # a diffusers WanAttention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            return self.cross(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if attention_mask is not None:
            raise ValueError("Ulysses self-attention over video tokens takes no attention mask")
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        heads = attn.heads
        query, key, value = (t.unflatten(2, (heads, -1)) for t in (query, key, value))  # [B, S/U, H, d]
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        out = ulysses_attention(query, key, value, self.group, self.size).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class UlyssesSplit:
    """The hooks that split a Wan transformer's tokens over a Ulysses group (module docstring)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.handles = [
            model.get_submodule("rope").register_forward_hook(self._split_rope),
            model.get_submodule("blocks.0").register_forward_pre_hook(self._split_tokens),
            model.get_submodule("proj_out").register_forward_hook(self._gather),
        ]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``x`` (dim 1)."""
        return split_tokens(x, self.rank, self.size)

    def _split_rope(self, module: nn.Module, args: Any, output: Any) -> Any:
        return tuple(self.local(t) for t in output)

    def _split_tokens(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.local(args[0]), *args[1:])

    def _gather(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_tokens(output, self.group, self.rank, self.size)


def attach_ulysses(model: nn.Module, mesh: DeviceMesh) -> UlyssesSplit | None:
    """Make a ``WanTransformer3DModel`` (sharded or not) run Ulysses context parallel over ``mesh["ulysses"]``
    (the context-parallel mesh mm hands to ``ModelPlan.context_parallel``); None when its size is 1."""
    config: Any = getattr(model, "config", None)
    found = ulysses_group(mesh, int(config.num_attention_heads), "Wan")
    if found is None:
        return None
    group, rank, ulysses = found
    if config.added_kv_proj_dim is not None or config.image_dim is not None:
        raise ConfigError(
            "parallel.ulysses_parallel_size: image-conditioned Wan models (added_kv_proj_dim / image_dim) "
            "are not supported under context parallelism"
        )
    set_processor: Any = model.set_attn_processor
    set_processor(UlyssesWanAttnProcessor(group, ulysses))
    return UlyssesSplit(model, group, rank, ulysses)
