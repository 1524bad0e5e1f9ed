"""Apply the YAML's plans to a built model: freeze, FSDP2 units, meta-device materialisation.

This is where config meets mm-parallel: patterns are resolved here (errors name the YAML key), and
mm-parallel is called with explicit modules and meshes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.experimental import implicit_replication

from mm_core.config.schema import LoraConfig, ModelConfig
from mm_core.errors import ConfigError
from mm_core.lora import apply_lora, check_lora_settings
from mm_core.models.hub import has_weights
from mm_core.models.output import normalize_outputs
from mm_core.models.plan import ModelPlan, plan_of
from mm_core.parallel.compile import apply_compile
from mm_core.parallel.experts import apply_expert_parallel
from mm_core.parallel.memory import apply_chunked_loss, apply_memory_features, apply_prefetch
from mm_core.parallel.plan import BuildPlan, Prepared
from mm_core.parallel.state import ParallelState
from mm_parallel.fsdp import apply_fsdp, mixed_precision_policy
from mm_parallel.memory import ExecutionOrderPrefetch
from mm_parallel.patterns import PatternError, match_modules
from mm_parallel.seeded_init import SeededInit, local_block

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


@overload
def to_dtype(name: str) -> torch.dtype: ...
@overload
def to_dtype(name: None) -> None: ...
def to_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name]


def resolve_patterns(model: nn.Module, patterns: list[str], key: str) -> dict[str, list[str]]:
    """``match_modules`` with errors that name the YAML key."""
    try:
        return match_modules(model, patterns)
    except PatternError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def apply_freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of the matched modules; returns the module names."""
    if not patterns:
        return []
    names = sorted({n for hits in resolve_patterns(model, patterns, "model.freeze").values() for n in hits})
    modules = dict(model.named_modules())
    for name in names:
        for p in modules[name].parameters():
            p.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model.freeze: every parameter is frozen; nothing would train")
    return names


def meta_init(setting: bool | str, mcfg: ModelConfig, lora: LoraConfig | None) -> tuple[bool, str]:
    """Whether the model of ``mcfg`` is built on the meta device (``training.init_model_with_meta_device``
    ``setting``; ``lora``: ``training.lora`` of the main model, None for another model of a task), and why.

    ``auto`` (the default) builds on meta unless the model cannot be filled there: LoRA adapters are added
    to a whole model; a class without ``init_weights()`` cannot be initialised shard by shard; weights that
    ``model.model_name_or_path`` holds in another format than safetensors are read by the model's own
    loader. A built-on-meta model is sharded before any tensor is allocated, then initialised (seeded per
    parameter, the same on every layout) or filled per rank from safetensors or the resumed checkpoint."""
    if setting != "auto":
        return bool(setting), f"training.init_model_with_meta_device: {str(setting).lower()}"
    auto = "training.init_model_with_meta_device: auto"
    if lora is not None and lora.enable:
        return False, f"{auto} -> false (training.lora.enable: LoRA adapters are added to a whole model)"
    from mm_core.models.hub import ModelHub

    cls = ModelHub.model_class(mcfg)
    if not callable(getattr(cls, "init_weights", None)):
        return False, f"{auto} -> false ({cls.__name__} has no init_weights() to initialise shards)"
    path = mcfg.model_name_or_path
    if not mcfg.from_scratch and path and Path(path).is_dir() and not has_weights(path):
        return False, f"{auto} -> false ({path} holds no safetensors: the model's own loader reads it)"
    if mcfg.special_tokens and not mcfg.from_scratch:
        return False, (
            f"{auto} -> false (model.special_tokens: new embedding rows take the mean of the loaded ones, "
            "on a whole model)"
        )
    return True, f"{auto} -> true (built on the meta device, sharded, then filled per rank)"


def prepare_model(
    model: nn.Module, mcfg: ModelConfig, lora: LoraConfig | None, *, meta_init: bool = False
) -> Prepared:
    """What changes the model's parameters before its build plan is resolved: ``model.freeze``, then, with
    ``training.lora.enable``, the LoRA adapters (everything else frozen). ``lora`` None: no adapters (another
    model of a task). ``meta_init``: ``training.init_model_with_meta_device``, which LoRA does not support."""
    frozen = apply_freeze(model, mcfg.freeze)
    adapted: list[str] = []
    if lora is not None:
        path = mcfg.model_name_or_path
        check_lora_settings(lora, mcfg.from_scratch, bool(path and has_weights(path)))
        if lora.enable:
            if meta_init:
                raise ConfigError(
                    "training.lora.enable: true with training.init_model_with_meta_device: true is not "
                    "supported yet (the adapters would need their own initialisation after loading); set "
                    "training.init_model_with_meta_device: false"
                )
            adapted = apply_lora(model, lora)
    return Prepared(tuple(frozen), tuple(adapted))


def shard_model(
    model: nn.Module, plan: BuildPlan, state: ParallelState
) -> tuple[nn.Module, ExecutionOrderPrefetch | None]:
    """Apply ``plan`` (see :func:`~mm_core.parallel.plan.resolve_build`): the chunked loss head, expert
    parallelism, recompute / offload, ``training.compile``, then FSDP2 over the layout's mesh (the planned
    units, inner first, then the root).

    Returns the sharded model and its gathering plan (hook groups, prefetch, pregather; None when the YAML
    asks for none), whose :meth:`~ExecutionOrderPrefetch.pregather` the trainer calls after each step."""
    apply_chunked_loss(model, plan.chunked)  # the output head, swapped over its own parameters
    prec = plan.mixed_precision
    mp = mixed_precision_policy(
        to_dtype(prec.param_dtype),
        to_dtype(prec.reduce_dtype),
        to_dtype(prec.output_dtype),
        prec.cast_forward_inputs,
    )
    fsdp = plan.settings.parallel.fsdp_plan
    # expert modules are swapped for the expert-parallel adapter (and, with ep > 1, sharded over the expert
    # mesh) before the other units, which then hold everything else
    experts = apply_expert_parallel(
        model,
        plan.experts.names,
        plan.model_plan,
        plan.settings.parallel.ep_plan.dispatcher,
        state,
        mp_policy=mp,
        reshard_after_forward=fsdp.reshard_after_forward,
    )
    units = [(n, model.get_submodule(n)) for n in plan.fsdp.names]
    # the embedding and the final norm + head (model plan): units of their own, applied first (inner ones)
    edges = [[model.get_submodule(n) for n in group] for group in plan.edges.groups]
    kept = [e for g, e in zip(plan.edges.groups, edges, strict=True) if g == plan.edges.kept]
    compiled = plan.compile
    # recompute / activation offload are module hooks applied before fully_shard; prefetch is wired after.
    # training.compile then compiles each unit's forward in place (a recomputed one: checkpoint inside)
    apply_memory_features(
        model, plan.memory, state.device.type, compiled=compiled.recomputed if compiled else ()
    )
    if compiled is not None:
        apply_compile(model, compiled, plan.memory, is_main=state.is_main)
    ignored = {p for n in plan.ignored for p in model.get_submodule(n).parameters()}
    # before fully_shard's own hook: FSDP2 must see the output's tensors to hook the root unit's backward
    normalize_outputs(model)
    sharded = apply_fsdp(
        model,
        state.fsdp_mesh,
        [*edges, *(m for _, m in units)],
        mp_policy=mp,
        reshard_after_forward=fsdp.reshard_after_forward,
        cpu_offload=fsdp.cpu_offload,
        ignored_params=ignored or None,
        keep_after_forward=kept,
    )
    assert isinstance(sharded, nn.Module)  # apply_fsdp returns `model`, now also an FSDPModule
    # the expert modules are FSDP units of their own when ep > 1 (sharded over efsdp by apply_expert_parallel)
    expert_units = [(n, sharded.get_submodule(n)) for n in experts]
    # an edge unit is prefetched through its first module (the modules of a unit share its FSDP state)
    edge_units = [(" + ".join(g), e[0]) for g, e in zip(plan.edges.groups, edges, strict=True)]
    gathered = edge_units + units + [u for u in expert_units if isinstance(u[1], FSDPModule)]
    return sharded, apply_prefetch(sharded, plan.gather, gathered)


@torch.no_grad()
def materialize_meta(
    model: nn.Module,
    device: torch.device,
    *,
    init: bool,
    model_plan: ModelPlan | None = None,
    seed: int = 0,
) -> None:
    """Allocate a meta-built (and sharded) model on ``device`` and run its ``init_weights()``, then the
    ``init_weights`` hook of its :class:`~mm_core.models.plan.ModelPlan` (``model_plan``, read from the model
    when None; e.g. for expert-parallel adapters).

    With ``init=False`` (weights will be loaded next) the parameters are then filled with NaN, so that any
    parameter the checkpoint does not provide is caught by :func:`check_initialised`, by name; buffers keep
    their initial values (non-persistent ones such as rotary frequencies are never in a checkpoint).
    With ``init=True`` everything is NaN-filled first, so a tensor the model's init forgets is caught.

    The initialisation runs under DTensor's ``implicit_replication``: an init that builds a plain tensor of a
    parameter's full shape and copies it in (transformers' Gated DeltaNet ``A_log``, for one) copies each
    rank's shard of it, as the unsharded model would be initialised. With ``init=True`` it also runs under
    :class:`mm_parallel.seeded_init.SeededInit` with ``seed`` (``training.seed``): every random fill of a
    parameter is drawn as if on the whole parameter from a generator seeded by the parameter's name, so the
    initial weights are the same on every layout and number of ranks.
    """
    model.to_empty(device=device)
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    for t in tensors:
        if t.is_floating_point():
            t.fill_(float("nan"))
    init_fn = getattr(model, "init_weights", None)
    if not callable(init_fn):
        raise ConfigError(
            f"training.init_model_with_meta_device: {type(model).__name__} has no init_weights(); "
            "implement it (BaseModel provides one) or set training.init_model_with_meta_device: false"
        )
    hook = (model_plan or plan_of(model)).init_weights
    seeded = SeededInit(model.named_parameters(), seed) if init else contextlib.nullcontext()
    with implicit_replication(), seeded:
        init_fn()
        if hook is not None:
            hook(model)
    zero_padding_rows(model)
    if init:
        check_initialised(model)
        return
    for p in model.parameters():
        if p.is_floating_point():
            p.fill_(float("nan"))


def zero_padding_rows(model: nn.Module) -> None:
    """Zero the ``padding_idx`` row of every ``nn.Embedding`` in this rank's shard, as ``nn.Embedding`` and
    transformers initialise it. An initialiser that zeroes ``weight[padding_idx]`` of a row-sharded weight
    zeroes a gathered copy, not the shard that holds the row."""
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            local, offsets, sizes = local_block(module.weight)
            row = module.padding_idx % module.num_embeddings
            if offsets and offsets[0] <= row < offsets[0] + sizes[0]:
                local[row - offsets[0]].zero_()


def check_initialised(model: nn.Module) -> None:
    """Raise if any floating parameter or buffer still holds NaN after initialisation or loading."""
    bad = []
    device = torch.device("cpu")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            local = t.to_local() if hasattr(t, "to_local") else t
            device = local.device
            if torch.isnan(local).any():
                bad.append(name)
    # on the model's device, so the accelerator backend (nccl/hccl) runs it, like every other collective
    flag = torch.tensor([len(bad)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag)  # every rank must agree, or the ones that did not raise would hang
    if flag.item() and not bad:
        raise ConfigError(
            "model: tensors hold NaN after initialisation or loading (left uninitialised after building on "
            "meta, or NaN in the checkpoint) on another rank"
        )
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ConfigError(
            f"model: {len(bad)} tensors hold NaN after initialisation or loading (left uninitialised after "
            f"building on meta, or NaN in the checkpoint): {shown}"
        )
