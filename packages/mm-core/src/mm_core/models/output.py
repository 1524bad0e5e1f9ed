"""What a model's forward returns, as mm reads it: any object with ``.loss`` (and ``.logits``).

The model contract allows a transformers ``ModelOutput``, a dataclass, a ``types.SimpleNamespace``, a plain
object with attributes, or a dict with a ``"loss"`` key. FSDP2 finds the output tensors it must hook for
backward (to all-gather the root unit's parameters again, and to reduce-scatter their gradients) by walking
the output as a pytree; a namespace or a plain dataclass is opaque to that walk, so the root's parameters
would be missing in backward. :func:`normalize_outputs` registers a forward hook, before ``fully_shard``
adds its own, that turns such outputs into a dict, which every consumer reads with :func:`output_field`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def as_mapping(output: Any) -> Any:
    """``output`` with an opaque object (a plain dataclass, a namespace, an object with attributes) turned
    into a dict of its fields; what FSDP2's pytree walk already sees through (a tensor, a tuple, a list, a
    mapping such as a ``ModelOutput``) and values with no fields are returned as they are."""
    if isinstance(output, (torch.Tensor, Mapping, tuple, list)):
        return output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    if hasattr(output, "__dict__"):
        return dict(vars(output))
    return output


def output_field(output: Any, name: str) -> Any:
    """The field ``name`` of a (normalised) forward output, or None when it has none."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def normalize_outputs(model: nn.Module) -> RemovableHandle:
    """Register (before ``fully_shard``) a forward hook on ``model`` that returns its output as a mapping."""

    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return as_mapping(output)

    return model.register_forward_hook(hook)
