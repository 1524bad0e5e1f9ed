"""Per-rank memory estimate for ``mm check``: model states, gathered FSDP units, activations.

Everything is derived from what is stored, not fitted:

- model states: fp32 master parameters, gradients and optimizer moments (AdamW: 2, Muon: 1), each sharded
  over the FSDP group;
- gathered units: the root unit stays unsharded for the whole step (FSDP2 does not reshard the root after
  forward); the largest other unit is unsharded while it runs, plus ``num_to_forward_prefetch`` more ahead of
  it, and in backward its unsharded gradient waits for the reduce-scatter;
- activations: what one micro-batch keeps for backward, layer by layer, each saved tensor with its dtype
  (:mod:`mm_core.parallel.layer_bytes`). A model plan may supply the count (``ModelPlan.activations``: a
  video diffusion transformer, a talker with a code predictor); otherwise a Hugging Face decoder is counted
  from its text configuration: per layer and token two RMSNorms (fp32 input, normalised and weighted output),
  q/k norms when present, the rotated q, k and v, output and log-sum-exp that attention saves, and a dense
  gated MLP (4 intermediate-sized tensors) or, for a layer whose MLP holds ``experts``, the routed experts'
  copies, router and shared expert; outside the layers the final norm and the head's input and the fp32
  log-probabilities of the loss (as wide as the plan's output head) -- or, with the chunked loss, the gradient
  of the head's weight computed in the forward (one chunk of logits exists at a time). Counted this way the
  total is within 1% of what autograd's saved-tensor hooks report (Qwen3 in fp32, Qwen3-MoE and Qwen3.5 in
  bf16; docs/memory.md);
- with full recompute a checkpointed layer keeps only its input, and one layer's activations exist again
  while it is recomputed in backward; selective recompute also keeps the attention output (and its
  log-sum-exp) of each layer;
- at the start of backward the gradient of the log-probabilities and of the logits (two vocabulary-sized fp32
  tensors; none with the chunked loss) and one layer's activation gradients exist on top of the saved
  activations; later in backward the sharded gradients grow while the activations are freed, so the peak is
  the larger of the two phases.

Not included: allocator caching and fragmentation, communication buffers, the data pipeline. Activation
offload moves activations to host memory, so on a CPU run it changes nothing (on an accelerator the offloaded
blocks are subtracted from device memory).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mm_core.models.facts import ModelFacts
from mm_core.parallel.layer_bytes import (
    ActivationCount,
    ActivationQuery,
    DecoderSizes,
    LayerBytes,
    decoder_layer_bytes,
    hybrid_layer_bytes,
    loss_head_bytes,
    moe_mlp_bytes,
    rms_norm_bytes,
)
from mm_core.parallel.plan import BuildPlan

_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")


@dataclass
class MemoryBreakdown:
    """Bytes per rank."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    transient: float

    @property
    def total(self) -> float:
        backward_start = self.activations + self.transient
        return self.params + self.optimizer + self.gathered + max(backward_start, self.grads)


def _numel(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def _group_numel(modules: Sequence[nn.Module]) -> int:
    """Parameters of a unit of one or more modules, a tensor they share (tied embeddings) counted once."""
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() for p in params.values())


def _decoder_layers(model: nn.Module, n_layers: int) -> str | None:
    """The name of the decoder's layer list: the ``...layers`` list of ``n_layers`` modules, the language
    model's when towers have layer lists of their own (an audio encoder's ``layers``)."""
    lists = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and name.rsplit(".", 1)[-1] == "layers"
        and len(module) == n_layers
    ]
    preferred = [name for name in lists if "language_model" in name or "decoder" in name]
    return (preferred or lists or [None])[0]


def _int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _experts_bytes(layer: nn.Module | None, facts: ModelFacts, itemsize: int) -> int | None:
    """Per token, the mixture of experts of a decoder layer (routed experts of ``moe_intermediate_size``, a
    shared expert when the layer has one), or None when its MLP has no ``experts`` (a dense layer)."""
    mlp = getattr(layer, "mlp", None)
    width = _int(facts.text_config, "moe_intermediate_size")
    if not isinstance(mlp, nn.Module) or not hasattr(mlp, "experts") or not (facts.num_experts and width):
        return None
    shared: Any = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
    shared_width = getattr(getattr(shared, "gate_proj", None), "out_features", 0)
    gated = hasattr(mlp, "shared_expert_gate")
    k, h = facts.experts_per_token, facts.hidden_size
    return moe_mlp_bytes(h, width, facts.num_experts, k, int(shared_width), gated, itemsize)


def _layer_bytes(
    model: nn.Module, facts: ModelFacts, layers: str | None, tokens: int, itemsize: int
) -> list[LayerBytes] | None:
    """Each decoder layer's bytes (:mod:`mm_core.parallel.layer_bytes`), or None when the decoder is not one
    this estimate understands. A layer whose MLP holds ``experts`` is counted with its routed experts, router
    and shared expert, whatever dense ``intermediate_size`` the configuration also has."""
    known = (facts.hidden_size, facts.num_heads, facts.num_layers, facts.vocab_size)
    if not all(known):
        return None
    if "linear_attention" in (getattr(facts.text_config, "layer_types", None) or ()):
        return hybrid_layer_bytes(facts, tokens, itemsize)
    qk_norm = any(name.endswith("self_attn.q_norm") for name, _ in model.named_modules())
    modules: Any = model.get_submodule(layers) if layers else [None] * facts.num_layers
    sizes = DecoderSizes.of(facts)
    out = []
    for layer in modules:
        experts = _experts_bytes(layer, facts, itemsize)
        if experts is None and not facts.intermediate_size:
            return None
        out.append(decoder_layer_bytes(sizes, tokens, itemsize, qk_norm, experts))
    return out


def _output_rows(model: nn.Module, plan: BuildPlan) -> int:
    """The rows of the model plan's output head (what the loss's logits are as wide as), else the text
    configuration's vocabulary."""
    path = plan.model_plan.output_head
    head = model.get_submodule(path) if path else None
    weight = getattr(head, "weight", None)
    rows = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
    return int(rows) or plan.facts.vocab_size


def _decoder_count(model: nn.Module, plan: BuildPlan, query: ActivationQuery) -> ActivationCount | None:
    """A decoder language model's count (module docstring), or None when it is not one."""
    facts = plan.facts
    tokens, s = query.local_tokens, query.itemsize
    layers = _decoder_layers(model, facts.num_layers)
    per_layer = _layer_bytes(model, facts, layers, tokens, s)
    if per_layer is None:
        return None
    h = facts.hidden_size
    kept, peak, start = loss_head_bytes(tokens, h, _output_rows(model, plan), s, query.chunk)
    final_norm = tokens * (rms_norm_bytes(h, s) + h * s)  # and the head's input
    names = {f"{layers or 'layers'}.{i}": layer for i, layer in enumerate(per_layer)}
    return ActivationCount(names, final_norm + kept, peak, start)


def activation_count(
    model: nn.Module, plan: BuildPlan, tokens: int, device_type: str = "cpu"
) -> ActivationCount | None:
    """What one micro-batch of ``tokens`` (padded, the whole sequence) keeps for backward on one rank: the
    model plan's own count (``ModelPlan.activations``), else a decoder language model's; None when neither
    applies."""
    from mm_core.parallel.apply import to_dtype

    chunk = plan.chunked.chunk_size if plan.chunked.path is not None else None
    itemsize = to_dtype(plan.mixed_precision.param_dtype).itemsize
    query = ActivationQuery(tokens, plan.sizes.cp, itemsize, chunk, device_type)
    count = plan.model_plan.activations
    return count(model, query) if count is not None else _decoder_count(model, plan, query)


def _matching(layers: Mapping[str, LayerBytes], names: Sequence[str]) -> set[str]:
    """The layers of the count that the plan's module names choose (a count of an unnamed layer list, keyed
    ``layers.<i>``, takes any ``...layers.<i>``)."""
    found = set()
    for name in names:
        hit = _LAYER.search(name)
        if name in layers:
            found.add(name)
        elif hit and f"layers.{hit.group(2)}" in layers:
            found.add(f"layers.{hit.group(2)}")
    return found


def estimate_activations(
    model: nn.Module, plan: BuildPlan, tokens: int, device_type: str = "cpu"
) -> tuple[float, float]:
    """(saved activations, backward-start transient) in bytes for one micro-batch of ``tokens`` (padded),
    or (0, 0) when there is no count for the model (:func:`activation_count`). For a decoder model with towers
    (vision, audio) this is its language model's: the towers' activations depend on the images and clips of
    the batch (not included). Under context parallelism a rank holds 1/cp of the sequence (with Ulysses,
    inside attention, the whole sequence of 1/cp of the heads: the same bytes)."""
    count = activation_count(model, plan, tokens, device_type) if tokens else None
    if count is None or not count.layers:
        return 0.0, 0.0
    recomputed = _matching(count.layers, plan.memory.recompute)
    offloaded = _matching(count.layers, plan.memory.offload) if device_type != "cpu" else set()
    selective = plan.memory.recompute_mode == "selective"
    acts = count.outside
    for name, layer in count.layers.items():
        if name in recomputed:
            acts += layer.inputs + (layer.selective if selective else 0)
        elif name not in offloaded:
            acts += layer.saved
    layer_grads = max(layer.saved for layer in count.layers.values()) * (2 if recomputed else 1)
    return float(acts), float(max(count.forward_peak, count.backward_start + layer_grads))


@dataclass
class ModelPart:
    """One part of a model (a tower, the language model, the head) in the estimate of ``mm check``."""

    name: str
    params: int
    trainable: int
    #: FSDP units inside it
    units: int
    #: bytes per rank of its model states (fp32 parameters, gradients, optimizer moments; sharded)
    states: float


def model_parts(
    model: nn.Module, units: Sequence[Sequence[str]], fsdp_size: int, moments: float
) -> list[ModelPart]:
    """The model's parts with parameters: its top-level modules, with a ``model`` that holds several (the
    audio and vision towers and the language model of a multimodal model) split one level further. A tensor
    shared by two parts (tied embeddings) counts in the first."""
    tops = [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
    parts: list[tuple[str, nn.Module]] = []
    for name, module in tops:
        inner = [(f"{name}.{n}", m) for n, m in module.named_children() if any(True for _ in m.parameters())]
        parts.extend(inner if name == "model" and len(inner) > 1 else [(name, module)])
    seen: set[int] = set()
    out = []
    for name, module in parts:
        params = [p for p in module.parameters() if id(p) not in seen]
        if not params:  # e.g. a head tied to the embeddings
            continue
        seen.update(id(p) for p in params)
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        held = sum(1 for u in units if any(n == name or n.startswith(name + ".") for n in u))
        states = (4 * total + 4 * trainable + 4 * moments * trainable) / fsdp_size
        out.append(ModelPart(name, total, trainable, held, states))
    return out


def estimate_breakdown(
    model: nn.Module, plan: BuildPlan, tokens: int, moments: float, device_type: str = "cpu"
) -> MemoryBreakdown:
    """Per-rank bytes for a model built on meta and its build plan; ``tokens``: the padded tokens of one
    micro-batch, ``moments``: the optimizer's states per trainable parameter (AdamW 2, Muon 1)."""
    from mm_core.parallel.apply import to_dtype

    fsdp_size = plan.sizes.fsdp
    total, trainable = _numel(model), _numel(model, trainable_only=True)
    param_bytes = to_dtype(plan.mixed_precision.param_dtype).itemsize
    grad_bytes = to_dtype(plan.mixed_precision.reduce_dtype).itemsize
    modules = dict(model.named_modules())
    unit_sizes = [_group_numel([modules[n] for n in group]) for group in plan.unit_groups if any(group)]
    root = total - sum(unit_sizes)
    biggest = max(unit_sizes, default=0)
    ahead = plan.settings.parallel.fsdp_plan.num_to_forward_prefetch
    gathered = root * param_bytes + (1 + ahead) * biggest * param_bytes
    acts, transient = estimate_activations(model, plan, tokens, device_type)
    return MemoryBreakdown(
        params=4 * total / fsdp_size,
        grads=4 * trainable / fsdp_size + biggest * grad_bytes,
        optimizer=4 * moments * trainable / fsdp_size,
        gathered=gathered,
        activations=acts,
        transient=transient,
    )
