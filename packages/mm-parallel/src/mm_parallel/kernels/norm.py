"""RMSNorm as the Hugging Face decoders define it: normalise in fp32, cast back, scale by the weight.

``y = weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``. :func:`rms_norm` is torch's ``F.rms_norm`` on the
fp32 input, bit-identical to transformers' ``Qwen3RMSNorm`` / ``LlamaRMSNorm`` on CPU (checked in the tests);
:func:`npu_rms_norm` is ``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``, a fused kernel that keeps
the input dtype (its rounding differs from the fp32 formula by the last bits of a bf16 result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (torch)."""
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (Ascend fused kernel)."""
    import torch_npu

    out: torch.Tensor = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    return out
