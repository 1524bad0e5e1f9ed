"""The YAML's memory features applied to a model: ``model.recompute`` (full or selective),
``model.activation_offload``, and the FSDP gathering plan: ``parallel.fsdp_plan.hook_modules``,
``num_to_{forward,backward}_prefetch`` and ``pregather``; and the chunked loss at the output head
(``model.loss_cfg.chunked_loss``).

Recompute and offload are applied before ``fully_shard`` (they are module hooks and keep parameter names);
prefetch is wired after it, from the order the FSDP units really run in during the first forward.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from torch import nn

from mm_core.config.schema import MMConfig
from mm_core.errors import ConfigError
from mm_core.models.plan import plan_of
from mm_core.train.loss import IGNORE_INDEX
from mm_parallel.memory import ActivationOffloader, ExecutionOrderPrefetch, apply_recompute, resolve_ops
from mm_parallel.memory.chunked_loss import ChunkedLossHead
from mm_parallel.patterns import PatternError, match_modules


@dataclass
class MemoryFeatures:
    """What was applied, for ``mm check`` and the logs."""

    recompute: list[str] = field(default_factory=list)
    recompute_mode: str = "off"
    offload: list[str] = field(default_factory=list)
    offloader: ActivationOffloader | None = None
    prefetch: ExecutionOrderPrefetch | None = None


def _matched(model: nn.Module, patterns: list[str], key: str) -> list[tuple[str, nn.Module]]:
    try:
        hits = match_modules(model, patterns)
    except PatternError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    wanted = {n for names in hits.values() for n in names}
    return [(n, m) for n, m in model.named_modules() if n in wanted]


def _plan_modules(model: nn.Module, patterns: list[str], key: str, what: str) -> list[tuple[str, nn.Module]]:
    """The YAML patterns, or the model's default recompute plan (block granularity) when empty."""
    source = key
    if not patterns:
        patterns = list(plan_of(model).recompute_units)
        source = f"{key} (empty; default plan of {type(model).__name__})"
        if not patterns:
            raise ConfigError(
                f"{key}: empty, and {type(model).__name__} declares no default plan "
                f"(ModelPlan.recompute_units); list the modules to {what}, e.g. [model.layers.{{*}}]"
            )
    return _matched(model, list(patterns), source)


def _overlap(a: Sequence[str], b: Sequence[str]) -> tuple[str, str] | None:
    for x in a:
        for y in b:
            if x == y or x.startswith(y + ".") or y.startswith(x + ".") or not x or not y:
                return x, y
    return None


def plan_memory_features(model: nn.Module, cfg: MMConfig) -> MemoryFeatures:
    """Resolve and validate the recompute and offload plans without touching the model."""
    mcfg = cfg.model
    out = MemoryFeatures()
    if mcfg.recompute:
        plan = mcfg.recompute_plan
        if plan.use_reentrant:
            raise ConfigError(
                "model.recompute_plan.use_reentrant: got true; mm checkpoints with the non-reentrant "
                "implementation (the one that composes with FSDP2); set it to false"
            )
        if plan.recompute_granularity == "selective":
            try:
                resolve_ops(plan.save_ops)
            except ValueError as exc:
                raise ConfigError(f"model.recompute_plan.save_ops: {exc}") from None
            if not plan.save_ops:
                raise ConfigError(
                    "model.recompute_plan.save_ops: empty with recompute_granularity: selective; list the "
                    "ops whose outputs to keep (e.g. [attention]) or use recompute_granularity: full"
                )
        mods = _plan_modules(model, plan.apply_modules, "model.recompute_plan.apply_modules", "recompute")
        out.recompute = [n for n, _ in mods]
        out.recompute_mode = plan.recompute_granularity
    if mcfg.activation_offload:
        mods = _plan_modules(
            model,
            mcfg.activation_offload_plan.apply_modules,
            "model.activation_offload_plan.apply_modules",
            "offload",
        )
        out.offload = [n for n, _ in mods]
        clash = _overlap(out.recompute, out.offload)
        if clash:
            raise ConfigError(
                f"model.activation_offload_plan.apply_modules: {clash[1] or '(root)'} is also recomputed "
                f"(model.recompute_plan matched {clash[0] or '(root)'}); a module's activations are either "
                "recomputed or offloaded; give the two plans different modules"
            )
    return out


def apply_memory_features(
    model: nn.Module, cfg: MMConfig, device_type: str, *, compiled: Collection[str] = ()
) -> MemoryFeatures:
    """Recompute and activation offload on the planned modules; call before ``fully_shard``. The modules
    in ``compiled`` are recomputed by a checkpoint inside their compiled forward (``training.compile``), not
    here."""
    feats = plan_memory_features(model, cfg)
    modules = dict(model.named_modules())
    if feats.recompute:
        plan = cfg.model.recompute_plan
        save_ops = resolve_ops(plan.save_ops) if plan.recompute_granularity == "selective" else None
        hooked = [modules[n] for n in feats.recompute if n not in compiled]
        apply_recompute(hooked, save_ops=save_ops)
    if feats.offload:
        oplan = cfg.model.activation_offload_plan
        feats.offloader = ActivationOffloader(
            device_type, min_bytes=oplan.min_offload_bytes, prefetch=oplan.prefetch
        )
        feats.offloader.attach((n, modules[n]) for n in feats.offload)
    return feats


def hook_groups(model: nn.Module, patterns: list[str], unit_names: Sequence[str]) -> dict[str, str]:
    """``parallel.fsdp_plan.hook_modules``: each FSDP unit inside (or equal to) a matched module, mapped to
    that module's name. Every hook module must hold at least one unit, and hook modules must not nest."""
    key = "parallel.fsdp_plan.hook_modules"
    hooks = [n for n, _ in _matched(model, patterns, key)]
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


def apply_prefetch(
    model: nn.Module, cfg: MMConfig, units: Sequence[tuple[str, nn.Module]]
) -> ExecutionOrderPrefetch | None:
    """FSDP2 prefetch by hook group (``hook_modules``), ``num_to_forward_prefetch`` /
    ``num_to_backward_prefetch`` groups ahead, and ``pregather``, in the order the units run (recorded in the
    first forward); call after ``fully_shard`` with every unit, expert units included."""
    plan = cfg.parallel.fsdp_plan
    wanted = {
        "num_to_forward_prefetch/num_to_backward_prefetch": bool(
            plan.num_to_forward_prefetch or plan.num_to_backward_prefetch
        ),
        "hook_modules": bool(plan.hook_modules),
        "pregather": plan.pregather,
    }
    if not any(wanted.values()):
        return None
    units = [(n, m) for n, m in units if m is not model]
    if not units and (wanted["hook_modules"] or wanted["num_to_forward_prefetch/num_to_backward_prefetch"]):
        keys = [k for k, on in wanted.items() if on and k != "pregather"]
        raise ConfigError(
            f"parallel.fsdp_plan.{keys[0]}: the FSDP plan has no units besides the root, so there is nothing "
            "to gather ahead; add parallel.fsdp_plan.apply_modules"
        )
    groups = hook_groups(model, list(plan.hook_modules), [n for n, _ in units]) if plan.hook_modules else {}
    return ExecutionOrderPrefetch(
        model,
        units,
        num_forward=plan.num_to_forward_prefetch,
        num_backward=plan.num_to_backward_prefetch,
        groups=groups,
    )


def describe_features(feats: MemoryFeatures, cfg: MMConfig) -> list[str]:
    """Lines for ``mm check``: which modules each memory feature applies to."""

    def shown(names: list[str]) -> str:
        return ", ".join(n or "(root)" for n in names[:3]) + (
            f", ... ({len(names)} modules)" if len(names) > 3 else ""
        )

    lines = []
    if feats.recompute:
        extra = ""
        if feats.recompute_mode == "selective":
            extra = f", keeping the outputs of {', '.join(cfg.model.recompute_plan.save_ops)}"
        lines.append(f"recompute   : {feats.recompute_mode}{extra} -> {shown(feats.recompute)}")
    if feats.offload:
        lines.append(f"act. offload: saved activations to host memory -> {shown(feats.offload)}")
    plan = cfg.parallel.fsdp_plan
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


def chunked_loss_plan(model: nn.Module, cfg: MMConfig) -> tuple[str | None, str]:
    """Where the chunked loss goes (``model.loss_cfg.chunked_loss``): the path of the model's output head,
    or None; and one line for the log saying so, or why not."""
    loss = cfg.model.loss_cfg
    if loss.loss_type == "raw":
        return None, "chunked loss off: loss_type raw trains on the model's own .loss"
    if not loss.chunked_loss:
        return None, "chunked loss off (model.loss_cfg.chunked_loss: false): the loss takes the full logits"
    name = type(model).__name__
    path = plan_of(model).output_head
    if path is None:
        return None, (
            f"chunked loss off: {name} names no output head (ModelPlan.output_head), so the loss takes the "
            "full logits"
        )
    try:
        head = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"{name}: ModelPlan.output_head {path!r} is not a module of the model") from None
    if not isinstance(head, ChunkedLossHead) and type(head) is not nn.Linear:
        return None, (
            f"chunked loss off: {path} is a {type(head).__name__} (e.g. a LoRA layer), not a plain "
            "nn.Linear; the loss takes the full logits"
        )
    return path, (
        f"chunked loss: {path} computes the loss {loss.loss_chunk_size} tokens at a time "
        "(model.loss_cfg.chunked_loss; full-vocabulary logits are never formed)"
    )


def apply_chunked_loss(model: nn.Module, cfg: MMConfig) -> ChunkedLossHead | None:
    """Swap the output head for a :class:`ChunkedLossHead` over its own parameters (before ``fully_shard``,
    after LoRA injection); returns it, or None when :func:`chunked_loss_plan` says no."""
    path, _ = chunked_loss_plan(model, cfg)
    if path is None:
        return None
    head = model.get_submodule(path)
    if isinstance(head, ChunkedLossHead):
        return head
    assert isinstance(head, nn.Linear)  # chunked_loss_plan checked it
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    new = ChunkedLossHead.replacing(head, cfg.model.loss_cfg.loss_chunk_size, IGNORE_INDEX)
    setattr(parent, attr, new)
    return new
