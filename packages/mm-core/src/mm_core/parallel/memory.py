"""The YAML's memory features applied to a model: ``model.recompute`` (full or selective),
``model.activation_offload``, and the FSDP gathering plan: ``parallel.fsdp_plan.hook_modules``,
``num_to_{forward,backward}_prefetch`` and ``pregather``; and the chunked loss at the output head
(``model.loss_cfg.chunked_loss``).

Recompute and offload are applied before ``fully_shard`` (they are module hooks and keep parameter names);
prefetch is wired after it, from the order the FSDP units really run in during the first forward.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from mm_core.config.schema import FSDPPlan, LossConfig, ModelConfig
from mm_core.errors import ConfigError
from mm_core.models.plan import ModelPlan
from mm_core.parallel.matching import ModuleMatches
from mm_core.train.loss import IGNORE_INDEX
from mm_parallel.memory import ActivationOffloader, ExecutionOrderPrefetch, apply_recompute, resolve_ops
from mm_parallel.memory.chunked_loss import ChunkedLossHead


@dataclass(frozen=True)
class MemoryFeatures:
    """``model.recompute_plan`` and ``model.activation_offload_plan`` resolved: the modules and settings."""

    recompute: tuple[str, ...] = ()
    recompute_mode: str = "off"
    #: ops whose outputs selective recompute keeps (empty for full recompute)
    save_ops: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    offload_min_bytes: int = 0
    offload_prefetch: bool = True


def _plan_modules(
    match: ModuleMatches, patterns: Sequence[str], key: str, what: str, plan: ModelPlan, owner: str
) -> tuple[str, ...]:
    """The YAML patterns, or the model's default recompute plan (block granularity) when empty."""
    source = key
    if not patterns:
        patterns = list(plan.recompute_units)
        source = f"{key} (empty; default plan of {owner})"
        if not patterns:
            raise ConfigError(
                f"{key}: empty, and {owner} declares no default plan "
                f"(ModelPlan.recompute_units); list the modules to {what}, e.g. [model.layers.{{*}}]"
            )
    return match.select(list(patterns), source)


def _overlap(a: Sequence[str], b: Sequence[str]) -> tuple[str, str] | None:
    for x in a:
        for y in b:
            if x == y or x.startswith(y + ".") or y.startswith(x + ".") or not x or not y:
                return x, y
    return None


def plan_memory_features(
    mcfg: ModelConfig, plan: ModelPlan, owner: str, match: ModuleMatches
) -> MemoryFeatures:
    """Resolve and validate the recompute and offload plans of the ``model`` block (``owner``: the model
    class's name, ``plan``: its default plan)."""
    recompute: tuple[str, ...] = ()
    mode = "off"
    save_ops: tuple[str, ...] = ()
    if mcfg.recompute:
        rplan = mcfg.recompute_plan
        if rplan.use_reentrant:
            raise ConfigError(
                "model.recompute_plan.use_reentrant: got true; mm checkpoints with the non-reentrant "
                "implementation (the one that composes with FSDP2); set it to false"
            )
        if rplan.recompute_granularity == "selective":
            try:
                resolve_ops(rplan.save_ops)
            except ValueError as exc:
                raise ConfigError(f"model.recompute_plan.save_ops: {exc}") from None
            if not rplan.save_ops:
                raise ConfigError(
                    "model.recompute_plan.save_ops: empty with recompute_granularity: selective; list the "
                    "ops whose outputs to keep (e.g. [attention]) or use recompute_granularity: full"
                )
            save_ops = tuple(rplan.save_ops)
        key = "model.recompute_plan.apply_modules"
        recompute = _plan_modules(match, rplan.apply_modules, key, "recompute", plan, owner)
        mode = rplan.recompute_granularity
    offload: tuple[str, ...] = ()
    oplan = mcfg.activation_offload_plan
    if mcfg.activation_offload:
        key = "model.activation_offload_plan.apply_modules"
        offload = _plan_modules(match, oplan.apply_modules, key, "offload", plan, owner)
        clash = _overlap(recompute, offload)
        if clash:
            raise ConfigError(
                f"model.activation_offload_plan.apply_modules: {clash[1] or '(root)'} is also recomputed "
                f"(model.recompute_plan matched {clash[0] or '(root)'}); a module's activations are either "
                "recomputed or offloaded; give the two plans different modules"
            )
    return MemoryFeatures(recompute, mode, save_ops, offload, oplan.min_offload_bytes, oplan.prefetch)


def apply_memory_features(
    model: nn.Module, feats: MemoryFeatures, device_type: str, *, compiled: Collection[str] = ()
) -> ActivationOffloader | None:
    """Recompute and activation offload on the planned modules; call before ``fully_shard``. The modules
    in ``compiled`` are recomputed by a checkpoint inside their compiled forward (``training.compile``), not
    here. Returns the activation offloader (None without offload)."""
    modules = dict(model.named_modules())
    if feats.recompute:
        save_ops = resolve_ops(list(feats.save_ops)) if feats.recompute_mode == "selective" else None
        hooked = [modules[n] for n in feats.recompute if n not in compiled]
        apply_recompute(hooked, save_ops=save_ops)
    if not feats.offload:
        return None
    offloader = ActivationOffloader(
        device_type, min_bytes=feats.offload_min_bytes, prefetch=feats.offload_prefetch
    )
    offloader.attach((n, modules[n]) for n in feats.offload)
    return offloader


def hook_groups(match: ModuleMatches, patterns: list[str], unit_names: Sequence[str]) -> dict[str, str]:
    """``parallel.fsdp_plan.hook_modules``: each FSDP unit inside (or equal to) a matched module, mapped to
    that module's name. Every hook module must hold at least one unit, and hook modules must not nest."""
    key = "parallel.fsdp_plan.hook_modules"
    hooks = list(match.select(patterns, key))
    nested = _overlap_within(hooks)
    if nested:
        raise ConfigError(f"{key}: {nested[1]} is inside {nested[0]}; hook modules must not nest")
    groups: dict[str, str] = {}
    for hook in hooks:
        inside = [u for u in unit_names if u == hook or u.startswith(hook + ".")]
        if not inside:
            raise ConfigError(
                f"{key}: {hook} holds no FSDP unit, so there is nothing to gather at its hooks; name "
                "modules that are (or contain) units of parallel.fsdp_plan.apply_modules or expert modules"
            )
        groups.update((u, hook) for u in inside)
    return groups


def _overlap_within(names: Sequence[str]) -> tuple[str, str] | None:
    for x in names:
        for y in names:
            if y.startswith(x + "."):
                return x, y
    return None


@dataclass(frozen=True)
class GatherPlan:
    """The FSDP gathering plan: ``parallel.fsdp_plan.hook_modules`` (unit -> hook group),
    ``num_to_forward_prefetch`` / ``num_to_backward_prefetch`` and ``pregather``."""

    groups: Mapping[str, str]
    num_forward: int
    num_backward: int
    pregather: bool

    def to_json(self) -> dict[str, object]:
        return {
            "key": "parallel.fsdp_plan",
            "hook_groups": dict(self.groups),
            "num_to_forward_prefetch": self.num_forward,
            "num_to_backward_prefetch": self.num_backward,
            "pregather": self.pregather,
        }


def plan_gather(plan: FSDPPlan, unit_names: Sequence[str], match: ModuleMatches) -> GatherPlan | None:
    """The gathering plan over the FSDP units ``unit_names`` (expert units included, the root left out);
    None when the YAML asks for no prefetch, hook groups or pregather."""
    wanted = {
        "num_to_forward_prefetch/num_to_backward_prefetch": bool(
            plan.num_to_forward_prefetch or plan.num_to_backward_prefetch
        ),
        "hook_modules": bool(plan.hook_modules),
        "pregather": plan.pregather,
    }
    if not any(wanted.values()):
        return None
    units = [n for n in unit_names if n]
    if not units and (wanted["hook_modules"] or wanted["num_to_forward_prefetch/num_to_backward_prefetch"]):
        keys = [k for k, on in wanted.items() if on and k != "pregather"]
        raise ConfigError(
            f"parallel.fsdp_plan.{keys[0]}: the FSDP plan has no units besides the root, so there is nothing "
            "to gather ahead; add parallel.fsdp_plan.apply_modules"
        )
    groups = hook_groups(match, list(plan.hook_modules), units) if plan.hook_modules else {}
    return GatherPlan(groups, plan.num_to_forward_prefetch, plan.num_to_backward_prefetch, plan.pregather)


def apply_prefetch(
    model: nn.Module, gather: GatherPlan | None, units: Sequence[tuple[str, nn.Module]]
) -> ExecutionOrderPrefetch | None:
    """FSDP2 prefetch by hook group, ``num_to_forward_prefetch`` / ``num_to_backward_prefetch`` groups ahead,
    and ``pregather``, in the order the units run (recorded in the first forward); call after
    ``fully_shard`` with every unit, expert units included."""
    if gather is None:
        return None
    return ExecutionOrderPrefetch(
        model,
        [(n, m) for n, m in units if m is not model],
        num_forward=gather.num_forward,
        num_backward=gather.num_backward,
        groups=dict(gather.groups),
    )


def describe_features(feats: MemoryFeatures, plan: FSDPPlan) -> list[str]:
    """Lines for ``mm check``: which modules each memory feature applies to (``plan``: the YAML's
    ``parallel.fsdp_plan``)."""

    def shown(names: Sequence[str]) -> str:
        return ", ".join(n or "(root)" for n in names[:3]) + (
            f", ... ({len(names)} modules)" if len(names) > 3 else ""
        )

    lines = []
    if feats.recompute:
        extra = ""
        if feats.recompute_mode == "selective":
            extra = f", keeping the outputs of {', '.join(feats.save_ops)}"
        lines.append(f"recompute   : {feats.recompute_mode}{extra} -> {shown(feats.recompute)}")
    if feats.offload:
        lines.append(f"act. offload: saved activations to host memory -> {shown(feats.offload)}")
    what = "hook group(s)" if plan.hook_modules else "unit(s)"
    if plan.num_to_forward_prefetch or plan.num_to_backward_prefetch:
        lines.append(
            f"prefetch    : {plan.num_to_forward_prefetch} {what} ahead in forward, "
            f"{plan.num_to_backward_prefetch} in backward, in the order recorded during the first forward"
        )
    if plan.hook_modules:
        lines.append(
            f"hook groups : the FSDP units inside each of {', '.join(plan.hook_modules)} are all-gathered "
            "together (expert units with their layer)"
        )
    if plan.pregather:
        lines.append(
            "pregather   : the root and first group of the next forward are all-gathered after each "
            "optimizer step"
        )
    if plan.cpu_offload:
        lines.append("cpu offload : sharded parameters, gradients and optimizer states in host memory")
    return lines


#: ``model.loss_cfg.loss_chunk_size: auto`` bounds one chunk's logits and their gradient to this many bytes
AUTO_CHUNK_BYTES = 256 * 2**20
#: bytes per logit element of a chunk: the head computes the chunk's logits (and their gradient, in place) in
#: fp32 whatever the parameters' dtype
LOGIT_BYTES = 4


def auto_chunk_size(vocab: int) -> int:
    """``loss_chunk_size: auto``: ``floor(256 MiB / (vocab x 4 bytes x 2 (logits + gradient)))`` tokens, at
    least 1 (220 at Qwen's 151,936)."""
    return max(1, AUTO_CHUNK_BYTES // (vocab * LOGIT_BYTES * 2))


@dataclass(frozen=True)
class ChunkedHead:
    """``model.loss_cfg.chunked_loss``: the path of the output head that computes the loss in chunks (None:
    the loss takes the full logits), the chunk size (``loss_chunk_size`` resolved), and one line for the log
    saying so, or why not."""

    path: str | None
    note: str
    chunk_size: int


def chunked_loss_plan(
    model: nn.Module, loss: LossConfig, plan: ModelPlan, *, enabled: bool = True
) -> ChunkedHead:
    """Where the chunked loss goes (``model.loss_cfg.chunked_loss``; ``plan``: the model's plan, naming its
    output head), and its chunk size (``loss_chunk_size: auto`` resolved from the head's vocabulary).
    ``enabled=False``: another model of a task, which computes its own loss."""
    fixed = loss.loss_chunk_size if isinstance(loss.loss_chunk_size, int) else None

    def off(note: str) -> ChunkedHead:
        return ChunkedHead(None, note, fixed or 0)

    if loss.loss_type == "raw":
        return off("chunked loss off: loss_type raw trains on the model's own .loss")
    if not enabled:
        return off("chunked loss off: another model of the task computes its own loss from the full logits")
    if not loss.chunked_loss:
        return off("chunked loss off (model.loss_cfg.chunked_loss: false): the loss takes the full logits")
    name = type(model).__name__
    path = plan.output_head
    if path is None:
        return off(
            f"chunked loss off: {name} names no output head (ModelPlan.output_head), so the loss takes the "
            "full logits"
        )
    try:
        head = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"{name}: ModelPlan.output_head {path!r} is not a module of the model") from None
    if not isinstance(head, ChunkedLossHead) and type(head) is not nn.Linear:
        return off(
            f"chunked loss off: {path} is a {type(head).__name__} (e.g. a LoRA layer), not a plain "
            "nn.Linear; the loss takes the full logits"
        )
    assert isinstance(head, nn.Linear)  # ChunkedLossHead is one too
    vocab = head.out_features
    if fixed is None:
        size = auto_chunk_size(vocab)
        how = (
            f"loss_chunk_size: auto -> {size} = floor(256 MiB / ({vocab:,} vocabulary x {LOGIT_BYTES} bytes "
            "x 2 (logits + gradient)))"
        )
    else:
        size, how = fixed, f"loss_chunk_size: {fixed}"
    chunk_mib = size * vocab * LOGIT_BYTES * 2 / 2**20
    return ChunkedHead(
        path,
        f"chunked loss: {path} computes the loss {size} tokens at a time ({how}; a chunk's fp32 logits and "
        f"their gradient: {chunk_mib:,.0f} MiB; model.loss_cfg.chunked_loss; full-vocabulary logits are "
        "never formed)",
        size,
    )


def apply_chunked_loss(model: nn.Module, chunked: ChunkedHead) -> ChunkedLossHead | None:
    """Swap the output head for a :class:`ChunkedLossHead` over its own parameters (before ``fully_shard``,
    after LoRA injection); returns it, or None when the plan says no."""
    path = chunked.path
    if path is None:
        return None
    head = model.get_submodule(path)
    if isinstance(head, ChunkedLossHead):
        return head
    assert isinstance(head, nn.Linear)  # chunked_loss_plan checked it
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    new = ChunkedLossHead.replacing(head, chunked.chunk_size, IGNORE_INDEX)
    setattr(parent, attr, new)
    return new
