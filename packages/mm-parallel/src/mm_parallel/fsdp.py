"""FSDP2 (``fully_shard``) over an explicit mesh: FSDP, HSDP and DDP from one code path.

- 1-D mesh ``(dp_shard,)``: parameters sharded over every rank (FSDP, ZeRO-3).
- 2-D mesh ``(dp_replicate, dp_shard)``: sharded inside each replica group, all-reduced across groups
  (HSDP). With ``dp_shard == 1`` this is plain data parallelism (DDP): whole fp32 parameters on every rank,
  gradients all-reduced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)


def mixed_precision_policy(
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
) -> MixedPrecisionPolicy:
    """A :class:`MixedPrecisionPolicy`; a dtype equal to fp32 master weights becomes ``None`` (no cast)."""

    def _norm(d: torch.dtype | None) -> torch.dtype | None:
        return None if d in (None, torch.float32) else d

    return MixedPrecisionPolicy(
        param_dtype=_norm(param_dtype),
        reduce_dtype=reduce_dtype if _norm(param_dtype) is not None else _norm(reduce_dtype),
        output_dtype=_norm(output_dtype),
        cast_forward_inputs=cast_forward_inputs,
    )


#: one FSDP unit: a module, or several sibling modules sharded and gathered together (e.g. a model's final
#: norm and output head)
Unit = nn.Module | Sequence[nn.Module]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    units: Sequence[Unit],
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
    keep_after_forward: Sequence[Unit] = (),
) -> FSDPModule:
    """Shard each unit in ``units`` as its own FSDP unit (in the given order), then the root ``model``.

    A unit is a submodule of ``model`` or a list of them (one ``fully_shard`` call: one all-gather and one
    reduce-scatter for all of them). Nested units are fine (inner ones first). Units in
    ``keep_after_forward`` (the same objects as in ``units``) stay gathered after their forward whatever
    ``reshard_after_forward`` says: the last unit of a forward, whose backward runs right after it. The root
    stays gathered from its forward into the backward (torch's own default for a root): the backward gathers
    it at its start anyway, and where the root's output is not the head's (a model adding an idle tower's
    ``0 ×`` output to the logits on one rank only) a root resharded after forward would be gathered again at
    a different point of each rank's backward — a collective mismatch. Returns the root, which is now an
    :class:`FSDPModule`.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"apply_fsdp expects a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.ndim}-D"
        )
    kwargs: dict[str, Any] = dict(  # one set of options for every unit (fully_shard is overloaded)
        mesh=mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        # pinned host memory needs an accelerator; on a CPU mesh the shards are plain host tensors already
        offload_policy=(
            CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
        ),
        ignored_params=ignored_params,
    )
    owned = {id(m) for m in model.modules()}
    kept = {id(u) for u in keep_after_forward}
    for unit in units:
        members = [unit] if isinstance(unit, nn.Module) else list(unit)
        for member in members:
            if id(member) not in owned:
                raise ValueError(f"FSDP unit {type(member).__name__} is not a submodule of the model")
        if any(member is model for member in members):
            continue
        reshard = reshard_after_forward and id(unit) not in kept
        fully_shard(members[0] if len(members) == 1 else members, reshard_after_forward=reshard, **kwargs)
    # the same object, its class now also an FSDPModule
    return fully_shard(model, reshard_after_forward=False, **kwargs)
