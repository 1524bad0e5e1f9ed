"""Device and backend selection for cuda/nccl, npu/hccl (torch_npu imported lazily) and cpu/gloo."""

from __future__ import annotations

import importlib
import importlib.util

import torch

_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def npu_available() -> bool:
    """True when torch_npu is installed and sees an NPU (imports torch_npu only if installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


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


def device_module(device_type: str):
    """``torch.cuda`` / ``torch.npu`` for accelerators, ``None`` for cpu."""
    return None if device_type == "cpu" else getattr(torch, device_type)


def set_local_device(device_type: str, local_rank: int) -> torch.device:
    """Bind this process to its local accelerator (no-op on cpu) and return the device."""
    if device_type == "cpu":
        return torch.device("cpu")
    device_module(device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)
