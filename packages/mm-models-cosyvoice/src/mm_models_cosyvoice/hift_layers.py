"""Building blocks of the HiFT vocoder and its discriminators: causal convolutions, weight norm, Snake.

**Causal convolutions.** CosyVoice3's vocoder streams, so every convolution of the generator sees the past
(zeros padded on the left) or a fixed look-ahead (zeros padded on the right), never a centred window; the
output keeps the input's length. Each is an ``nn.Conv1d`` subclass, so its tensors keep the official names
(``ups.0.parametrizations.weight.original1``, not ``ups.0.conv....``).

**Weight norm.** The official weights were trained with torch's parametrized weight norm
(``torch.nn.utils.parametrizations.weight_norm``, ``dim=0``): a layer stores the magnitude ``g``
(``parametrizations.weight.original0``, ``[out, 1, ...]``) and the direction ``v`` (``original1``, the
weight's shape) and computes ``weight = g · v / ‖v‖`` per output channel. Older checkpoints name them
``weight_g`` / ``weight_v``, and an export with the weight norm removed holds the plain ``weight``:
:func:`remap_weight_norm` turns either into this module's names. A parametrized layer's ``weight`` is
recomputed at every access, so initialising it in place does nothing: :func:`reset_weight_norm` initialises
``v`` (as ``nn.Conv1d`` initialises its weight) and sets ``g = ‖v‖`` (then ``weight = v``, as right after
``weight_norm`` is applied to a fresh layer). It works on FSDP-sharded parameters too: ``g`` and ``v`` are
split over the same output channels (dim 0), so each rank computes the norms of its own rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

#: zeros before the signal (the output at t sees inputs <= t) or after it (a look-ahead)
LEFT, RIGHT = "left", "right"
#: key parts of a parametrized weight norm, and of the legacy one
_G, _V = "parametrizations.weight.original0", "parametrizations.weight.original1"
_LEGACY_G, _LEGACY_V = "weight_g", "weight_v"

M = TypeVar("M", bound=nn.Module)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP-sharded parameter (a DTensor), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class CausalConv1d(nn.Conv1d):
    """``Conv1d`` (stride 1) padded with ``(k - 1) · dilation`` zeros on the left (``causal_type: left``)
    or on the right (``right``: a look-ahead of that many steps); the output has the input's length."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        dilation: int = 1,
        causal_type: str = LEFT,
        bias: bool = True,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation, bias=bias)
        if causal_type not in (LEFT, RIGHT):
            raise ValueError(f"causal_type: got {causal_type!r}; accepted: {LEFT}, {RIGHT}")
        amount = (kernel_size - 1) * dilation
        self.causal_pad = (amount, 0) if causal_type == LEFT else (0, amount)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, self.causal_pad))


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest-neighbour upsampling by ``scale``, then a causal ``Conv1d(k)`` (left-padded ``k - 1``): the
    vocoder's upsampling layers (a ``Conv1d`` weight ``[out, in, k]``, not a transposed convolution)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, scale: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=float(self.scale), mode="nearest")
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalConv1dDownSample(nn.Conv1d):
    """A strided ``Conv1d(k, stride s)`` left-padded with ``s - 1`` zeros (the source branch's
    downsampling from the STFT frame rate to each upsampling stage's rate)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class Snake(nn.Module):
    """``x + sin²(α·x) / (α + 1e-9)`` per channel, ``α`` (``alpha`` [C]) learned, linear scale, init 1."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.view(1, -1, 1)
        return x + torch.sin(alpha * x).pow(2) / (alpha + 1e-9)


def weight_normed(module: M) -> M:
    """``module`` with torch's parametrized weight norm on ``weight`` (dim 0): the official layout."""
    weight_norm(module, name="weight", dim=0)
    return module


def is_weight_normed(module: nn.Module) -> bool:
    parametrizations = getattr(module, "parametrizations", None)
    return parametrizations is not None and "weight" in parametrizations


@torch.no_grad()
def reset_weight_norm(module: nn.Module) -> None:
    """Initialise a weight-normed convolution as torch initialises the plain layer (Kaiming-uniform ``v``,
    uniform bias), then ``g = ‖v‖`` per output channel, so ``weight == v`` (module docstring)."""
    original: Any = module.parametrizations.weight  # type: ignore[union-attr]
    g, v = original.original0, original.original1
    nn.init.kaiming_uniform_(v, a=math.sqrt(5))
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        fan_in = v.shape[1] * math.prod(v.shape[2:])
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound)
    v_local = _local(v)
    dims = tuple(range(1, v_local.dim()))
    _local(g).copy_(torch.linalg.vector_norm(v_local, dim=dims, keepdim=True))


@torch.no_grad()
def reset_parameters(root: nn.Module) -> None:
    """Initialise every parameter under ``root``: weight-normed layers by :func:`reset_weight_norm`, Snake
    ``alpha`` to 1, any other layer by its own ``reset_parameters()``."""
    for module in root.modules():
        if is_weight_normed(module):
            reset_weight_norm(module)
        elif isinstance(module, Snake):
            module.alpha.fill_(1.0)
        elif module is not root:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def remap_weight_norm(state: Mapping[str, torch.Tensor], expected: Sequence[str]) -> dict[str, torch.Tensor]:
    """``state`` with weight-norm tensors renamed to the names in ``expected`` (module docstring): legacy
    ``<m>.weight_g`` / ``<m>.weight_v`` become ``<m>.parametrizations.weight.original0`` / ``original1`` and
    back, and a plain ``<m>.weight`` of a layer that ``expected`` weight-norms becomes ``g = ‖w‖``, ``v = w``.
    Any other name is kept as it is (the caller reports what is still missing or unexpected)."""
    wanted = set(expected)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in wanted:
            out[key] = value
            continue
        base, _, leaf = key.rpartition(".")
        prefix = f"{base}." if base else ""
        if leaf in (_LEGACY_G, _LEGACY_V) and f"{prefix}{_G}" in wanted:
            out[f"{prefix}{_G if leaf == _LEGACY_G else _V}"] = value
        elif key.endswith(_G) and key[: -len(_G)] + _LEGACY_G in wanted:
            out[key[: -len(_G)] + _LEGACY_G] = value
        elif key.endswith(_V) and key[: -len(_V)] + _LEGACY_V in wanted:
            out[key[: -len(_V)] + _LEGACY_V] = value
        elif leaf == "weight" and f"{prefix}{_G}" in wanted:
            dims = tuple(range(1, value.dim()))
            out[f"{prefix}{_G}"] = torch.linalg.vector_norm(value.float(), dim=dims, keepdim=True).to(value)
            out[f"{prefix}{_V}"] = value
        else:
            out[key] = value
    return out
