"""Device kernels inside transformers' models: RMSNorm modules use :mod:`mm_parallel.kernels`' ``rms_norm``.

At build time, on a device type whose table entry is a fused kernel (Ascend: ``torch_npu.npu_rms_norm``),
every RMSNorm module of a known formula (``weight * normalised(x)``, the classes in :data:`RMS_NORM_CLASSES`)
has its class switched to a subclass whose ``forward`` calls the table's entry, as FSDP2's ``fully_shard``
does for the modules it wraps: parameters, buffers, hooks and state-dict keys stay as they are, transformers'
own classes are untouched. Elsewhere (CPU, CUDA) nothing is switched: the model keeps transformers' code, so
its numbers do not change (the torch entry is bit-identical to it anyway, checked in the tests).
"""

from __future__ import annotations

import torch
from torch import nn

from mm_parallel.kernels import kernel

#: transformers' RMSNorm classes computing ``weight * (x / rms(x)).to(dtype)`` in fp32 (``variance_epsilon``)
RMS_NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Qwen3VLTextRMSNorm",
        "Qwen3VLMoeTextRMSNorm",
    }
)
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


#: one kernel subclass per transformers class
_KERNEL_CLASSES: dict[type, type] = {}


def _kernel_class(cls: type) -> type:
    if cls not in _KERNEL_CLASSES:
        _KERNEL_CLASSES[cls] = type(f"Kernel{cls.__name__}", (_KernelRMSNorm, cls), {"__module__": __name__})
    return _KERNEL_CLASSES[cls]


def use_device_kernels(model: nn.Module, device_type: str, *, force: bool = False) -> list[str]:
    """Switch the RMSNorm modules of ``model`` to the kernel table on ``device_type`` (only where its entry is
    fused, unless ``force``); returns the switched modules' names."""
    if device_type not in FUSED_NORM_DEVICES and not force:
        return []
    switched: list[str] = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__name__ in RMS_NORM_CLASSES and cls.__module__.startswith("transformers."):
            module.__class__ = _kernel_class(cls)
            switched.append(name)
    return switched
