"""RMSNorm as the Hugging Face decoders define it: normalise in fp32, cast back, scale by the weight.

``y = weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``. :func:`rms_norm` is torch's ``F.rms_norm`` on the
fp32 input, bit-identical to transformers' ``Qwen3RMSNorm`` / ``LlamaRMSNorm`` on CPU (checked in the tests);
:func:`npu_rms_norm` is ``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (Tensor, Tensor)``, whose
documented outputs are ``y`` and the reciprocal RMS ``rstd`` kept for its backward; ``gamma`` must have the
input's dtype and the kernel keeps that dtype (it multiplies before its one rounding, so a bf16 result may
differ from the formula's in the last bit). Where the weight's dtype differs from the input's, the result is
cast to the dtype the formula promotes to, like the torch entry's.
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

    y, _rstd = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)
    out: torch.Tensor = y.to(torch.promote_types(x.dtype, weight.dtype))
    return out
