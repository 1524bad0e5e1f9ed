"""Per-rank memory estimate for ``mm check``: model states, gathered FSDP units, activations.

Everything is derived from what is stored, not fitted:

- model states: fp32 master parameters, gradients and optimizer moments (AdamW: 2, Muon: 1), each sharded
  over the FSDP group;
- gathered units: the root unit stays unsharded for the whole step (FSDP2 does not reshard the root after
  forward); the largest other unit is unsharded while it runs, plus ``num_to_forward_prefetch`` more ahead of
  it, and in backward its unsharded gradient waits for the reduce-scatter;
- activations, for Hugging Face decoder models (``hidden_size``, ``intermediate_size``, heads): per layer and
  token autograd keeps 6 hidden-sized tensors (the two RMSNorms' input and normalised output, the attention
  and MLP inputs), 4 (2 without q/k norms) query-sized and key/value-sized tensors (q/k norm input and output,
  the rotated q, k and v that attention saves, its output), 4 intermediate-sized ones (gate, up, SiLU(gate),
  their product); outside the layers the final norm and ``lm_head`` input (3 hidden-sized) and the fp32
  log-probabilities of the loss (vocabulary-sized) -- or, with the chunked loss, the gradient of the head's
  weight computed in the forward (one chunk of logits exists at a time). Counted this way the total matches
  what autograd's saved-tensor hooks report for Qwen3 exactly (see docs/memory.md); a hybrid decoder of
  gated delta-rule and gated attention layers (Qwen3.5) is counted layer by layer, each tensor with its dtype
  (:mod:`mm_core.parallel.layer_bytes`);
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
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from mm_core.models.facts import ModelFacts
from mm_core.parallel.layer_bytes import LayerBytes, hybrid_layer_bytes, standard_layer_bytes
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


def _layer_bytes(model: nn.Module, facts: ModelFacts, tokens: int, itemsize: int) -> list[LayerBytes] | None:
    """Each decoder layer's bytes (:mod:`mm_core.parallel.layer_bytes`), or None when the decoder is not one
    this estimate understands."""
    known = (facts.hidden_size, facts.num_heads, facts.num_layers, facts.vocab_size)
    if not all(known):
        return None
    if "linear_attention" in (getattr(facts.text_config, "layer_types", None) or ()):
        return hybrid_layer_bytes(facts, tokens, itemsize)
    if not facts.intermediate_size:
        return None
    qk_norm = any(name.endswith("self_attn.q_norm") for name, _ in model.named_modules())
    return [standard_layer_bytes(facts, tokens, itemsize, qk_norm)] * facts.num_layers


def estimate_activations(
    model: nn.Module, plan: BuildPlan, tokens: int, device_type: str = "cpu"
) -> tuple[float, float]:
    """(saved activations, backward-start transient) in bytes for one micro-batch of ``tokens`` (padded),
    or (0, 0) when the model is not a decoder this estimate understands. For a model with towers (vision,
    audio) this is its language model's: the towers' activations depend on the images and clips of the
    batch (not included). Under context parallelism a rank holds 1/cp of the sequence (with Ulysses, inside
    attention, the whole sequence of 1/cp of the heads: the same bytes), so ``tokens`` is divided by cp."""
    facts = plan.facts
    tokens = -(-tokens // plan.sizes.cp)
    if not tokens:
        return 0.0, 0.0
    from mm_core.parallel.apply import to_dtype

    itemsize = to_dtype(plan.mixed_precision.param_dtype).itemsize
    per_layer = _layer_bytes(model, facts, tokens, itemsize)
    if per_layer is None:
        return 0.0, 0.0
    layer_input = tokens * facts.hidden_size * itemsize
    layers = _decoder_layers(model, facts.num_layers)

    def in_decoder(names: Sequence[str]) -> set[int]:
        found = (_LAYER.search(n) for n in names if layers is None or n.startswith(layers + "."))
        return {int(m.group(2)) for m in found if m}

    recomputed = in_decoder(plan.memory.recompute)
    offloaded = in_decoder(plan.memory.offload) if device_type != "cpu" else set()
    selective = plan.memory.recompute_mode == "selective"
    acts = 0.0
    for index, layer in enumerate(per_layer):
        if index in recomputed:
            acts += layer_input + (layer.selective if selective else 0)
        elif index not in offloaded:
            acts += layer.saved
    acts += 3 * tokens * facts.hidden_size * itemsize
    layer_grads = max(layer.saved for layer in per_layer) * (2 if recomputed else 1)
    vocab = facts.vocab_size
    if plan.chunked.path is None:
        acts += tokens * vocab * 4
        return float(acts), float(2 * tokens * vocab * 4 + layer_grads)
    # chunked: the head's weight gradient is kept from the forward instead of the log-probabilities; while
    # the forward runs, one chunk of fp32 logits (and, for low-precision weights, its cast and the fp32 sum
    # of the weight gradient with one chunk's product)
    acts += vocab * facts.hidden_size * itemsize
    chunk = min(plan.chunked.chunk_size, tokens)
    head_pass = chunk * vocab * 4
    if itemsize < 4:
        head_pass += chunk * vocab * itemsize + vocab * facts.hidden_size * (4 + itemsize)
    return float(acts), float(max(head_pass, layer_grads))


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


def model_parts(model: nn.Module, unit_names: list[str], fsdp_size: int, moments: float) -> list[ModelPart]:
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
        units = sum(1 for u in unit_names if u.startswith(name + "."))
        states = (4 * total + 4 * trainable + 4 * moments * trainable) / fsdp_size
        out.append(ModelPart(name, total, trainable, units, states))
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
    unit_sizes = [_numel(modules[n]) for n in plan.unit_names if n]
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
