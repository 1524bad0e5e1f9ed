"""Validation helpers for the free-form dicts a plugin reads (``basic_parameters``, ``preprocess_parameters``,
``collate_param``): typed keys, defaults, and errors naming the full dotted key with a "did you mean"."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mm_core.errors import ConfigError

BASIC = "data.dataset_param.basic_parameters"
PREPROCESS = "data.dataset_param.preprocess_parameters"
COLLATE = "data.dataloader_param.collate_param"

_REQUIRED = object()


@dataclass(frozen=True)
class Field:
    """One accepted key: ``check(value)`` returns True when the value is acceptable."""

    expected: str
    check: Callable[[Any], bool]
    default: Any = _REQUIRED


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(default: Any = _REQUIRED) -> Field:
    return Field("a positive integer", lambda v: _is_int(v) and v > 0, default)


def optional_positive_int(default: Any = None) -> Field:
    return Field("a positive integer or null", lambda v: v is None or (_is_int(v) and v > 0), default)


def boolean(default: Any = _REQUIRED) -> Field:
    return Field("true or false", lambda v: isinstance(v, bool), default)


def string(default: Any = _REQUIRED) -> Field:
    return Field("a non-empty string", lambda v: isinstance(v, str) and v != "", default)


def optional_string(default: Any = None) -> Field:
    return Field("a string or null", lambda v: v is None or isinstance(v, str), default)


def choice(options: tuple[str, ...], default: Any = _REQUIRED) -> Field:
    return Field("one of " + ", ".join(options), lambda v: v in options, default)


def paths(default: Any = _REQUIRED) -> Field:
    def ok(v: Any) -> bool:
        if isinstance(v, str):
            return v != ""
        return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(x, str) and x for x in v)

    return Field("a path or a non-empty list of paths", ok, default)


def _is_weight(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def optional_weights(default: Any = None) -> Field:
    """Mixing weights, one per entry of ``basic_parameters.dataset`` (checked against that count by
    :func:`check_weights` once the entries are known)."""
    return Field(
        "a list of positive numbers or null",
        lambda v: (
            v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_weight(x) for x in v))
        ),
        default,
    )


def check_weights(weights: Sequence[float] | None, num_sources: int, key: str) -> list[float] | None:
    """The mixing weights as floats, or None for no mixing.

    Raises ConfigError naming ``key`` unless there is exactly one weight per dataset entry
    (``num_sources``) and every weight is a finite number greater than 0."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Iterable):
        raise ConfigError(f"{key}: got {weights!r}; expected a list of positive numbers or null")
    weights = list(weights)
    if len(weights) != num_sources:
        raise ConfigError(
            f"{key}: got {len(weights)} weights for {num_sources} dataset entries; "
            "give one weight per entry of basic_parameters.dataset, in the same order"
        )
    for i, w in enumerate(weights):
        if not _is_weight(w):
            raise ConfigError(f"{key}[{i}]: got {w!r}; expected a finite number greater than 0")
    return [float(w) for w in weights]


def anything(default: Any = None) -> Field:
    return Field("any value", lambda v: True, default)


def read_params(values: Mapping[str, Any] | None, fields: Mapping[str, Field], prefix: str) -> dict[str, Any]:
    """Check ``values`` against ``fields``; return a dict with every field (defaults filled in).

    Raises ConfigError naming the full dotted key for an unknown key (with a "did you mean"), a missing
    required key, or a value of the wrong kind.
    """
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix}: got {values!r}; expected a mapping of keys to values")
    accepted = sorted(fields)
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{prefix}.{key}: unknown key; {hint}accepted keys: {', '.join(accepted)}")
    out: dict[str, Any] = {}
    for key, field in fields.items():
        if key not in values:
            if field.default is _REQUIRED:
                raise ConfigError(f"{prefix}.{key}: missing; expected {field.expected}")
            out[key] = field.default
            continue
        value = values[key]
        if not field.check(value):
            raise ConfigError(f"{prefix}.{key}: got {value!r}; expected {field.expected}")
        out[key] = value
    return out
