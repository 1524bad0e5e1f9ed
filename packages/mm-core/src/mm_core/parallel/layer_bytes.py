"""What one decoder layer keeps for backward, per micro-batch: the counts behind ``mm check``'s activation
estimate (:mod:`mm_core.parallel.estimate`).

Two kinds of decoder are counted, from the sizes in the text configuration:

- a decoder of full-attention layers (the Qwen3 / Llama kind): per token 6 hidden-sized tensors, 4 (2 without
  q/k norms) query- and key/value-sized ones and 4 intermediate-sized ones, all in the compute dtype;
- a hybrid decoder of gated delta-rule linear-attention and gated full-attention layers, told by its
  ``layer_types`` and ``linear_*`` sizes (Qwen3.5, Qwen3.5-MoE, Qwen3.6; Qwen3-Next's layers have the same
  parts). Each saved tensor of transformers' implementation is counted with its dtype (RMSNorms and the delta
  rule compute in fp32): see :func:`hybrid_layer_bytes` and docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mm_core.models.facts import ModelFacts

#: the chunk length of the gated delta rule's chunked form (transformers' implementation and the
#: flash-linear-attention kernels both use 64)
DELTA_RULE_CHUNK = 64
#: bytes of an fp32 element (norms, softmax probabilities and the delta rule run in fp32 whatever the
#: compute dtype) and of an int64 index
FP32, INDEX = 4, 8


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer, one micro-batch: the bytes it saves for backward, and what selective recompute
    keeps of them (the attention output and its log-sum-exp; 0 for a linear-attention layer)."""

    saved: float
    selective: float


def standard_layer_bytes(facts: ModelFacts, tokens: int, itemsize: int, qk_norm: bool) -> LayerBytes:
    """A full-attention decoder layer with a dense MLP (module docstring), all in the compute dtype."""
    h, i = facts.hidden_size, facts.intermediate_size
    heads = facts.num_heads
    q, kv = heads * facts.head_dim, facts.num_kv_heads * facts.head_dim
    per_token = 6 * h + (4 if qk_norm else 2) * (q + kv) + 4 * i
    return LayerBytes(tokens * per_token * itemsize, tokens * (q * itemsize + heads * FP32))


def _int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _delta_rule_mixer(config: Any, h: int, tokens: int, s: int) -> float | None:
    """A gated delta-rule (Gated DeltaNet) token mixer: None without its ``linear_*`` sizes.

    ``T`` tokens are padded to ``Tp`` (a multiple of the chunk, ``n`` chunks); the query and key heads are
    repeated to the value heads inside the rule, so its query/key tensors have ``Hv * dk`` per token."""
    hk, hv = _int(config, "linear_num_key_heads"), _int(config, "linear_num_value_heads")
    dk, dv = _int(config, "linear_key_head_dim"), _int(config, "linear_value_head_dim")
    kernel = _int(config, "linear_conv_kernel_dim")
    if not all((hk, hv, dk, dv, kernel)):
        return None
    c = DELTA_RULE_CHUNK
    n = math.ceil(tokens / c)
    t, tp = tokens, n * c
    qk, v = hv * dk, hv * dv
    conv = 2 * hk * dk + hv * dv
    return (
        t * h * s  # the input of the four projections
        + (2 * t + kernel - 1) * conv * s  # causal convolution: its padded input and its output
        + 5 * hv * tp * c * FP32  # chunk x chunk: decays, the UT system and its solve, intra-chunk scores
        + (2 * t + 6 * tp) * qk * FP32  # queries and keys: l2-normalised, scaled, chunked, decayed
        + (3 * t + 3 * tp) * v * FP32  # values in fp32, chunked, the new values; the gated norm's fp32
        + 3 * t * v * s  # the gated norm's gate and output, the output projection's input
        + (5 * t + 4 * tp) * hv * FP32  # per-head beta, decay and the norms' scales
        + t * hv * s
        + n * hv * dk * dv * FP32  # the recurrent state entering each chunk
        + c * c  # the causal mask (bool)
        + (n + 2) * hv * FP32  # the chunks' decays, A and dt
    )


def _gated_attention_mixer(facts: ModelFacts, tokens: int, s: int) -> float:
    """Gated full attention (q/k RMSNorms in fp32, a sigmoid output gate as wide as the queries)."""
    q, kv = facts.num_heads * facts.head_dim, facts.num_kv_heads * facts.head_dim
    per_token = (
        facts.hidden_size * s  # the projections' input
        + q * (2 * FP32 + 5 * s)  # q norm (fp32 in/out); rotated q; output, gate, their product
        + kv * (2 * FP32 + 2 * s)  # k norm (fp32); rotated k and v
        + (2 * facts.num_heads + facts.num_kv_heads) * FP32  # norm scales, the attention's log-sum-exp
    )
    return tokens * per_token + 2 * facts.head_dim * FP32  # and the q/k norms' weights in fp32


def _mlp(config: Any, facts: ModelFacts, layer: int, tokens: int, s: int) -> float | None:
    """A dense gated MLP, or a mixture of experts with a gated shared expert (``moe_intermediate_size``)."""
    h = facts.hidden_size
    moe_width = _int(config, "moe_intermediate_size")
    dense_layers = getattr(config, "mlp_only_layers", None) or ()
    if facts.num_experts and moe_width and layer not in dense_layers:
        k, shared = facts.experts_per_token, _int(config, "shared_expert_intermediate_size")
        routed = k * (2 * h + 4 * moe_width) * s  # each routed copy: input, output, gate-up, SiLU, product
        router = facts.num_experts * FP32 + k * (FP32 + 4 * INDEX + s) + FP32  # probabilities, top-k, order
        shared_expert = (2 * h + 4 * shared + 1) * s if shared else 0
        return tokens * (routed + router + shared_expert)
    if not facts.intermediate_size:
        return None
    return tokens * (h + 4 * facts.intermediate_size) * s


def hybrid_layer_bytes(facts: ModelFacts, tokens: int, itemsize: int) -> list[LayerBytes] | None:
    """Each layer of a hybrid linear/full-attention decoder (module docstring), or None when the text
    configuration is not one (no ``linear_attention`` in ``layer_types``) or lacks a size it needs.

    Per layer: its two RMSNorms (the fp32 input and normalised output, and the scale, per token), its token
    mixer (:func:`_delta_rule_mixer` or :func:`_gated_attention_mixer`) and its MLP (:func:`_mlp`). The delta
    rule is counted as transformers' reference implementation keeps it (the path that runs without the
    flash-linear-attention kernels); those kernels keep less, so for them this is an upper bound."""
    config = facts.text_config
    kinds = list(getattr(config, "layer_types", None) or ())
    if "linear_attention" not in kinds or len(kinds) != facts.num_layers:
        return None
    h = facts.hidden_size
    norms = tokens * 2 * (2 * h * FP32 + FP32) + 2 * h * FP32  # and their weights in fp32
    q_width = facts.num_heads * facts.head_dim
    out = []
    for index, kind in enumerate(kinds):
        mixer = (
            _delta_rule_mixer(config, h, tokens, itemsize)
            if kind == "linear_attention"
            else _gated_attention_mixer(facts, tokens, itemsize)
        )
        mlp = _mlp(config, facts, index, tokens, itemsize)
        if mixer is None or mlp is None:
            return None
        kept = tokens * (q_width * itemsize + facts.num_heads * FP32)
        selective = 0 if kind == "linear_attention" else kept
        out.append(LayerBytes(norms + mixer + mlp, selective))
    return out
