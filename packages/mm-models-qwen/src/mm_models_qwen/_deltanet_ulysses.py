"""Ulysses context parallelism over Qwen3.5's Gated DeltaNet (linear attention) layers.

Outside attention every rank of a Ulysses group holds a contiguous slice of each sequence
(:class:`mm_parallel.context.SequenceLayout`). A Gated DeltaNet layer is, by the published architecture:

1. token-local projections of the hidden states: ``q``, ``k`` (``linear_num_key_heads`` heads), ``v`` and the
   output gate ``z`` (``linear_num_value_heads`` heads), and per value head the write strength ``b`` and the
   decay input ``a``;
2. a causal depthwise convolution (kernel ``linear_conv_kernel_dim``) over the sequence, one filter per
   channel of ``q``, ``k`` and ``v``, then the activation;
3. the gated delta rule, a recurrence over the sequence per value head (each key head serves
   ``num_v_heads / num_k_heads`` consecutive value heads), with ``beta = sigmoid(b)`` and
   ``g = -exp(A_log) * softplus(a + dt_bias)``;
4. the gated RMS norm of each head's output with ``z``, and the token-local output projection.

Steps 2 and 3 mix tokens but never heads (nor channels of different heads), so Ulysses applies as to
attention: after the projections of the local tokens one all-to-all turns "all heads of 1/U of the sequence"
into "1/U of the heads (with their channels, ``b`` and ``a``) of the whole sequence", each rank convolves and
runs the recurrence for its heads with its rows of ``conv1d.weight``, ``A_log`` and ``dt_bias``, and the
inverse all-to-all brings the heads' outputs back to the local tokens for steps 4. The same kernels run as in
one process (transformers' ``causal_conv1d_fn`` and ``chunk_gated_delta_rule``, which use the
``causal-conv1d`` / flash-linear-attention kernels where installed), so the result equals one process up to
float rounding.

Ring attention is refused for these layers (``mm_core.parallel.context``): the recurrence carries a state
through the sequence in order, while ring ranks hold zigzag chunks of it.

The Gated DeltaNet modules of a model are given this forward by :func:`use_ulysses_deltanet`, which changes
their class to a subclass defined here (as FSDP2's ``fully_shard`` does for the modules it wraps): parameters,
names and checkpoints are unchanged, and without a Ulysses layout (no context parallelism, evaluation) the
forward is transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as _dense
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as _moe

from mm_core.errors import ConfigError
from mm_core.parallel.context import LAYOUT_KWARG
from mm_parallel.context import SequenceLayout, heads_to_seq, seq_to_heads

#: the YAML key whose value is the Ulysses size
_KEY = "parallel.ulysses_parallel_size"


class _UlyssesDeltaNet(nn.Module):
    """The Ulysses forward of a Gated DeltaNet layer (mixed in front of transformers' class)."""

    # attributes of transformers' Gated DeltaNet modules
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    key_dim: int
    value_dim: int
    activation: str
    in_proj_qkv: nn.Linear
    in_proj_z: nn.Linear
    in_proj_b: nn.Linear
    in_proj_a: nn.Linear
    conv1d: nn.Conv1d
    A_log: nn.Parameter
    dt_bias: nn.Parameter
    norm: Any  # transformers' gated RMS norm: norm(x, gate)
    out_proj: nn.Linear

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        layout = kwargs.get(LAYOUT_KWARG)
        if not isinstance(layout, SequenceLayout) or layout.ulysses_size == 1:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if cache is not None:
            raise RuntimeError("Gated DeltaNet under Ulysses context parallelism runs without a cache")
        if layout.ring_size > 1 or layout.ulysses_group is None:
            raise RuntimeError(
                "Gated DeltaNet layers run under Ulysses context parallelism only (ring attention is refused "
                "when the model is planned)"
            )
        return self._ulysses_forward(hidden_states, attention_mask, layout)

    def _ulysses_forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, layout: SequenceLayout
    ) -> torch.Tensor:
        size, rank, group = layout.ulysses_size, layout.ulysses_rank, layout.ulysses_group
        assert group is not None
        if attention_mask is not None and attention_mask.dim() == 2:  # padding of this rank's tokens
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        batch, local_len, _ = hidden_states.shape
        nk, nv = self.num_k_heads // size, self.num_v_heads // size  # heads per rank
        dk, dv = self.head_k_dim, self.head_v_dim

        # 1. token-local projections, grouped by destination rank: [batch, local_len, size, channels]
        q, k, v = self.in_proj_qkv(hidden_states).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        parts = [(q, nk * dk), (k, nk * dk), (v, nv * dv), (b, nv), (a, nv)]
        widths = [w for _, w in parts]
        grouped = torch.cat([t.reshape(batch, local_len, size, w) for t, w in parts], dim=-1)
        # all-to-all: [batch, size, local_len, c] as "size heads" -> this rank's [batch, 1, whole sequence, c]
        mine = seq_to_heads(grouped.transpose(1, 2), group, size).squeeze(1)
        q, k, v, b, a = mine.split(widths, dim=-1)

        # 2. causal depthwise convolution of this rank's channels of q, k and v
        rows = [  # this rank's channels of q, k and v in the convolution's rows
            slice(rank * nk * dk, (rank + 1) * nk * dk),
            slice(self.key_dim + rank * nk * dk, self.key_dim + (rank + 1) * nk * dk),
            slice(2 * self.key_dim + rank * nv * dv, 2 * self.key_dim + (rank + 1) * nv * dv),
        ]
        weight = self.conv1d.weight.squeeze(1)
        bias = self.conv1d.bias
        mixed = _dense.causal_conv1d_fn(
            torch.cat([q, k, v], dim=-1).transpose(1, 2),
            torch.cat([weight[r] for r in rows]),
            None if bias is None else torch.cat([bias[r] for r in rows]),
            activation=self.activation,
        ).transpose(1, 2)
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
        seq_len = q.shape[1]

        # 3. the gated delta rule over the whole sequence for this rank's heads
        heads = slice(rank * nv, (rank + 1) * nv)
        beta = b.sigmoid()
        g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
        out, _ = _dense.torch_chunk_gated_delta_rule(
            q.reshape(batch, seq_len, nk, dk),
            k.reshape(batch, seq_len, nk, dk),
            v.reshape(batch, seq_len, nv, dv),
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        # inverse all-to-all: [batch, 1, seq_len, nv*dv] -> [batch, size, local_len, nv*dv] (rank-major heads)
        out = heads_to_seq(out.reshape(batch, 1, seq_len, nv * dv), group, size)
        out = out.transpose(1, 2).reshape(batch * local_len * self.num_v_heads, dv)

        # 4. gated norm per head and the output projection, on this rank's tokens
        z = self.in_proj_z(hidden_states).reshape(-1, dv)
        normed = self.norm(out, z).reshape(batch, local_len, self.value_dim)
        return self.out_proj(normed)


class UlyssesQwen3_5GatedDeltaNet(_UlyssesDeltaNet, _dense.Qwen3_5GatedDeltaNet):
    """transformers' ``Qwen3_5GatedDeltaNet`` with the Ulysses forward."""


class UlyssesQwen3_5MoeGatedDeltaNet(_UlyssesDeltaNet, _moe.Qwen3_5MoeGatedDeltaNet):
    """transformers' ``Qwen3_5MoeGatedDeltaNet`` with the Ulysses forward."""


_ULYSSES_CLASS: dict[type[nn.Module], type[nn.Module]] = {
    _dense.Qwen3_5GatedDeltaNet: UlyssesQwen3_5GatedDeltaNet,
    _moe.Qwen3_5MoeGatedDeltaNet: UlyssesQwen3_5MoeGatedDeltaNet,
}


def use_ulysses_deltanet(model: nn.Module, size: int) -> None:
    """Give every Gated DeltaNet layer of ``model`` the Ulysses forward (``ModelPlan.ulysses_layers``).

    Raises :class:`ConfigError` naming ``parallel.ulysses_parallel_size`` when ``size`` does not divide the
    layers' key and value head counts (each rank takes whole heads)."""
    found = 0
    for name, module in model.named_modules():
        cls = type(module)
        if cls in _ULYSSES_CLASS.values():
            found += 1
            continue
        target = _ULYSSES_CLASS.get(cls)
        if target is None:
            continue
        for what, heads in (
            ("linear_num_key_heads", module.num_k_heads),
            ("linear_num_value_heads", module.num_v_heads),
        ):
            if heads % size:
                raise ConfigError(
                    f"{_KEY}: got {size}; it must divide the Gated DeltaNet layers' {what} {heads} "
                    f"({name}): each Ulysses rank takes whole heads"
                )
        module.__class__ = target
        found += 1
    if not found:
        raise ConfigError(f"{_KEY}: {type(model).__name__} has no Gated DeltaNet layer to run under Ulysses")
