"""Watch a training step for collectives off the configured device and for host syncs (test-only instruments).

:class:`DeviceAudit` is a context manager made of two torch modes; nothing in mm or torch is patched:

- a ``TorchDispatchMode`` sees every collective however it is issued (``dist.all_reduce``, FSDP2's
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, DTensor's functional collectives, object
  collectives), i.e. every op of the ``c10d`` / ``_c10d_functional`` namespaces, and records the devices of
  its tensors and the first calling frame outside torch. A tensor that is not on the configured device is a
  violation; one on ``meta`` (see below) cannot even run, so the audit raises right there, naming the site.
- a ``TorchFunctionMode`` watches the calls made directly by mm's step code (modules ``STEP_CODE``):

  * a tensor factory (``torch.tensor``, ``zeros``, ``ones``, ``full``, ...) called with no ``device`` gets
    ``device="meta"``. On an accelerator such a tensor lands on the CPU, away from the configured device;
    on a CPU run the configured device is the CPU too, so without this the device check could never fail.
    ``meta`` plays the part of "not the configured device" and makes the mistake visible on every machine.
  * host syncs: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float()``, ``int()``, ``bool()``
    and ``__index__`` on a tensor of the configured device, counted per call site. On an accelerator each
    one waits for the device to drain.

Host data by design (the data pipeline, checkpointing) is not step code and is not watched.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STEP_CODE = (
    "mm_core.train",
    "mm_core.tasks",
    "mm_core.parallel",
    "mm_core.optim",
    "mm_parallel",
    "mm_models_",
)
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}
_PLUMBING = ("torch.overrides", "torch.utils._device", __name__)


def _module(frame: Any) -> str:
    return frame.f_globals.get("__name__", "?")


def _where(frame: Any) -> str:
    return f"{_module(frame)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _direct_caller() -> Any:
    """The frame that called the torch function being handled (skipping the modes' own plumbing)."""
    frame = sys._getframe(2)
    while frame is not None and _module(frame).startswith(_PLUMBING):
        frame = frame.f_back
    return frame


def _outside_torch() -> str:
    """The innermost calling frame that is not torch's (nor this module's): where a collective came from."""
    frame = sys._getframe(2)
    while frame is not None and (_module(frame).split(".")[0] == "torch" or _module(frame) == __name__):
        frame = frame.f_back
    return _where(frame) if frame is not None else "?"


@dataclass
class Collective:
    op: str
    devices: tuple[str, ...]
    site: str


@dataclass
class DeviceAudit:
    """Records collectives and host syncs inside ``with DeviceAudit(device):``; see the module docstring."""

    device: torch.device
    step_code: tuple[str, ...] = STEP_CODE
    collectives: list[Collective] = field(default_factory=list)
    implicit_device: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self._modes: list[Any] = []

    @property
    def violations(self) -> list[Collective]:
        """Collectives with a tensor that is not on the configured device."""
        want = self._device_str(self.device)
        return [c for c in self.collectives if any(d != want for d in c.devices)]

    @staticmethod
    def _device_str(device: torch.device) -> str:
        return device.type if device.type in ("cpu", "meta") else str(device)

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta" or self._device_str(t.device) == self._device_str(self.device)

    def __enter__(self) -> DeviceAudit:
        self._modes = [_StepCode(self), _Collectives(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def summary(self) -> dict[str, Any]:
        """Plain data for a report: collective counts by op and device, violations, syncs by site."""
        ops = Counter(f"{c.op} on {','.join(sorted(set(c.devices)))}" for c in self.collectives)
        return {
            "collectives": dict(ops),
            "violations": [f"{c.op} on {','.join(c.devices)} from {c.site}" for c in self.violations],
            "implicit_device": dict(self.implicit_device),
            "syncs": dict(self.syncs),
        }


class _StepCode(TorchFunctionMode):
    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        caller = _direct_caller()
        if caller is not None and _module(caller).startswith(self.audit.step_code):
            if func in self.constructors and kwargs.get("device") is None:
                self.audit.implicit_device[_where(caller)] += 1
                kwargs["device"] = "meta"
            elif (
                getattr(func, "__name__", "") in SYNC_METHODS
                and args
                and isinstance(args[0], torch.Tensor)
                and self.audit._on_device(args[0])
            ):
                self.audit.syncs[f"{_where(caller)} .{func.__name__}()"] += 1
        return func(*args, **kwargs)


class _Collectives(TorchDispatchMode):
    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself to plain-tensor ops (and collectives) first
        if func.namespace in COLLECTIVE_NAMESPACES:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            devices = tuple(DeviceAudit._device_str(t.device) for t in tensors)
            record = Collective(func.name(), devices, _outside_torch())
            self.audit.collectives.append(record)
            if "meta" in devices:
                raise AssertionError(
                    f"{record.op} from {record.site} got a tensor created without a device (on meta here; "
                    f"on the CPU on an accelerator), expected {self.audit.device}: create it with "
                    "device=<the trainer's device>"
                )
        return func(*args, **kwargs)
