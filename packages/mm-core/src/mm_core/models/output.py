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

from torch import nn
from torch.utils.hooks import RemovableHandle

from mm_core.errors import ConfigError


def as_mapping(output: Any, model_name: str = "the model") -> Mapping[str, Any]:
    """``output`` as a mapping of its fields (a ``ModelOutput`` or a dict is returned as it is)."""
    if isinstance(output, Mapping):
        return output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    if isinstance(output, (tuple, list)) or not hasattr(output, "__dict__"):
        raise ConfigError(
            f"model: the forward of {model_name} returned a {type(output).__name__}; mm needs an object with "
            "a .loss attribute (and .logits unless model.loss_cfg.loss_type is raw), e.g. a transformers "
            "ModelOutput, a dataclass, types.SimpleNamespace(loss=..., logits=...) or a dict"
        )
    return dict(vars(output))


def output_field(output: Any, name: str) -> Any:
    """The field ``name`` of a (normalised) forward output, or None when it has none."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def normalize_outputs(model: nn.Module) -> RemovableHandle:
    """Register (before ``fully_shard``) a forward hook on ``model`` that returns its output as a mapping."""
    name = type(model).__name__

    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return as_mapping(output, name)

    return model.register_forward_hook(hook)
