"""The model-plan contract: what a model class tells mm about itself, in one typed, frozen object.

A model class declares ``mm_plan: ClassVar[ModelPlan] = ModelPlan(...)``; every part of mm reads it through
:func:`plan_of`. A class that declares nothing trains with the defaults (no default units: the YAML names
them, or the whole model is one FSDP unit). Patterns use the syntax of ``parallel.fsdp_plan.apply_modules``
(:mod:`mm_parallel.patterns`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mm_core.errors import ConfigError
from mm_parallel.moe import ExpertParallelExperts
from mm_parallel.patterns import ModulePattern, PatternError

if TYPE_CHECKING:
    from mm_core.parallel.layer_bytes import ActivationCount, ActivationQuery

_PATTERN_FIELDS = ("fsdp_units", "recompute_units", "expert_modules", "muon_exclude_modules")


@dataclass(frozen=True)
class ModelPlan:
    """Default plans of a model class, so that a user's YAML can omit them. Every field is optional."""

    #: modules wrapped as their own FSDP units before the root (``parallel.fsdp_plan.apply_modules``)
    fsdp_units: tuple[str, ...] = ()
    #: modules whose activations are recomputed (or offloaded) when ``model.recompute`` is on
    #: (``model.recompute_plan.apply_modules``)
    recompute_units: tuple[str, ...] = ()
    #: fused experts modules split over the expert-parallel mesh (``parallel.ep_plan.apply_modules``)
    expert_modules: tuple[str, ...] = ()
    #: the adapter that replaces each expert module: :class:`mm_parallel.moe.ExpertParallelExperts` (None)
    #: or a subclass of it
    expert_adapter: type[ExpertParallelExperts] | None = None
    #: context parallelism for models with other towers (vision): the module whose inputs are the whole
    #: sequence after the towers' features are merged and positions computed (e.g. the language model); mm
    #: splits the sequence at its input. None: the batch is split before the model (text decoders only)
    cp_split_module: str | None = None
    #: ``(input, mask)`` pairs: inputs of that module holding one row per True of the ``[batch, seq]`` mask
    #: input named beside them (e.g. features added at the image tokens); mm keeps this rank's rows
    cp_packed_inputs: tuple[tuple[str, str], ...] = ()
    #: modules (or parameter paths) whose weights never take Muon even if 2-D (routers, gates);
    #: ``training.muon.exclude`` adds more
    muon_exclude_modules: tuple[str, ...] = ()
    #: the ``nn.Linear`` whose output the forward returns as ``.logits`` unchanged (no scaling or soft-capping
    #: after it), called once per forward, e.g. ``"lm_head"``: mm computes the loss there in chunks
    #: (``model.loss_cfg.chunked_loss``). None: the loss is taken from the full ``.logits``
    output_head: str | None = None
    #: the token embedding (e.g. ``"model.embed_tokens"``): an FSDP unit of its own, gathered for the
    #: forward's first step and resharded after it (one unit with ``output_head`` when their weights are
    #: tied). None: it stays on the root unit
    input_embedding: str | None = None
    #: the norm applied right before ``output_head`` (e.g. ``"model.norm"``): one FSDP unit with the head,
    #: kept gathered from the end of the forward into the backward
    output_norm: str | None = None
    #: fields of the forward's output (0-dim tensors, e.g. ``("video_loss", "audio_loss")``: the parts of a
    #: joint loss) reported in the metrics beside ``loss``, each the mean over the step's micro-batches and
    #: ranks of the model's value (micro-batches where it is None are left out)
    loss_parts: tuple[str, ...] = ()
    #: why mm's router load-balancing loss (``model.loss_cfg.router_aux_loss_coef``, the softmax
    #: Switch-Transformer loss) does not fit this model's routing, completing "<class> ...", e.g. "routes by
    #: sigmoid scores with a bias-corrected top-k": a non-zero coefficient is refused with it. None: the loss
    #: applies when the text config has ``num_experts`` and ``num_experts_per_tok``
    router_loss_refusal: str | None = None
    #: ``(module pattern, reason)`` pairs: parameters the model class freezes itself (``requires_grad`` off
    #: in its constructor) and why; ``mm check`` prints the reason beside them
    frozen_reasons: tuple[tuple[str, str], ...] = ()
    #: ``hook(model)``, run after the model's own ``init_weights()`` when it is built on the meta device:
    #: initialises what mm put into the model (e.g. :func:`init_expert_adapters`)
    init_weights: Callable[[nn.Module], None] | None = None
    #: ``count(model, batch)``: this rank's input tokens of a collated micro-batch (a 0-dim tensor), for the
    #: ``tokens`` metrics and FLOPs of a model whose batch has no ``input_ids`` (e.g. video latents: frames ×
    #: patches; its share of them under a context parallelism the model splits itself). None: the
    #: ``attention_mask`` ones, else every position of ``input_ids``
    count_tokens: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor] | None = None
    #: ``hook(model, cp_mesh)`` for a model that splits its own sequence under context parallelism (e.g. a
    #: diffusion transformer, whose tokens exist only after patchify): called once, when ``cp > 1``, with the
    #: context-parallel ``DeviceMesh`` (dims ``ring`` and ``ulysses``). mm then neither switches the attention
    #: nor splits the batch (every rank of a context-parallel group gets the same micro-batch) and trains on
    #: the model's own ``.loss`` (``loss_type: raw``): its mean over all ranks must be the global loss, with
    #: gradients through the model's own collectives (FSDP averages over ``dp_shard × cp``). None: mm splits
    #: the batch (see ``cp_split_module``)
    context_parallel: Callable[[nn.Module, DeviceMesh], None] | None = None
    #: layer types besides full attention (``ModelFacts.other_layer_types``, e.g. Qwen3.5's
    #: ``"linear_attention"``) that run under Ulysses context parallelism, made to by ``ulysses_layers``
    ulysses_layer_types: tuple[str, ...] = ()
    #: ``hook(model, ulysses_size)``, called once when ``parallel.ulysses_parallel_size > 1``, before
    #: sharding: gives the layers of ``ulysses_layer_types`` their Ulysses forward (they exchange heads for
    #: the sequence themselves, reading the layout mm passes to every layer). Ring attention stays refused
    #: for such a model
    ulysses_layers: Callable[[nn.Module, int], None] | None = None
    #: class names of the model's RMSNorm modules that compute ``weight * (x / sqrt(mean(x^2) + eps))`` with
    #: the normalisation in fp32, cast back to the input's dtype before the weight, with a ``weight``
    #: parameter and a ``variance_epsilon`` attribute (transformers' ``LlamaRMSNorm`` / ``Qwen3RMSNorm``
    #: formula); the plugin vouches for that. On a device type whose kernel table entry is fused (Ascend),
    #: mm switches these modules to the table's ``rms_norm`` (:mod:`mm_core.models.device_kernels`); norms of
    #: another formula (``1 + weight``, gated, weightless) must not be listed
    rms_norm_classes: tuple[str, ...] = ()
    #: ``count(model, query)`` for ``mm check``'s memory estimate: what one micro-batch keeps for backward on
    #: one rank (an :class:`~mm_core.parallel.layer_bytes.ActivationCount` for an
    #: :class:`~mm_core.parallel.layer_bytes.ActivationQuery`), each recompute-able layer named by its module
    #: path so that the recompute and offload plans apply to it. None: counted as a decoder language model
    #: from the text configuration's sizes (models that are not: a diffusion transformer, two decoder stacks)
    activations: Callable[[nn.Module, ActivationQuery], ActivationCount | None] | None = None

    def __post_init__(self) -> None:
        for name in _PATTERN_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"ModelPlan.{name}: give a tuple of patterns, not the string {value!r}")
            patterns = tuple(value)
            for text in patterns:
                if not isinstance(text, str):
                    raise TypeError(f"ModelPlan.{name}: {text!r} is not a pattern string")
                try:
                    ModulePattern(text)
                except PatternError as exc:
                    raise ValueError(f"ModelPlan.{name}: {exc}") from None
            object.__setattr__(self, name, patterns)
        packed = self.cp_packed_inputs
        pairs = tuple(packed.items()) if isinstance(packed, Mapping) else tuple(tuple(p) for p in packed)
        if not all(len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
            raise TypeError(f"ModelPlan.cp_packed_inputs: give (input, mask) name pairs, got {packed!r}")
        object.__setattr__(self, "cp_packed_inputs", pairs)
        if pairs and not self.cp_split_module:
            raise ValueError("ModelPlan.cp_packed_inputs needs cp_split_module (the module receiving them)")
        adapter = self.expert_adapter
        if adapter is not None and not (
            isinstance(adapter, type) and issubclass(adapter, ExpertParallelExperts)
        ):
            raise TypeError(
                f"ModelPlan.expert_adapter: {adapter!r} is not a subclass of "
                "mm_parallel.moe.ExpertParallelExperts"
            )
        if self.router_loss_refusal is not None and not isinstance(self.router_loss_refusal, str):
            raise TypeError(f"ModelPlan.router_loss_refusal: {self.router_loss_refusal!r} is not a string")
        if isinstance(self.rms_norm_classes, str) or not all(
            isinstance(name, str) for name in self.rms_norm_classes
        ):
            raise TypeError("ModelPlan.rms_norm_classes: give a tuple of class names, not a string")
        object.__setattr__(self, "rms_norm_classes", tuple(self.rms_norm_classes))
        if isinstance(self.ulysses_layer_types, str):
            raise TypeError("ModelPlan.ulysses_layer_types: give a tuple of layer types, not a string")
        object.__setattr__(self, "ulysses_layer_types", tuple(self.ulysses_layer_types))
        if bool(self.ulysses_layer_types) != (self.ulysses_layers is not None):
            raise ValueError("ModelPlan.ulysses_layer_types and ModelPlan.ulysses_layers go together")
        for hook_name in (
            "init_weights",
            "count_tokens",
            "context_parallel",
            "ulysses_layers",
            "activations",
        ):
            hook = getattr(self, hook_name)
            if hook is not None and not callable(hook):
                raise TypeError(f"ModelPlan.{hook_name}: {hook!r} is not callable")
        if self.output_norm is not None and self.output_head is None:
            raise ValueError("ModelPlan.output_norm is grouped with ModelPlan.output_head; name the head too")
        if self.context_parallel is not None and (self.cp_split_module or self.cp_packed_inputs):
            raise ValueError("ModelPlan.context_parallel (the model splits itself) excludes cp_split_module")

    @property
    def cp_packed(self) -> dict[str, str]:
        """``cp_packed_inputs`` as ``{input: mask}``."""
        return dict(self.cp_packed_inputs)

    def describe(self) -> list[str]:
        """One line per field, for ``mm check``."""

        def patterns(values: Iterable[str]) -> str:
            return ", ".join(values) or "-"

        adapter = self.expert_adapter or ExpertParallelExperts
        cp = self.cp_split_module or "- (the batch is split before the model)"
        if self.cp_packed_inputs:
            cp += "; packed " + ", ".join(f"{i} by {m}" for i, m in self.cp_packed_inputs)

        def named(hook: Callable[..., Any] | None) -> str:
            return f"{hook.__module__}.{getattr(hook, '__qualname__', hook)}" if hook is not None else "-"

        if self.context_parallel is not None:
            cp = f"- (the model splits itself: {named(self.context_parallel)})"
        if self.ulysses_layer_types:
            cp += f"; under Ulysses also {', '.join(self.ulysses_layer_types)} ({named(self.ulysses_layers)})"
        return [
            f"  fsdp_units            {patterns(self.fsdp_units)}",
            f"  recompute_units       {patterns(self.recompute_units)}",
            f"  expert_modules        {patterns(self.expert_modules)}"
            + (f" (adapter {adapter.__name__})" if self.expert_modules else ""),
            f"  cp_split_module       {cp}",
            f"  muon_exclude_modules  {patterns(self.muon_exclude_modules)}",
            f"  output_head           {self.output_head or '- (loss from the full logits)'}",
            f"  input_embedding       {self.input_embedding or '- (on the root unit)'}",
            f"  output_norm           {self.output_norm or '-'}",
            f"  init_weights          {named(self.init_weights)}",
        ]


def plan_of(model: Any) -> ModelPlan:
    """The plan of a model (instance or class): its ``mm_plan``; ``ModelPlan()`` when it declares none."""
    cls = model if isinstance(model, type) else type(model)
    plan = getattr(cls, "mm_plan", None)
    if plan is None:
        return ModelPlan()
    if not isinstance(plan, ModelPlan):
        raise ConfigError(
            f"{cls.__name__}.mm_plan: expected an mm_core.models.ModelPlan, got {type(plan).__name__}"
        )
    return plan


def init_expert_adapters(model: nn.Module, std: float | None = None) -> None:
    """Initialise the expert-parallel adapters mm swapped into ``model`` (normal(0, std) as transformers
    initialises fused experts; ``std`` defaults to the text config's ``initializer_range``, else 0.02).

    The shared :attr:`ModelPlan.init_weights` hook of mixture-of-experts models: transformers'
    ``init_weights()`` does not know the adapters, which replace modules inside the base model."""
    if std is None:
        from mm_core.models.facts import text_config_of

        std = getattr(text_config_of(model), "initializer_range", None) or 0.02
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            module.reset_parameters(std)
