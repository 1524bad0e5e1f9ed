"""Move a collated batch to the device by the rule users know from MindSpeed-MM."""

from __future__ import annotations

from typing import Any

import torch

from mm_core.errors import DataError

_PLAIN = (int, float, bool, str, type(None))


def _move(t: torch.Tensor, device: torch.device, float_dtype: torch.dtype | None) -> torch.Tensor:
    if t.is_floating_point() and float_dtype is not None:
        return t.to(device=device, dtype=float_dtype, non_blocking=True)
    return t.to(device=device, non_blocking=True)


def move_to_device(
    batch: dict[str, Any], device: torch.device, float_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Top-level tensors, lists/tuples of tensors, plain values and None move; floating tensors take
    ``float_dtype`` (the FSDP ``param_dtype``) and integer tensors stay integer. Anything nested deeper is
    the collator's or the model's to handle, and an unsupported value is a :class:`DataError`."""
    if not isinstance(batch, dict):
        raise DataError(f"the collator returned a {type(batch).__name__}; a batch must be a dict of fields")
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = _move(value, device, float_dtype)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            out[key] = type(value)(_move(v, device, float_dtype) for v in value)
        elif isinstance(value, _PLAIN) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value)
        ):
            out[key] = value
        else:
            raise DataError(
                f"batch field {key!r} is a {type(value).__name__}, which mm cannot move to the device; "
                "collators must return top-level tensors, lists of tensors, plain values or None "
                "(move nested structures inside the model's forward)"
            )
    return out
