"""Context parallelism wired into the trainer: ``parallel.ulysses_parallel_size`` and
``parallel.ring_attention_size``.

- mm's attention function is registered under its own name (:data:`ATTENTION_NAME`) through transformers'
  public ``AttentionInterface`` and the model is switched to it with ``set_attn_implementation``; the
  built-in ``sdpa``/``eager`` entries are left untouched. No mask function is registered for that name, so
  transformers builds no (sequence-sized) mask: the attention derives its mask from the sequence layout.
- :meth:`ContextParallel.shard` splits each micro-batch along the sequence after the labels were shifted:
  global position ids and per-token segment ids (packed documents, padding) are computed on the whole
  sequence first, the sequence is padded to a multiple of the layout (padding is never attended to and
  its targets are -100, so the loss does not change), and every sequence-shaped field is cut to this rank's
  tokens. The layout travels to every attention layer as the keyword argument :data:`LAYOUT_KWARG`.
- Models with other towers (vision-language) name in ``ModelPlan.cp_split_module`` the module whose inputs
  are the whole sequence once the image features are merged and the (3-D) positions computed, e.g. the
  language model. Their batch is only padded, so the towers and the position ids see the whole sequence;
  a forward pre-hook on that module (:func:`shard_module_inputs`) cuts its inputs to this rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import nn

from mm_core.config.schema import ModelConfig
from mm_core.errors import ConfigError
from mm_core.models.facts import ModelFacts
from mm_core.models.plan import ModelPlan, plan_of
from mm_core.parallel.state import ParallelSizes, ParallelState
from mm_core.train.loss import IGNORE_INDEX
from mm_parallel.context import (
    PAD_SEGMENT,
    SequenceLayout,
    context_parallel_attention,
    pad_multiple,
    pad_sequence,
    segments_from_positions,
)

ATTENTION_NAME = "mm_context_parallel"
LAYOUT_KWARG = "mm_sequence_layout"


def context_parallel_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface`` signature) for context-parallel shards.

    ``attention_mask`` is ignored: which keys each query sees comes from the :class:`SequenceLayout` passed
    as ``mm_sequence_layout`` (causal within documents, padding masked)."""
    layout = kwargs.get(LAYOUT_KWARG)
    if not isinstance(layout, SequenceLayout):
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} was called without the keyword argument "
            f"{LAYOUT_KWARG!r}; it only runs inside mm's trainer with context parallelism, which passes the "
            "sequence layout of each micro-batch"
        )
    if dropout:
        raise ConfigError(
            f"model.config_overrides.attention_dropout: got {dropout}; context parallel attention supports "
            "no attention dropout (set it to 0.0)"
        )
    if sliding_window is not None:
        raise ConfigError(
            f"model.config_overrides.use_sliding_window: layer uses a sliding window of {sliding_window}; "
            "context parallel attention supports full causal attention only (set use_sliding_window: false)"
        )
    if kwargs.get("softcap") is not None:
        raise ConfigError("context parallel attention does not support attention logit soft-capping")
    return context_parallel_attention(query, key, value, layout, scaling), None


def register_attention() -> str:
    """Register mm's context-parallel attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention_forward)
    return ATTENTION_NAME


@dataclass(frozen=True)
class ContextPlan:
    """Context parallelism of one model: the YAML key that asked for it, the attention entry the model is
    switched to (None: the model splits its own sequence, ``ModelPlan.context_parallel``), and where the
    sequence is split (None: the batch, before the model; else the module ``ModelPlan.cp_split_module``)."""

    key: str
    attention: str | None
    split_module: str | None
    #: whether only the language model's attention is switched (a model with towers)
    text_only: bool
    #: ``parallel.ulysses_parallel_size`` (the model's ``ModelPlan.ulysses_layers`` get it)
    ulysses: int = 1

    def describe(self) -> str:
        if self.attention is None:
            return f"context par.: the model splits its own sequence (ModelPlan.context_parallel), {self.key}"
        split = f"at the input of {self.split_module}" if self.split_module else "before the model"
        return f"context par.: attention {self.attention!r}, the sequence split {split}, from {self.key}"

    def to_json(self) -> dict[str, object]:
        return {"key": self.key, "attention": self.attention, "split_module": self.split_module}


def plan_context_parallel(
    model: nn.Module, facts: ModelFacts, plan: ModelPlan, mcfg: ModelConfig, sizes: ParallelSizes
) -> ContextPlan:
    """Check that ``model`` can run context parallel with the ``model`` block ``mcfg`` (when ``cp > 1``)."""
    key = "parallel." + ("ulysses_parallel_size" if sizes.ulysses > 1 else "ring_attention_size")
    loss_type = mcfg.loss_cfg.loss_type
    if plan.context_parallel is not None:
        if loss_type != "raw":
            raise ConfigError(
                f"model.loss_cfg.loss_type: got {loss_type!r}; with {key} > 1 the model "
                f"{mcfg.model_id!r} splits its own sequence and computes its own loss; use raw"
            )
        return ContextPlan(key, None, None, False)
    if loss_type not in ("per_token_loss", "default"):  # "default" is per_token_loss
        raise ConfigError(
            f"model.loss_cfg.loss_type: got {loss_type!r}; with {key} > 1 each rank holds part of "
            "every sequence, so neither the model's own .loss (raw) nor a per-sample mean (per_sample_loss) "
            "can be formed on one rank; use per_token_loss"
        )
    if not callable(getattr(model, "set_attn_implementation", None)) or facts.text_config is None:
        raise ConfigError(
            f"{key}: model {mcfg.model_id!r} ({type(model).__name__}) is not a transformers "
            "model using AttentionInterface, which context parallelism plugs into"
        )
    towers, split_at = list(facts.towers), plan.cp_split_module
    kinds = [kind for kind in facts.other_layer_types if kind not in plan.ulysses_layer_types]
    own = [kind for kind in facts.other_layer_types if kind in plan.ulysses_layer_types]
    if own and sizes.ring > 1:
        raise ConfigError(
            f"parallel.ring_attention_size: got {sizes.ring}; model {mcfg.model_id!r} has layers of type "
            f"{own}, which carry a recurrent state through the sequence in order, while ring attention gives "
            "each rank zigzag chunks of it; these layers run under Ulysses only "
            "(use parallel.ulysses_parallel_size and ring_attention_size: 1)"
        )
    if (towers and not split_at) or kinds:
        what = f"layers of type {kinds}" if kinds else f"sub-models {towers}"
        raise ConfigError(
            f"{key}: model {mcfg.model_id!r} has {what}; context parallelism supports "
            "decoders whose every layer is full causal attention (e.g. qwen3, qwen3_moe) or of a type the "
            "model's plan runs under Ulysses (ModelPlan.ulysses_layer_types, e.g. qwen3_5's linear "
            "attention), "
            "with other towers only when the model's plan names where to split the sequence "
            "(ModelPlan.cp_split_module, e.g. qwen3_vl)"
        )
    heads = facts.num_heads
    if sizes.ulysses > 1 and heads and heads % sizes.ulysses:
        raise ConfigError(
            f"parallel.ulysses_parallel_size: got {sizes.ulysses}; it must divide the model's "
            f"num_attention_heads {heads}"
        )
    return ContextPlan(key, ATTENTION_NAME, split_at if towers else None, bool(towers), sizes.ulysses)


def use_context_parallel_attention(model: nn.Module, cp: ContextPlan, facts: ModelFacts) -> None:
    """Switch ``model`` to mm's context-parallel attention as ``cp`` plans (nothing for a model that splits
    its own sequence), and check that it took it."""
    if cp.attention is None:
        return
    plan = plan_of(model)
    if plan.ulysses_layers is not None and cp.ulysses > 1:
        plan.ulysses_layers(model, cp.ulysses)
    set_attn_implementation: Any = model.set_attn_implementation
    if cp.text_only:  # only the language model: the towers keep their attention over their own inputs
        set_attn_implementation({"text_config": register_attention()})
    else:
        set_attn_implementation(register_attention())
    if getattr(facts.text_config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ConfigError(
            f"{cp.key}: {type(model).__name__} did not accept the attention implementation "
            f"{ATTENTION_NAME!r} (it does not dispatch attention through transformers' AttentionInterface)"
        )


def shard_module_inputs(
    kwargs: dict[str, Any], layout: SequenceLayout, packed: dict[str, str]
) -> dict[str, Any]:
    """This rank's part of the keyword inputs of a module that sees the whole (padded) sequence.

    Tensors shaped ``[batch, seq, ...]`` are cut along dim 1, ``[k, batch, seq]`` (multi-axis rotary
    position ids) along dim 2 and ``[seq]`` (cache positions) along dim 0; ``packed`` inputs (one row per
    True of the mask input it names, a tensor or a list of them) keep the rows of this rank's tokens.

    Without ``position_ids`` (and without a cache) the whole sequence's positions ``0..seq-1`` are added
    first: a language model that computes its own from the length of its input would otherwise number each
    rank's shard from 0."""
    b, n = layout.segments.shape
    if kwargs.get("position_ids") is None and kwargs.get("past_key_values") is None:
        device = layout.segments.device
        kwargs = {**kwargs, "position_ids": torch.arange(n, device=device).expand(b, n)}
    out: dict[str, Any] = {}
    for name, mask_name in packed.items():
        value, mask = kwargs.get(name), kwargs.get(mask_name)
        if value is None:
            continue
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (b, n):
            raise RuntimeError(
                f"context parallel: input {name!r} is packed by {mask_name!r}, which must be a [{b}, {n}] "
                f"mask; got {type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}"
            )
        rows = [layout.shard_rows(mask, v) for v in value] if isinstance(value, list | tuple) else None
        out[name] = rows if rows is not None else layout.shard_rows(mask, value)
    for name, value in kwargs.items():
        if name in out or not isinstance(value, torch.Tensor):
            out.setdefault(name, value)
        elif value.dim() >= 2 and tuple(value.shape[:2]) == (b, n):
            out[name] = layout.shard(value, 1)
        elif value.dim() == 3 and tuple(value.shape[1:]) == (b, n):
            out[name] = layout.shard(value, 2)
        elif value.dim() == 1 and value.shape[0] == n:
            out[name] = layout.shard(value, 0)
        else:
            out[name] = value
    return out


def _split_hook(packed: dict[str, str]) -> Callable[..., tuple[tuple, dict[str, Any]] | None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        layout = kwargs.get(LAYOUT_KWARG)
        if not isinstance(layout, SequenceLayout):
            return None  # not a context-parallel forward (e.g. evaluation outside the trainer)
        if any(isinstance(a, torch.Tensor) for a in args):
            raise RuntimeError(
                f"context parallel: {type(module).__name__} was called with positional tensors; the split "
                "point (ModelPlan.cp_split_module) must receive its inputs as keyword arguments"
            )
        return args, shard_module_inputs(kwargs, layout, packed)

    return hook


class ContextParallel:
    """Per-rank context-parallel state: sizes, this rank's ring/Ulysses coordinates and process groups.

    ``split_module`` is None when the batch is split before the model (text decoders), else the module at
    whose input the sequence is split (see ``ModelPlan.cp_split_module``)."""

    def __init__(self, state: ParallelState, split_module: nn.Module | None = None) -> None:
        sizes = state.sizes
        self.ring, self.ulysses = sizes.ring, sizes.ulysses
        mesh = state.cp_mesh
        self.ring_rank = mesh["ring"].get_local_rank()
        self.ulysses_rank = mesh["ulysses"].get_local_rank()
        self.ring_group = mesh["ring"].get_group() if self.ring > 1 else None
        self.ulysses_group = mesh["ulysses"].get_group() if self.ulysses > 1 else None
        self.multiple = pad_multiple(self.ring, self.ulysses)
        self.split_module = split_module

    @classmethod
    def build(
        cls,
        model: nn.Module,
        cp: ContextPlan | None,
        plan: ModelPlan,
        facts: ModelFacts,
        state: ParallelState,
    ) -> ContextParallel | None:
        """Switch ``model`` to the context-parallel attention as ``cp`` plans; None without context
        parallelism, and for a model that splits its own sequence (``ModelPlan.context_parallel``: it is
        handed the context-parallel mesh)."""
        if cp is None:
            return None
        use_context_parallel_attention(model, cp, facts)
        if plan.context_parallel is not None:  # the model splits its own sequence: mm passes the whole batch
            plan.context_parallel(model, state.cp_mesh)
            return None
        path = cp.split_module
        if not path:
            return cls(state)
        try:
            split_module = model.get_submodule(path)
        except AttributeError as exc:
            raise ConfigError(f"ModelPlan.cp_split_module of {type(model).__name__}: {exc}") from None
        split_module.register_forward_pre_hook(_split_hook(plan.cp_packed), with_kwargs=True)
        return cls(state, split_module)

    @overload
    def shard(self, batch: dict[str, Any], targets: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]: ...
    @overload
    def shard(self, batch: dict[str, Any], targets: None) -> tuple[dict[str, Any], None]: ...
    def shard(
        self, batch: dict[str, Any], targets: torch.Tensor | None
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """This rank's part of a micro-batch whose labels are already shifted into ``targets``.

        Returns the local batch (with a local ``attention_mask``: 1 = real token, and the layout under
        :data:`LAYOUT_KWARG`) and the local targets. With a split module (vision-language models) the batch
        is only padded to the layout's length, without ``attention_mask`` (:meth:`local_mask` gives this
        rank's) and without added ``position_ids`` (the model computes its own, over the whole sequence); the
        split module's pre-hook then cuts the sequence, so the logits cover exactly the local targets."""
        ids = batch["input_ids"]
        b, s = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(s, device=ids.device).expand(b, s)
        mask = batch.get("attention_mask")
        if mask is not None:
            segments = torch.where(mask.bool(), 0, PAD_SEGMENT)
        else:
            segments = segments_from_positions(positions)
        length = -(-s // self.multiple) * self.multiple
        layout = SequenceLayout(
            pad_sequence(segments, length, PAD_SEGMENT),
            self.ring,
            self.ring_rank,
            self.ulysses,
            self.ulysses_rank,
            self.ring_group,
            self.ulysses_group,
        )
        cut = (lambda t: t) if self.split_module is not None else layout.shard
        out: dict[str, Any] = {}
        for name, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (b, s):
                out[name] = cut(pad_sequence(value, length, 0))
            else:
                out[name] = value
        if self.split_module is None:
            out["position_ids"] = layout.shard(pad_sequence(positions, length, 0))
            out["attention_mask"] = layout.shard(layout.segments != PAD_SEGMENT).long()
        else:
            # the model sees the whole sequence, its attention the layout. Without a mask, transformers
            # numbers positions over every token (padding is at the end: real tokens keep theirs), and
            # nothing inside the model pairs a whole-length mask with this rank's rows (e.g. a model's own
            # router loss over the router logits, which cover only this rank's tokens); see local_mask
            out.pop("attention_mask", None)
        out[LAYOUT_KWARG] = layout
        if targets is not None:
            targets = layout.shard(pad_sequence(targets, length, IGNORE_INDEX))
        return out, targets

    @staticmethod
    def local_mask(batch: dict[str, Any]) -> torch.Tensor:
        """``[batch, local_len]``: 1 at the real (not padding) tokens this rank holds of a batch returned by
        :meth:`shard`, the rows of its router logits and of its logits."""
        layout: SequenceLayout = batch[LAYOUT_KWARG]
        return (layout.shard(layout.segments) != PAD_SEGMENT).long()

    @staticmethod
    def local_tokens(batch: dict[str, Any]) -> torch.Tensor:
        """Real (not padding) tokens this rank holds of a batch returned by :meth:`shard` (a 0-dim tensor on
        the batch's device: counting them needs no host sync)."""
        layout: SequenceLayout = batch[LAYOUT_KWARG]
        return (layout.shard(layout.segments) != PAD_SEGMENT).sum()
