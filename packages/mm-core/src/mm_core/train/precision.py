"""fp32 matrix products on CUDA: TensorFloat-32 unless the run asks for deterministic computation.

Parameters kept in fp32 (``parallel.fsdp_plan.param_dtype: fp32``, or the fp32 parts of a bf16 run: the
chunked loss's logits, fp32 norms, optimizer math) multiply in TF32 on Ampere and later GPUs, as torchtitan
and Megatron run them: several times the fp32 throughput at bf16-class rounding of the inputs (10-bit
mantissa) with fp32 accumulation. ``training.use_deter_comp: true`` keeps full fp32 (torch's default).
Other devices are left as they are (Ascend's fp32 matmuls are its own setting; CPUs have no TF32).
"""

from __future__ import annotations

import torch


def use_tf32(device: torch.device, deterministic: bool) -> bool:
    """Whether fp32 matmuls and convolutions on ``device`` run in TF32: on CUDA, unless ``deterministic``
    (``training.use_deter_comp``)."""
    return device.type == "cuda" and not deterministic


def set_fp32_precision(device: torch.device, deterministic: bool) -> str:
    """Apply :func:`use_tf32` at worker start (``torch.set_float32_matmul_precision("high")`` and cuDNN's
    ``allow_tf32``); returns one line for the log saying what was chosen and why."""
    if use_tf32(device, deterministic):
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        return "fp32 matmuls: TF32 on cuda (training.use_deter_comp: false)"
    if device.type == "cuda":
        return "fp32 matmuls: full fp32 (training.use_deter_comp: true)"
    return f"fp32 matmuls: the {device.type} default (TF32 applies to cuda only)"
