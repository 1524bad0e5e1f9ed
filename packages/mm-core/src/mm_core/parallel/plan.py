"""The one build plan: every decision about how a model is sharded and run, resolved once.

:func:`resolve_build` reads the built model (after ``model.freeze`` and LoRA, see
:func:`~mm_core.parallel.apply.prepare_model`), the config parts it needs and the parallel sizes, and returns
a frozen :class:`BuildPlan` without touching the model. :func:`~mm_core.parallel.apply.shard_model` applies
it; ``mm check`` prints it (and ``mm check --json`` writes it); the task, the memory estimate and the FLOPs
count read it. Each decision names the YAML key (or the model's default plan) that made it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from mm_core.config.schema import ModelConfig, ParallelConfig
from mm_core.errors import ConfigError
from mm_core.models.facts import ModelFacts
from mm_core.models.plan import ModelPlan, plan_of
from mm_core.parallel.compile import CompilePlan, plan_compile
from mm_core.parallel.context import ContextPlan, plan_context_parallel
from mm_core.parallel.experts import expert_modules
from mm_core.parallel.matching import ModuleMatches
from mm_core.parallel.memory import (
    ChunkedHead,
    GatherPlan,
    MemoryFeatures,
    chunked_loss_plan,
    plan_gather,
    plan_memory_features,
)
from mm_core.parallel.state import ParallelSizes


@dataclass(frozen=True)
class BuildSettings:
    """The config parts a build reads: the ``parallel`` and ``model`` blocks, ``training.compile``, and
    whether this is the run's main model (``main=False``: another model of a task, which takes its FSDP units
    from its own plan, since ``parallel.fsdp_plan.apply_modules`` / ``ignored_modules`` name the main
    model's modules, and computes its own loss)."""

    parallel: ParallelConfig
    model: ModelConfig
    compile: bool = False
    main: bool = True


@dataclass(frozen=True)
class Prepared:
    """What :func:`~mm_core.parallel.apply.prepare_model` did to the model before the plan is resolved."""

    #: modules ``model.freeze`` matched (their parameters are frozen)
    frozen: tuple[str, ...] = ()
    #: modules ``training.lora.target_modules`` adapted (everything else is frozen)
    lora: tuple[str, ...] = ()


@dataclass(frozen=True)
class Units:
    """Modules chosen by patterns: from the YAML key, or the model's default plan (``key`` says which)."""

    key: str
    #: pattern -> the modules it matched, in model order
    matched: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: the chosen modules, in the order they are applied
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class EdgeUnits:
    """The token embedding and the final norm + output head as FSDP units of their own (the model plan's
    ``input_embedding``, ``output_norm`` and ``output_head``), so that they are gathered and reduced like a
    layer (overlapped with the layers' compute) and resharded after use, instead of living on the root unit,
    which stays gathered for the whole step. A tied embedding and head are one unit."""

    #: each unit: the module names sharded together, in forward order
    groups: tuple[tuple[str, ...], ...] = ()
    #: the unit kept gathered from its forward into the backward (the head's; its backward runs next)
    kept: tuple[str, ...] | None = None
    #: for ``mm check``: (the modules, what became of them: a unit, or why they stay on the root)
    notes: tuple[tuple[str, str], ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g)


@dataclass(frozen=True)
class MixedPrecision:
    """``parallel.fsdp_plan.{param,reduce,output}_dtype`` and ``cast_forward_inputs``."""

    param_dtype: str
    reduce_dtype: str
    output_dtype: str | None
    cast_forward_inputs: bool


@dataclass(frozen=True)
class BuildPlan:
    """How one model is built (module docstring). Names are module paths of the model."""

    settings: BuildSettings
    sizes: ParallelSizes
    #: the model class's own plan (``mm_plan``), read once
    model_plan: ModelPlan
    facts: ModelFacts
    prepared: Prepared
    #: ``parallel.fsdp_plan.apply_modules`` (or the default plan): inner units first, expert modules excluded
    fsdp: Units
    #: ``parallel.ep_plan.apply_modules`` (or the default plan): empty when expert parallelism is off
    experts: Units
    #: ``parallel.fsdp_plan.ignored_modules``: kept whole on every rank (frozen)
    ignored: tuple[str, ...]
    mixed_precision: MixedPrecision
    #: ``model.recompute_plan`` / ``model.activation_offload_plan``
    memory: MemoryFeatures
    #: ``parallel.fsdp_plan.hook_modules`` / ``num_to_*_prefetch`` / ``pregather``; None when none is asked
    gather: GatherPlan | None
    #: ``training.compile``; None when off
    compile: CompilePlan | None
    #: ``model.loss_cfg.chunked_loss``
    chunked: ChunkedHead
    #: ``parallel.ulysses_parallel_size`` / ``ring_attention_size``; None when ``cp == 1``
    context: ContextPlan | None
    #: every match of the model plan's ``expert_modules`` / ``fsdp_units`` (whatever the YAML says), pattern
    #: by pattern: the FLOPs count's routed experts and tower units
    default_experts: tuple[str, ...] = ()
    default_units: tuple[str, ...] = ()
    #: the embedding and the final norm + head as units of their own (model plan); applied before ``fsdp``
    edges: EdgeUnits = EdgeUnits()

    @property
    def unit_groups(self) -> list[tuple[str, ...]]:
        """Every FSDP unit but the root and the expert units, each as the module names sharded together:
        the edge units (embedding, final norm + head), then ``fsdp``'s, in the order they are applied."""
        return [*self.edges.groups, *((n,) for n in self.fsdp.names)]

    @property
    def expert_units(self) -> tuple[str, ...]:
        """The expert modules that are FSDP units of their own (over ``efsdp``, when ``ep > 1``)."""
        return self.experts.names if self.sizes.ep > 1 else ()

    @property
    def fsdp_mesh(self) -> tuple[str, ...]:
        """The mesh dimensions the FSDP units shard over (``ParallelState.fsdp_mesh``): HSDP replicates over
        ``dp_replicate``."""
        return ("dp_replicate", "dp_shard_cp") if self.sizes.dp_replicate > 1 else ("dp_shard_cp",)

    @property
    def expert_mesh(self) -> tuple[str, ...]:
        """The mesh dimensions an expert unit shards over (``ParallelState.expert_mesh``; experts split over
        ``ep``); empty without expert units."""
        if not self.expert_units:
            return ()
        return ("dp_replicate", "efsdp") if self.sizes.dp_replicate > 1 else ("efsdp",)

    @property
    def unit_names(self) -> list[str]:
        """Every FSDP unit but the root, sorted: the memory estimate's units."""
        return sorted(self.fsdp.names)


def _patterns(settings: BuildSettings, model_plan: ModelPlan) -> list[str]:
    p, m = settings.parallel, settings.model
    out = [*p.fsdp_plan.apply_modules, *p.fsdp_plan.ignored_modules, *p.fsdp_plan.hook_modules]
    out += [*p.ep_plan.apply_modules, *p.ep_plan.apply_efsdp_modules]
    out += [*m.recompute_plan.apply_modules, *m.activation_offload_plan.apply_modules]
    out += [*model_plan.fsdp_units, *model_plan.expert_modules, *model_plan.recompute_units]
    return out


def _fsdp_units(
    model: nn.Module,
    settings: BuildSettings,
    model_plan: ModelPlan,
    match: ModuleMatches,
    experts: Sequence[str],
) -> Units:
    yaml = list(settings.parallel.fsdp_plan.apply_modules) if settings.main else []
    if yaml:
        patterns, key = yaml, "parallel.fsdp_plan.apply_modules"
    else:
        patterns, key = list(model_plan.fsdp_units), f"default plan of {type(model).__name__}"
    matched = match(patterns, key)
    wanted = {n for hits in matched.values() for n in hits}
    names = [n for n in match.names if n in wanted and n not in experts]
    # inner modules must be wrapped before the modules that contain them
    names.sort(key=lambda n: -n.count("."))
    return Units(key, {k: tuple(v) for k, v in matched.items()}, tuple(names))


def _within(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or inside it ('' is the root)."""
    return name == outer or not outer or name.startswith(outer + ".")


def _edge_units(
    model: nn.Module, model_plan: ModelPlan, units: Sequence[str], ignored: Sequence[str]
) -> EdgeUnits:
    """The model plan's ``input_embedding`` and ``output_norm`` + ``output_head`` as FSDP units of their own
    (see :class:`EdgeUnits`), unless a module of one is (or holds) a unit already, lies in
    ``parallel.fsdp_plan.ignored_modules``, or holds no parameter."""
    emb, norm, head = model_plan.input_embedding, model_plan.output_norm, model_plan.output_head
    if emb is None and norm is None:
        return EdgeUnits()  # the plan does not ask for them (the head alone stays on the root)
    modules = dict(model.named_modules())
    cls = type(model).__name__
    for field_name, path in (("input_embedding", emb), ("output_norm", norm), ("output_head", head)):
        if path is not None and path not in modules:
            raise ConfigError(f"{cls}: ModelPlan.{field_name} {path!r} is not a module of the model")

    def params(path: str) -> set[int]:
        return {id(p) for p in modules[path].parameters()}

    tied = emb is not None and head is not None and bool(params(emb) & params(head))
    wanted: list[tuple[str, ...]]
    if tied:
        assert emb is not None and head is not None  # tied implies both
        wanted = [tuple(n for n in (emb, norm, head) if n is not None)]
    else:
        wanted = [(emb,)] if emb is not None else []
        wanted.append(tuple(n for n in (norm, head) if n is not None))
    groups: list[tuple[str, ...]] = []
    notes: list[tuple[str, str]] = []
    for group in wanted:
        label = " + ".join(group)
        clash = next((u for u in units for n in group if _within(u, n)), None)
        dropped = next((i for i in ignored for n in group if _within(n, i)), None)
        if clash is not None:
            notes.append((label, f"not a unit of its own (it is or holds the FSDP unit {clash or '(root)'})"))
        elif dropped is not None:
            notes.append((label, f"stays on the root (parallel.fsdp_plan.ignored_modules: {dropped})"))
        elif not any(True for n in group for _ in modules[n].parameters()):
            notes.append((label, "stays on the root (no parameters)"))
        else:
            groups.append(group)
            what = "tied embedding and head, " if tied else ""
            held = ", kept gathered into the backward" if head in group else ""
            notes.append((label, f"one FSDP unit ({what}model plan{held})"))
    kept = next((g for g in groups if head in g), None)
    return EdgeUnits(tuple(groups), kept, tuple(notes))


def _ignored(model: nn.Module, settings: BuildSettings, match: ModuleMatches) -> tuple[str, ...]:
    """``parallel.fsdp_plan.ignored_modules``: kept whole on every rank, so they must be frozen."""
    patterns = settings.parallel.fsdp_plan.ignored_modules if settings.main else []
    if not patterns:
        return ()
    key = "parallel.fsdp_plan.ignored_modules"
    wanted = {n for hits in match(list(patterns), key).values() for n in hits}
    names = tuple(n for n in match.names if n in wanted)
    for name in names:
        for pname, p in model.get_submodule(name).named_parameters():
            if p.requires_grad:
                raise ConfigError(
                    f"{key}: {name}.{pname} is trainable; FSDP does not reduce gradients of ignored modules, "
                    "so only frozen modules (model.freeze) may be ignored"
                )
    return names


def resolve_build(
    model: nn.Module, settings: BuildSettings, sizes: ParallelSizes, prepared: Prepared = Prepared()
) -> BuildPlan:
    """Resolve and check every decision of the build of ``model`` (module docstring); the model is only
    read. Raises :class:`~mm_core.errors.ConfigError` naming the YAML key of a decision that cannot work."""
    model_plan = plan_of(model)
    facts = ModelFacts.of(model)
    match = ModuleMatches(model, _patterns(settings, model_plan))
    parallel, mcfg = settings.parallel, settings.model
    names, source = expert_modules(model, parallel, model_plan, sizes, match)
    experts = Units(source, {}, tuple(names))
    fsdp = _fsdp_units(model, settings, model_plan, match, names)
    memory = plan_memory_features(mcfg, model_plan, type(model).__name__, match)
    fp = parallel.fsdp_plan
    expert_units = list(names) if sizes.ep > 1 else []
    ignored = _ignored(model, settings, match)
    edges = _edge_units(model, model_plan, fsdp.names, ignored)
    gather = plan_gather(fp, [*fsdp.names, *expert_units], match)
    compiled = plan_compile(list(fsdp.names), names, memory, edges.modules) if settings.compile else None
    chunked = chunked_loss_plan(model, mcfg.loss_cfg, model_plan, enabled=settings.main)
    context = plan_context_parallel(model, facts, model_plan, mcfg, sizes) if sizes.cp > 1 else None
    return BuildPlan(
        settings=settings,
        sizes=sizes,
        model_plan=model_plan,
        facts=facts,
        prepared=prepared,
        fsdp=fsdp,
        experts=experts,
        ignored=ignored,
        mixed_precision=MixedPrecision(
            fp.param_dtype, fp.reduce_dtype, fp.output_dtype, fp.cast_forward_inputs
        ),
        memory=memory,
        gather=gather,
        compile=compiled,
        chunked=chunked,
        context=context,
        default_experts=match.every(model_plan.expert_modules),
        default_units=match.every(model_plan.fsdp_units),
        edges=edges,
    )


def plan_json(plan: BuildPlan) -> dict[str, Any]:
    """The plan as plain JSON values (``mm check --json``)."""
    mem = plan.memory
    return {
        "model": plan.facts.class_name,
        "facts": {
            "num_layers": plan.facts.num_layers,
            "hidden_size": plan.facts.hidden_size,
            "num_heads": plan.facts.num_heads,
            "num_kv_heads": plan.facts.num_kv_heads,
            "head_dim": plan.facts.head_dim,
            "vocab_size": plan.facts.vocab_size,
            "num_experts": plan.facts.num_experts,
            "towers": list(plan.facts.towers),
        },
        "frozen": {"model.freeze": list(plan.prepared.frozen), "training.lora": list(plan.prepared.lora)},
        "fsdp_units": {
            "key": plan.fsdp.key,
            "matched": {k: list(v) for k, v in plan.fsdp.matched.items()},
            "units": list(plan.fsdp.names),
            "mesh": list(plan.fsdp_mesh),
        },
        "edge_units": {
            "key": "model plan (input_embedding, output_norm, output_head)",
            "units": [list(g) for g in plan.edges.groups],
            "kept_after_forward": None if plan.edges.kept is None else list(plan.edges.kept),
            "notes": dict(plan.edges.notes),
        },
        "experts": {
            "key": plan.experts.key,
            "modules": list(plan.experts.names),
            "ep": plan.sizes.ep,
            "mesh": list(plan.expert_mesh),
        },
        "ignored": {"key": "parallel.fsdp_plan.ignored_modules", "modules": list(plan.ignored)},
        "mixed_precision": {"key": "parallel.fsdp_plan", **vars(plan.mixed_precision)},
        "recompute": {
            "key": "model.recompute_plan.apply_modules",
            "mode": mem.recompute_mode,
            "modules": list(mem.recompute),
        },
        "offload": {"key": "model.activation_offload_plan.apply_modules", "modules": list(mem.offload)},
        "gather": None if plan.gather is None else plan.gather.to_json(),
        "compile": None
        if plan.compile is None
        else {
            "key": "training.compile",
            "compiled": list(plan.compile.compiled),
            "eager": dict(plan.compile.eager),
            "recomputed": list(plan.compile.recomputed),
        },
        "chunked_loss": {
            "key": "model.loss_cfg.chunked_loss",
            "head": plan.chunked.path,
            "chunk_size": plan.chunked.chunk_size if plan.chunked.path is not None else None,
            "note": plan.chunked.note,
        },
        "context_parallel": None if plan.context is None else plan.context.to_json(),
    }
