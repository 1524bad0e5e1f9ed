"""Random initialisation whose values depend on the seed and the parameter's name, not on how the model is
sharded, built or initialised in which order.

A model built on the meta device and sharded (FSDP2, expert parallel) is initialised shard by shard. Drawn
naively, each rank's random numbers depend on its shard's shape and on what was drawn before, so the same
seed gives another model on 1, 2 or 64 ranks (torch's DTensor random tracker solves this for CUDA only).
Under :class:`SeededInit` every in-place random operation on a parameter (``normal_``, ``uniform_`` and the
other ``aten`` random fills, hence ``nn.init.*`` and transformers' initialisers) is drawn as if on the whole
parameter:

- the parameter's rows (dim 0) are cut into fixed chunks of at most :data:`CHUNK_ELEMENTS` elements (at
  least one row each); chunk ``c`` of the ``k``-th random fill of parameter ``name`` is drawn whole, on the
  parameter's device, from a generator seeded with a hash of ``(seed, name, k, c)``;
- each rank draws only the chunks that overlap its shard and copies in the overlap (its offsets come from
  the DTensor's chunk list, as distributed checkpoints read them).

So a parameter's initial values are a function of ``(seed, name, shape, init)``: equal on every layout, in
any order of initialisation (expert-parallel adapters initialised after the rest of the model get the values
transformers' pass would have given the fused experts), and on 1 rank without sharding. Random fills of
plain tensors (temporaries an initialiser copies into a parameter) pass through to the global generator,
whose state is the same on every rank. A sharded temporary (``torch.nn.init.trunc_normal_`` draws into an
``empty_like`` of the parameter) is drawn whole like a parameter, named by its rank among such temporaries:
the initialisation makes them in the same order on every layout. Values depend on the device type (the CPU
and CUDA generators differ), as any seeded draw does.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

#: the most elements drawn at once for one parameter (64 MiB of fp32); a single larger row is drawn whole
CHUNK_ELEMENTS = 1 << 24

_aten = torch.ops.aten
#: in-place random fills, whose first argument is the tensor filled and which take ``generator=``
RANDOM_FILLS = frozenset(
    {
        _aten.normal_.default,
        _aten.uniform_.default,
        _aten.bernoulli_.float,
        _aten.bernoulli_.Tensor,
        _aten.exponential_.default,
        _aten.geometric_.default,
        _aten.log_normal_.default,
        _aten.cauchy_.default,
        _aten.random_.default,
        getattr(_aten.random_, "from"),
        _aten.random_.to,
    }
)


@dataclass
class _Param:
    """One parameter as the seeded draws see it: its name, whole shape, this rank's block of it (offsets
    and sizes per dim) and its local tensor, and how many random fills it has had."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: torch.Tensor
    fills: int = 0


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor of ``tensor`` (this rank's shard of a DTensor, else itself) and its offsets and sizes
    in the whole tensor."""
    if isinstance(tensor, DTensor):
        chunks = tensor.__create_chunk_list__()  # type: ignore[no-untyped-call]
        if len(chunks) != 1:
            raise ValueError(f"a DTensor with {len(chunks)} local chunks is not supported")
        return tensor.to_local(), tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return tensor, (0,) * tensor.dim(), tuple(tensor.shape)


def _key(t: torch.Tensor) -> tuple[int, int, torch.device]:
    return (t.data_ptr(), t.numel(), t.device)


def chunk_seed(seed: int, name: str, fill: int, chunk: int) -> int:
    """The generator seed of one chunk of one random fill of parameter ``name``."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{fill}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SeededInit(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Within this mode, random fills of the given parameters are drawn as described in the module
    docstring. ``named_tensors``: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], seed: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seed = seed
        self._params: dict[tuple[int, int, torch.device], _Param] = {}
        self._temporaries = 0
        for name, tensor in named_tensors:
            local, offsets, sizes = local_block(tensor)
            if local.numel() == 0:
                continue  # nothing of it on this rank
            key = _key(local)
            self._params.setdefault(key, _Param(name, tuple(tensor.shape), offsets, sizes, local))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in RANDOM_FILLS:
            return func(*args, **kwargs)
        target = args[0]
        local = target.to_local() if isinstance(target, DTensor) else target
        param = self._params.get(_key(local)) if local.numel() else None
        if param is None:
            if not isinstance(target, DTensor):
                return func(*args, **kwargs)
            # a sharded temporary: drawn whole, named by its place among the temporaries
            _, offsets, sizes = local_block(target)
            param = _Param(f"\0temporary {self._temporaries}", tuple(target.shape), offsets, sizes, local)
            self._temporaries += 1
            if not local.numel():
                return target
        self._fill(param, func, args[1:], kwargs)
        param.fills += 1
        return target

    def _fill(self, param: _Param, func: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shape, local = param.shape, param.local
        if not shape:  # a 0-dim parameter: one chunk
            whole = torch.empty((), dtype=local.dtype, device=local.device)
            self._draw(func, whole, rest, kwargs, param, 0)
            local.copy_(whole)
            return
        row = math.prod(shape[1:])
        rows_per_chunk = max(1, CHUNK_ELEMENTS // max(row, 1))
        first, count = param.offsets[0], param.sizes[0]
        inner = tuple(slice(o, o + s) for o, s in zip(param.offsets[1:], param.sizes[1:]))
        for chunk in range(first // rows_per_chunk, -(-(first + count) // rows_per_chunk)):
            lo, hi = chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, shape[0])
            whole = torch.empty((hi - lo, *shape[1:]), dtype=local.dtype, device=local.device)
            self._draw(func, whole, rest, kwargs, param, chunk)
            a, b = max(lo, first), min(hi, first + count)
            local[a - first : b - first].copy_(whole[(slice(a - lo, b - lo),) + inner])

    def _draw(
        self,
        func: Any,
        whole: torch.Tensor,
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        param: _Param,
        chunk: int,
    ) -> None:
        generator = torch.Generator(device=whole.device)
        generator.manual_seed(chunk_seed(self.seed, param.name, param.fills, chunk))
        func(whole, *rest, **{**kwargs, "generator": generator})
