"""What a model keeps for backward, per micro-batch: the counts behind ``mm check``'s activation estimate
(:mod:`mm_core.parallel.estimate`).

The contract: :class:`ActivationCount` names each recompute-able layer by its module path with the bytes it
saves (:class:`LayerBytes`), and what is kept outside those layers, for one micro-batch on one rank
(:class:`ActivationQuery`); the estimate applies the recompute and offload plans to it. Decoder language
models are counted here from the sizes in their text configuration; a model of another shape supplies its own
count (``ModelPlan.activations``), built from the parts below.

Each saved tensor is counted with its dtype: ``s`` bytes for the compute dtype
(``parallel.fsdp_plan.param_dtype``), 4 for fp32, 8 for int64 indices. Counted:

- transformers' RMSNorm (Qwen2, Qwen3): the fp32 input (a copy when the compute dtype is narrower), its
  reciprocal root mean square per row and the normalised output in the compute dtype
  (:func:`rms_norm_bytes`; the weighted output is its consumer's input);
- a decoder of full-attention layers with a dense or mixture-of-experts MLP (the Qwen2 / Qwen3 kind;
  :func:`decoder_layer_bytes`): per token two RMSNorms and their outputs, q/k norms when present, the rotated
  queries and keys, values, attention output and log-sum-exp that attention saves, and the MLP (4
  intermediate-sized tensors, or the routed experts' copies, router and shared expert: :func:`moe_mlp_bytes`);
- a hybrid decoder of gated delta-rule linear-attention and gated full-attention layers, told by its
  ``layer_types`` and ``linear_*`` sizes (Qwen3.5, Qwen3.5-MoE, Qwen3.6; Qwen3-Next's layers have the same
  parts): see :func:`hybrid_layer_bytes` and docs/memory.md;
- the output head and loss (:func:`loss_head_bytes`): fp32 log-probabilities, or with the chunked loss the
  head's weight gradient computed in the forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
    """One layer, one micro-batch: the bytes it saves for backward, what selective recompute keeps of them
    (the attention outputs and their log-sum-exp; 0 for a linear-attention layer) and what full recompute
    keeps (the layer's inputs)."""

    saved: float
    selective: float
    inputs: float


@dataclass(frozen=True)
class ActivationQuery:
    """What an activation count is asked for: one micro-batch on one rank."""

    #: the padded tokens of one micro-batch, the whole sequence (before any context-parallel split)
    tokens: int
    #: the context-parallel size (``ulysses`` x ``ring``): a model counts its own rank's share
    cp: int
    #: bytes of the compute dtype (``parallel.fsdp_plan.param_dtype``)
    itemsize: int
    #: the chunk of the chunked loss head (``model.loss_cfg.loss_chunk_size``); None: the loss takes the full
    #: logits (or the model computes its own loss)
    chunk: int | None
    #: the device the estimate is for (``cuda``, ``npu``, ``cpu``): some kernels save less on accelerators
    device_type: str = "cpu"

    @property
    def local_tokens(self) -> int:
        """This rank's tokens when the sequence is split evenly over ``cp`` ranks (rounded up)."""
        return -(-self.tokens // self.cp)


@dataclass(frozen=True)
class ActivationCount:
    """What one micro-batch keeps for backward on one rank (bytes)."""

    #: each recompute-able layer, by its module path, and what it saves
    layers: Mapping[str, LayerBytes]
    #: what is kept outside those layers: embeddings, rotary tables, the final norm, heads, the loss
    outside: float
    #: on top of what is kept while the forward runs (one chunk of logits of the chunked loss)
    forward_peak: float = 0.0
    #: on top of what is kept and of one layer's gradients at the start of backward (the logits' gradients)
    backward_start: float = 0.0


def rms_norm_bytes(width: int, s: int, scales: int = 1) -> int:
    """Per row of ``width``: a transformers RMSNorm (computed in fp32, cast back, then weighted) saves its
    fp32 input (a copy of a narrower input), ``scales`` reciprocal roots (one per normalised group: per head
    for q/k norms) and the normalised output in the compute dtype. The weighted output is counted where it
    is used (a projection's input)."""
    return width * (FP32 + s) + scales * FP32


def torch_rms_norm_bytes(width: int, s: int, device_type: str) -> int:
    """Per row of ``width``: ``torch.nn.RMSNorm`` with a weight. On CUDA, torch's fused kernel saves the input
    and the reciprocal root; elsewhere the composite saves the fp32 input, the reciprocal root and the fp32
    normalised output (before the weight)."""
    if device_type == "cuda":
        return width * s + FP32
    return 2 * width * FP32 + FP32


def rotary_bytes(tokens: int, width: int, s: int) -> int:
    """The cosine and sine tables of rotary embeddings, ``width`` per token, shared by every layer."""
    return 2 * tokens * width * s


@dataclass(frozen=True)
class DecoderSizes:
    """The sizes of one stack of Qwen2 / Qwen3-style decoder layers."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, facts: ModelFacts) -> DecoderSizes:
        f = facts
        return cls(f.hidden_size, f.intermediate_size, f.num_heads, f.num_kv_heads, f.head_dim)


def moe_mlp_bytes(h: int, width: int, experts: int, k: int, shared: int, shared_gate: bool, s: int) -> int:
    """Per token, a mixture of ``experts`` of ``width`` (``k`` per token; grouped GEMMs) beside the block's
    input: each routed copy (input, output, gate-up, SiLU, product), the router's fp32 probabilities, top-k
    weights and sort order, and a shared expert of width ``shared`` (0: none) with its sigmoid gate."""
    routed = k * (2 * h + 4 * width) * s
    router = experts * FP32 + k * (FP32 + 4 * INDEX + s) + FP32
    shared_expert = (2 * h + 4 * shared + int(shared_gate)) * s if shared else 0
    return routed + router + shared_expert


def decoder_layer_bytes(
    sizes: DecoderSizes, tokens: int, s: int, qk_norm: bool, mlp: int | None = None
) -> LayerBytes:
    """A Qwen2 / Qwen3-style decoder layer over ``tokens``: two RMSNorms and their weighted outputs (the
    attention's and the MLP's input), q/k RMSNorms per head (Qwen3), the rotated queries and keys, the values,
    attention output and log-sum-exp that attention saves, and the MLP: ``mlp`` bytes per token beside its
    input, else a dense gated MLP (gate, up, SiLU, product: 4 intermediate-sized)."""
    h, heads = sizes.hidden, sizes.heads
    q, kv = heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    norms = 2 * (rms_norm_bytes(h, s) + h * s)
    qk = rms_norm_bytes(q, s, heads) + rms_norm_bytes(kv, s, sizes.kv_heads) if qk_norm else 0
    attention = 2 * (q + kv) * s + heads * FP32
    feed_forward = 4 * sizes.intermediate * s if mlp is None else mlp
    per_token = norms + qk + attention + feed_forward
    return LayerBytes(tokens * per_token, tokens * (q * s + heads * FP32), tokens * h * s)


def loss_head_bytes(tokens: int, hidden: int, vocab: int, s: int, chunk: int | None) -> tuple[int, int, int]:
    """The output head of ``vocab`` rows and mm's loss over ``tokens``: (kept, forward peak, backward start).

    Full logits: the fp32 log-probabilities are kept, and at the start of backward their gradient and the
    logits' (two more vocabulary-sized fp32 tensors) exist. Chunked loss: the gradient of the head's weight,
    computed in the forward, is kept instead; while the forward runs, one chunk of fp32 logits (and, for
    low-precision weights, its cast and the fp32 sum of the weight gradient with one chunk's product)."""
    if chunk is None:
        return tokens * vocab * FP32, 0, 2 * tokens * vocab * FP32
    part = min(chunk, tokens)
    peak = part * vocab * FP32
    if s < FP32:
        peak += part * vocab * s + vocab * hidden * (FP32 + s)
    return vocab * hidden * s, peak, 0


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
        shared = _int(config, "shared_expert_intermediate_size")
        k, experts = facts.experts_per_token, facts.num_experts
        return tokens * moe_mlp_bytes(h, moe_width, experts, k, shared, True, s)
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
        out.append(LayerBytes(norms + mixer + mlp, selective, tokens * h * itemsize))
    return out
