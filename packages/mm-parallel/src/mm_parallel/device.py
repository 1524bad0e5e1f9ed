"""Device and backend selection for cuda/nccl, npu/hccl (torch_npu imported lazily) and cpu/gloo.

On an accelerator the process group carries two backends, ``cuda:nccl,cpu:gloo`` (``npu:hccl,cpu:gloo``):
collectives on device tensors go to nccl/hccl, collectives on CPU tensors (checkpoint metadata, object
collectives, DCP's asynchronous save) to gloo, each backend only ever seeing tensors of its own device.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.distributed as dist

_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def npu_available() -> bool:
    """True when torch_npu is installed and sees an NPU (imports torch_npu only if installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    npu = getattr(torch, "npu", None)  # registered by torch_npu
    return npu is not None and bool(npu.is_available())


def detect_device_type() -> str:
    """``cuda`` if a GPU is visible, else ``npu`` if an Ascend NPU is, else ``cpu``."""
    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: nccl, hccl or gloo."""
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise ValueError(
            f"unsupported device type {device_type!r}; expected one of {sorted(_BACKENDS)}"
        ) from None


def process_group_backend(device_type: str) -> str:
    """The ``backend`` argument of ``init_process_group``: ``gloo`` on cpu, else the accelerator's backend
    for its tensors plus gloo for CPU tensors (``cuda:nccl,cpu:gloo``, ``npu:hccl,cpu:gloo``)."""
    backend = backend_for(device_type)
    return backend if device_type == "cpu" else f"{device_type}:{backend},cpu:gloo"


def group_backend(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors (``nccl`` for cuda under
    ``cuda:nccl,cpu:gloo``), from the public ``dist.get_backend`` string; ``""`` when it has none."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(","))
    return per_device.get(device_type, "")


def device_module(device_type: str) -> Any:
    """``torch.cuda`` / ``torch.npu`` for accelerators, ``None`` for cpu (typed ``Any``: the two modules
    share an API but no static type)."""
    return None if device_type == "cpu" else getattr(torch, device_type)


def set_local_device(device_type: str, local_rank: int) -> torch.device:
    """Bind this process to its local accelerator (no-op on cpu) and return the device."""
    if device_type == "cpu":
        return torch.device("cpu")
    device_module(device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)
