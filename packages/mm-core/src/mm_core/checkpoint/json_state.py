"""Keep pickle out of checkpoints: tensors stay tensors, every other value becomes JSON in a uint8 tensor.

DCP writes any non-tensor value of a state dict with ``torch.save`` and reads it back with ``torch.load``
with ``weights_only=False`` — a pickle. Optimizer ``param_groups`` (learning rates, betas, names) and
LR-scheduler state are such values. :class:`JsonTensorState` wraps a ``Stateful`` so that DCP only ever sees
tensors: the tensor leaves (sharded DTensors included, so they still reshard) and one ``json`` tensor holding
the rest of the structure.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from mm_core.errors import CheckpointError

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


def json_tensor(obj: Any) -> torch.Tensor:
    """``obj`` as UTF-8 JSON bytes in a 1-D uint8 tensor."""
    data = json.dumps(obj, sort_keys=True).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def from_json_tensor(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode("utf-8"))


def split(
    obj: Any, path: str = "", tensors: dict[str, torch.Tensor] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor leaf of ``obj`` by a reference and collect the tensors by path.

    Returns ``(skeleton, tensors)``: the skeleton is JSON-serialisable (tuples and dicts with non-string
    keys are tagged so that :func:`merge` rebuilds them exactly)."""
    tensors = {} if tensors is None else tensors
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {_TENSOR: path}, tensors
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: split(v, f"{path}/{k}", tensors)[0] for k, v in obj.items()}, tensors
        items = [
            [split(k, f"{path}/k{i}", tensors)[0], split(v, f"{path}/{i}", tensors)[0]]
            for i, (k, v) in enumerate(obj.items())
        ]
        return {_ITEMS: items}, tensors
    if isinstance(obj, (list, tuple)):
        out = [split(v, f"{path}/{i}", tensors)[0] for i, v in enumerate(obj)]
        return ({_TUPLE: out} if isinstance(obj, tuple) else out), tensors
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, tensors
    raise CheckpointError(
        f"checkpoint: the value at {path or '/'} is a {type(obj).__name__}; a checkpoint holds tensors and "
        "plain values (numbers, strings, lists, dicts) only, never pickled objects"
    )


def merge(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split`."""
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if _TUPLE in skeleton:
            return tuple(merge(v, tensors) for v in skeleton[_TUPLE])
        if _ITEMS in skeleton:
            return {merge(k, tensors): merge(v, tensors) for k, v in skeleton[_ITEMS]}
        return {k: merge(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [merge(v, tensors) for v in skeleton]
    return skeleton


class JsonTensorState:
    """A DCP ``Stateful`` around another: its tensors under ``tensors/...``, the rest as a ``json`` tensor.

    Loading needs the stored JSON length up front (DCP fills tensors of known size): :func:`load_checkpoint`
    sets ``json_size`` from the checkpoint's metadata before ``dcp.load``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.json_size: int | None = None

    def state_dict(self) -> dict[str, Any]:
        skeleton, tensors = split(self.inner.state_dict())
        if self.json_size is None:
            return {"json": json_tensor(skeleton), "tensors": tensors}
        return {"json": torch.zeros(self.json_size, dtype=torch.uint8), "tensors": tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.json_size = None
        try:
            restored = merge(from_json_tensor(state["json"]), state.get("tensors", {}))
        except KeyError as exc:
            raise CheckpointError(
                f"checkpoint: the stored state of {type(self.inner).__name__} has a tensor at {exc.args[0]} "
                "that this run does not have (a different model or optimizer?)"
            ) from None
        self.inner.load_state_dict(restored)
