"""Activation checkpointing (recompute) on chosen modules: full, or selective (keep chosen ops' outputs).

Uses PyTorch's composable, non-reentrant ``checkpoint`` (module hooks, so parameter names do not change and
it composes with ``fully_shard``: apply it *before* sharding). The selective mode passes a policy built with
:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`: the outputs of the listed ops are saved
in forward, everything else inside the module is recomputed in backward.

Values a forward reads on the host (:func:`read_once`: the split sizes of an expert all-to-all) are read once:
inside a checkpointed module the recomputed forward takes the values its first run read instead of reading
them again, so a recompute adds no host sync to the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from contextvars import ContextVar, Token
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


class _Tape:
    """The host values one checkpointed forward read, in order (see :func:`read_once`)."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.replaying = False
        self.position = 0


# The tape of the checkpointed forward running on this thread, set only inside the context managers below
# (a forward is recomputed on the thread that runs its backward, which enters the recompute context itself).
_TAPE: ContextVar[_Tape | None] = ContextVar("mm_parallel_recompute_tape", default=None)


class _TapeContext:
    """Makes ``tape`` the current one: recording (the checkpointed forward) or replaying (its recomputation,
    from the first value; re-entrant, a retained graph recomputes again)."""

    def __init__(self, tape: _Tape, replaying: bool) -> None:
        self.tape, self.replaying = tape, replaying
        self._tokens: list[Token[_Tape | None]] = []

    def __enter__(self) -> None:
        self.tape.replaying, self.tape.position = self.replaying, 0
        self._tokens.append(_TAPE.set(self.tape))

    def __exit__(self, *exc: object) -> None:
        _TAPE.reset(self._tokens.pop())


class _Both:
    """Two context managers entered as one (re-entrant when both are)."""

    def __init__(self, first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> None:
        self.first, self.second = first, second
        self._stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        stack = ExitStack()
        stack.enter_context(self.first)
        stack.enter_context(self.second)
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().__exit__(*exc)


def read_once(tensor: torch.Tensor) -> Any:
    """``tensor.tolist()`` (one host sync), read once per forward: in a module checkpointed by
    :func:`apply_recompute`, the recomputed forward gets the values the first forward read, in the same
    order, without a sync. The recomputation repeats the forward exactly, so the values are the same."""
    tape = _TAPE.get()
    if tape is None:
        return tensor.tolist()
    if not tape.replaying:
        value = tensor.tolist()
        tape.values.append(value)
        return value
    if tape.position >= len(tape.values):
        raise RuntimeError(
            f"a recomputed forward read host value {tape.position + 1}, but its first run read only "
            f"{len(tape.values)}; a checkpointed forward must read the same host values when recomputed"
        )
    value = tape.values[tape.position]
    tape.position += 1
    return value


def tape_contexts(
    inner: Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]] | None = None,
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """A ``context_fn`` for non-reentrant checkpointing: the forward records what :func:`read_once` reads,
    its recomputation replays it; ``inner`` (e.g. selective-checkpoint contexts) is entered as well."""
    tape = _Tape()
    first, again = inner() if inner is not None else (nullcontext(), nullcontext())
    return _Both(first, _TapeContext(tape, False)), _Both(again, _TapeContext(tape, True))


def apply_recompute(
    modules: Iterable[nn.Module],
    *,
    save_ops: Sequence[torch._ops.OpOverload] | None = None,
    preserve_rng_state: bool = True,
) -> int:
    """Checkpoint each module's forward (non-reentrant). With ``save_ops`` the checkpoint is selective.
    Host values read with :func:`read_once` inside a module are not read again when it is recomputed.

    Nested modules: only the outermost of the given modules is checkpointed (checkpointing inside a
    checkpointed region saves nothing). Call before ``fully_shard``. Returns how many modules were
    checkpointed.
    """
    modules = list(modules)
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    inner = None
    if save_ops:
        inner = functools.partial(create_selective_checkpoint_contexts, selective_policy(save_ops))
    context_fn = functools.partial(tape_contexts, inner)
    count = 0
    for module in modules:
        if id(module) in inside:
            continue
        checkpoint(module, preserve_rng_state=preserve_rng_state, context_fn=context_fn)
        count += 1
    return count
