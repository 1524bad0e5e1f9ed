"""Device kernels inside transformers' models: RMSNorm modules use :mod:`mm_parallel.kernels`' ``rms_norm``.

At build time, on a device type whose table entry is a fused kernel (Ascend: ``torch_npu.npu_rms_norm``),
every RMSNorm module whose class the model's plan names (:attr:`ModelPlan.rms_norm_classes
<mm_core.models.ModelPlan.rms_norm_classes>`: classes of the ``weight * normalised(x)`` formula, which the
plugin vouches for; mm-core knows no model family's class names) has its class switched to a subclass whose
``forward`` calls the table's entry, as FSDP2's ``fully_shard`` does for the modules it wraps: parameters,
buffers, hooks and state-dict keys stay as they are, the plugin's and transformers' own classes are
untouched. Elsewhere (CPU, CUDA) nothing is switched: the model keeps its code, so its numbers do not change
(the torch entry is bit-identical to transformers' formula anyway, checked in the tests).
"""

from __future__ import annotations

import torch
from torch import nn

from mm_core.models.plan import plan_of
from mm_parallel.kernels import kernel

#: device types whose ``rms_norm`` entry is a fused kernel worth switching to
FUSED_NORM_DEVICES = frozenset({"npu"})


class _KernelRMSNorm(nn.Module):
    """``forward`` through the kernel table's ``rms_norm`` for the input's device type."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        run = kernel("rms_norm", hidden_states.device.type)
        out: torch.Tensor = run(hidden_states, self.weight, self.variance_epsilon)
        return out


#: one kernel subclass per switched class
_KERNEL_CLASSES: dict[type, type] = {}


def _kernel_class(cls: type) -> type:
    if cls not in _KERNEL_CLASSES:
        _KERNEL_CLASSES[cls] = type(f"Kernel{cls.__name__}", (_KernelRMSNorm, cls), {"__module__": __name__})
    return _KERNEL_CLASSES[cls]


def use_device_kernels(model: nn.Module, device_type: str, *, force: bool = False) -> list[str]:
    """Switch the RMSNorm modules of ``model`` whose classes its plan lists (``rms_norm_classes``) to the
    kernel table on ``device_type`` (only where its entry is fused, unless ``force``); returns the switched
    modules' names."""
    if device_type not in FUSED_NORM_DEVICES and not force:
        return []
    classes = set(plan_of(model).rms_norm_classes)
    switched: list[str] = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__name__ not in classes:
            continue
        if not isinstance(getattr(module, "weight", None), nn.Parameter) or not isinstance(
            getattr(module, "variance_epsilon", None), float
        ):
            raise TypeError(
                f"{type(model).__name__}.mm_plan.rms_norm_classes lists {cls.__name__}, but {name!r} has no "
                "weight parameter and float variance_epsilon (the formula the field promises)"
            )
        module.__class__ = _kernel_class(cls)
        switched.append(name)
    return switched
