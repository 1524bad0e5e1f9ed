"""FSDP2 forward/backward prefetch in the modules' real execution order, by hook group, and pregather.

The order is recorded during the first forward with forward pre-hooks on the FSDP units (so it is the order
the model really runs them in, not the order of names or of patterns in a config). When the root's forward
ends the first time, the units are told what to all-gather ahead of themselves through FSDP2's public
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``; the recording hooks are then
removed, so later steps pay nothing.

**Hook groups.** Units may be grouped (``groups`` maps a unit's name to its group, e.g. the decoder layer
that holds both the layer's own unit and its experts' unit, which FSDP2 cannot merge because they are
sharded over different meshes). A group is gathered as one: the first of its units to run in forward
all-gathers the others of the group with its own, and so does the first of them to run in backward (the
outermost unit when the group's module is itself a unit, else the last to run in forward). Prefetch counts
are then in groups: ``num_forward = 1`` gathers the whole next group (the next layer's dense and expert
weights). A unit outside every group is a group of its own. Each unit still reshards after its own forward,
the earliest point its parameters are free.

**Pregather.** :meth:`pregather` all-gathers the root and the first group of the next forward right away
(``unshard(async_op=True)``; FSDP2 waits for it in the units' pre-forward), so that their communication
overlaps what runs between the optimizer step and the next forward (data loading, logging).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule


class ExecutionOrderPrefetch:
    """Records the units' forward order once, then wires FSDP2 prefetch: each hook group gathers its own
    units together, plus the next ``num_forward`` groups in forward and the next ``num_backward`` groups in
    backward (reverse forward order)."""

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[tuple[str, nn.Module]],
        *,
        num_forward: int = 0,
        num_backward: int = 0,
        groups: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(root, FSDPModule):
            raise ValueError("prefetch root is not an FSDP2 module (apply fully_shard first)")
        self._root = root
        self._units: dict[str, FSDPModule] = {}
        for name, unit in units:
            if not isinstance(unit, FSDPModule):
                raise ValueError(f"prefetch unit {name!r} is not an FSDP2 module (apply fully_shard first)")
            if unit is not root:
                self._units[name] = unit
        unknown = sorted(set(groups or {}) - set(self._units))
        if unknown:
            raise ValueError(f"hook group of {unknown[0]!r}, which is not one of the FSDP units")
        self._group_of = {n: (groups or {}).get(n, n) for n in self._units}
        self.num_forward = num_forward
        self.num_backward = num_backward
        self.order: list[str] = []
        #: the recorded groups in forward order, each with its units in forward order
        self.group_order: list[list[str]] = []
        self.forward_plan: dict[str, list[str]] = {}
        self.backward_plan: dict[str, list[str]] = {}
        self._handles = [
            unit.register_forward_pre_hook(self._recorder(name)) for name, unit in units if unit is not root
        ]
        self._handles.append(root.register_forward_hook(self._wire))

    @property
    def wired(self) -> bool:
        return not self._handles

    def _recorder(self, name: str) -> Callable[[nn.Module, Any], None]:
        def record(_module: nn.Module, _args: Any) -> None:
            if name not in self.order:
                self.order.append(name)

        return record

    def _wire(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        index: dict[str, int] = {}
        for name in self.order:
            key = self._group_of[name]
            if key not in index:
                index[key] = len(self.group_order)
                self.group_order.append([])
            self.group_order[index[key]].append(name)
        groups = self.group_order
        for i, members in enumerate(groups):
            ahead = [n for g in groups[i + 1 : i + 1 + self.num_forward] for n in g]
            behind = [n for g in groups[max(0, i - self.num_backward) : i][::-1] for n in g]
            # the group's first unit in backward: the group's own module when it is a unit (its outputs are
            # the group's outputs), else the last unit of the group to run in forward
            key = self._group_of[members[0]]
            first_back = key if key in members else members[-1]
            fwd = {members[0]: members[1:] + ahead}
            bwd = {first_back: [n for n in members[::-1] if n != first_back] + behind}
            for name in members:
                self.forward_plan[name] = fwd.get(name, [])
                self.backward_plan[name] = bwd.get(name, [])
                unit = self._units[name]
                if self.forward_plan[name] or self.num_forward:
                    unit.set_modules_to_forward_prefetch([self._units[n] for n in self.forward_plan[name]])
                if self.backward_plan[name] or self.num_backward:
                    unit.set_modules_to_backward_prefetch([self._units[n] for n in self.backward_plan[name]])

    def describe(self) -> str:
        """One line: the groups in forward order with their units (once wired)."""
        if not self.wired:
            return "gathering plan: not wired yet (it is recorded during the first forward)"
        if not self.group_order:
            return "gathering plan: the root is the only FSDP unit"
        shown = "; ".join(f"{self._group_of[g[0]]} [{', '.join(g)}]" for g in self.group_order[:2])
        more = f"; ... ({len(self.group_order)} groups)" if len(self.group_order) > 2 else ""
        return (
            f"gathering plan: {shown}{more}; prefetch {self.num_forward} group(s) ahead in forward, "
            f"{self.num_backward} in backward"
        )

    def pregather(self) -> None:
        """All-gather the root and the first group of the next forward now (asynchronously); call after the
        optimizer step when another forward follows. Does nothing before the first forward has been seen."""
        if not self.wired:
            return
        self._root.unshard(async_op=True)
        for name in self.group_order[0] if self.group_order else []:
            self._units[name].unshard(async_op=True)
