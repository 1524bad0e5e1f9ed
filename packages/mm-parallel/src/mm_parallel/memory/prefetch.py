"""FSDP2 forward/backward prefetch in the modules' real execution order.

The order is recorded during the first forward with forward pre-hooks on the FSDP units (so it is the order
the model really runs them in, not the order of names or of patterns in a config). When the root's forward
ends the first time, each unit is told which units to all-gather ahead of itself through FSDP2's public
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``; the recording hooks are then
removed, so later steps pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule


class ExecutionOrderPrefetch:
    """Records the units' forward order once, then wires FSDP2 prefetch of the next ``num_forward`` units in
    forward and the next ``num_backward`` units in backward (reverse forward order)."""

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[tuple[str, nn.Module]],
        *,
        num_forward: int = 0,
        num_backward: int = 0,
    ) -> None:
        self._units: dict[str, FSDPModule] = {}
        for name, unit in units:
            if not isinstance(unit, FSDPModule):
                raise ValueError(f"prefetch unit {name!r} is not an FSDP2 module (apply fully_shard first)")
            if unit is not root:
                self._units[name] = unit
        self.num_forward = num_forward
        self.num_backward = num_backward
        self.order: list[str] = []
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
        order = self.order
        for i, name in enumerate(order):
            unit = self._units[name]
            if self.num_forward:
                ahead = order[i + 1 : i + 1 + self.num_forward]
                self.forward_plan[name] = ahead
                unit.set_modules_to_forward_prefetch([self._units[n] for n in ahead])
            if self.num_backward:
                behind = order[max(0, i - self.num_backward) : i][::-1]
                self.backward_plan[name] = behind
                unit.set_modules_to_backward_prefetch([self._units[n] for n in behind])
