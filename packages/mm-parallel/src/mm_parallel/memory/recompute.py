"""Activation checkpointing (recompute) on chosen modules: full, or selective (keep chosen ops' outputs).

Uses PyTorch's composable, non-reentrant ``checkpoint`` (module hooks, so parameter names do not change and
it composes with ``fully_shard``: apply it *before* sharding). The selective mode passes a policy built with
:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`: the outputs of the listed ops are saved
in forward, everything else inside the module is recomputed in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _ops(*names: str) -> list[torch._ops.OpOverload]:
    """The default overloads of the aten ops that exist in this torch build."""
    out = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            out.append(packet.default)
    return out


# Friendly names for groups of ops; any ``aten.<op>`` (or ``aten.<op>.<overload>``) is accepted as well.
OP_GROUPS: dict[str, list[str]] = {
    "attention": [
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    ],
    "matmul": ["mm", "bmm", "addmm"],
}


def resolve_ops(names: Iterable[str]) -> list[torch._ops.OpOverload]:
    """Turn ``attention``/``matmul`` or ``aten.mm``/``aten.addmm.default`` into op overloads.

    Raises ``ValueError`` naming the unknown entry and what is accepted.
    """
    out: list[torch._ops.OpOverload] = []
    for name in names:
        if name in OP_GROUPS:
            out += _ops(*OP_GROUPS[name])
            continue
        parts = name.split(".")
        if len(parts) in (2, 3) and parts[0] == "aten":
            packet = getattr(_aten, parts[1], None)
            overload = getattr(packet, parts[2] if len(parts) == 3 else "default", None) if packet else None
            if overload is not None:
                out.append(overload)
                continue
        raise ValueError(
            f"unknown op {name!r}; accepted: {', '.join(sorted(OP_GROUPS))} or an aten op such as "
            "'aten.mm' / 'aten.addmm.default'"
        )
    return list(dict.fromkeys(out))


def selective_policy(save_ops: Sequence[torch._ops.OpOverload]) -> Callable[..., CheckpointPolicy]:
    """A policy function: save the outputs of ``save_ops``, prefer recomputing everything else."""
    keep = frozenset(save_ops)

    def policy(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_recompute(
    modules: Iterable[nn.Module],
    *,
    save_ops: Sequence[torch._ops.OpOverload] | None = None,
    preserve_rng_state: bool = True,
) -> int:
    """Checkpoint each module's forward (non-reentrant). With ``save_ops`` the checkpoint is selective.

    Nested modules: only the outermost of the given modules is checkpointed (checkpointing inside a
    checkpointed region saves nothing). Call before ``fully_shard``. Returns how many modules were
    checkpointed.
    """
    modules = list(modules)
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    context_fn = None
    if save_ops:
        context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy(save_ops))
    count = 0
    for module in modules:
        if id(module) in inside:
            continue
        kwargs: dict[str, Any] = {"preserve_rng_state": preserve_rng_state}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        checkpoint(module, **kwargs)
        count += 1
    return count
