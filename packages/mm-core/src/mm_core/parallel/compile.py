"""``training.compile``: ``torch.compile`` each FSDP unit's forward in place, as torchtitan does per block.

Planned in :func:`~mm_core.parallel.apply.shard_model` before recompute / activation offload (a compiled unit
that is recomputed gets its checkpoint inside the compiled graph, not recompute's hooks) and applied after
them, before ``fully_shard`` (torchtitan's order), through :func:`mm_parallel.compile.compile_modules`.
Compiled: the FSDP units that hold no other unit and no expert-parallel module. The others run eagerly: a
unit holding another unit would have that unit's FSDP2 hooks inside its graph, and an expert-parallel module
routes a data-dependent number of tokens to each expert (and exchanges them between ranks when ``ep > 1``).
Recompute or offload of a module *inside* a compiled unit is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from mm_core.errors import ConfigError
from mm_core.parallel.memory import MemoryFeatures
from mm_parallel.compile import compile_modules
from mm_parallel.memory import resolve_ops

log = logging.getLogger("mm")

KEY = "training.compile"
#: appended to a compile failure (dynamo or inductor), which surfaces at the unit's first forward
ERROR_HINT = (
    f"{KEY}: true compiles the forward of each FSDP unit (parallel.fsdp_plan.apply_modules, or the model's "
    f"default plan); set {KEY}: false to train this model eagerly"
)


@dataclass(frozen=True)
class CompilePlan:
    """Which FSDP units ``training.compile`` compiles, and why the others run eagerly."""

    compiled: tuple[str, ...] = ()
    eager: Mapping[str, str] = field(default_factory=dict)
    #: compiled units that are recomputed: checkpointed inside their compiled forward
    recomputed: tuple[str, ...] = ()

    def describe(self) -> str:
        def shown(names: Sequence[str]) -> str:
            return ", ".join(names[:3]) + (f", ... ({len(names)} units)" if len(names) > 3 else "")

        total = len(self.compiled) + len(self.eager)
        if not total:
            return "no FSDP unit besides the root, so nothing is compiled (parallel.fsdp_plan.apply_modules)"
        line = f"torch.compile per FSDP unit: {len(self.compiled)} of {total} compiled"
        if self.compiled:
            line += f" ({shown(self.compiled)})"
        if self.eager:
            why = [f"{unit or '(root)'} {reason}" for unit, reason in self.eager.items()]
            line += f"; eager: {'; '.join(why[:2])}" + (f"; ... ({len(why)} units)" if len(why) > 2 else "")
        return line


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``outer`` ('' is the root)."""
    return name != outer and (not outer or name.startswith(outer + "."))


def plan_compile(
    units: Sequence[str], experts: Sequence[str], feats: MemoryFeatures, others: Sequence[str] = ()
) -> CompilePlan:
    """Split the FSDP ``units`` (module names, expert modules excluded) into compiled and eager ones, and
    check the memory features ``feats`` against the compiled ones (a ConfigError names the YAML key).
    ``others``: the modules of the other FSDP units (the embedding, the final norm and head), never compiled;
    a unit holding one runs eagerly."""
    compiled: list[str] = []
    eager: dict[str, str] = {}
    for unit in units:
        held_experts = [e for e in experts if _inside(e, unit)]
        held_units = [u for u in [*units, *others] if _inside(u, unit)]
        if not unit:
            eager[unit] = "is the whole model"
        elif held_experts:
            eager[unit] = f"holds the expert-parallel module {held_experts[0]}"
        elif held_units:
            eager[unit] = f"holds the FSDP unit {held_units[0]}"
        else:
            compiled.append(unit)
    # recompute checkpoints only the outermost of the matched modules
    recomputed = [r for r in feats.recompute if not any(_inside(r, o) for o in feats.recompute)]
    recomputed_units = tuple(u for u in compiled if u in recomputed)
    for key, names in (
        ("model.recompute_plan.apply_modules", recomputed),
        ("model.activation_offload_plan.apply_modules", feats.offload),
    ):
        for name in names:
            outer = next((u for u in compiled if _inside(name, u)), None)
            if outer is not None:
                raise ConfigError(
                    f"{key}: {name} is inside the FSDP unit {outer}, which {KEY}: true compiles into one "
                    "graph; name whole FSDP units (the model's default plan) or modules that contain them, "
                    f"or set {KEY}: false"
                )
    return CompilePlan(tuple(compiled), eager, recomputed_units)


def apply_compile(model: nn.Module, plan: CompilePlan, feats: MemoryFeatures, *, is_main: bool) -> None:
    """Compile the planned FSDP units in place (after :func:`apply_memory_features` was given
    ``plan.compiled`` to leave to it, before ``fully_shard``) and log how many on rank 0 (``is_main``)."""
    modules = dict(model.named_modules())
    selective = feats.recompute_mode == "selective"
    compile_modules(
        [(n, modules[n]) for n in plan.compiled],
        checkpointed=list(plan.recomputed),
        save_ops=resolve_ops(list(feats.save_ops)) if selective else None,
        error_hint=ERROR_HINT,
    )
    if is_main:
        log.warning(f"{KEY}: {plan.describe()}")
