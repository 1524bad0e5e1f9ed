"""``torch.compile`` per block, in place: each given module's ``forward`` is replaced by its compiled version.

This is torchtitan's per-block compile: one graph per transformer block, shared by every block of the same
shape (dynamo does not recompile per layer). Parameter and module names do not change, and the module hooks
stay *outside* the compiled region, running eagerly as before: FSDP2's (apply ``fully_shard`` after this
function, as torchtitan does), activation offload's and any others. ``module.compile()`` would compile the
hooks too: dynamo would break the graph at each of them.

Activation checkpointing is the exception: a compiled module that is also recomputed is *not* given
:func:`~mm_parallel.memory.apply_recompute`'s hooks; it is named in ``checkpointed`` and its checkpoint goes
*inside* the compiled forward (``torch.utils.checkpoint`` traced by dynamo, as torchtitan does), so the
compiler plans the recompute and a selective policy sees the ops of the graph. As composable hooks around the
compiled call, the backward's recompute would run a differently traced graph whose saved tensors do not match
the forward's. A checkpoint traced by dynamo refuses Python side effects inside it unless
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is on, and a refusal makes dynamo run
the whole forward eagerly: transformers (from 5.25, through the ``kernels`` package) sets a context variable
in every attention forward and resets it before returning, so the checkpointed forwards are traced with that
option (a side effect undone within the forward needs no replay in backward).

A compile that captures nothing is an error, not a silent eager run: the graphs dynamo hands to the backend
are counted, and a compiled module whose first call ends with none counted raises :class:`CompileError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from mm_parallel.memory.recompute import selective_policy


class CompileError(RuntimeError):
    """``torch.compile`` failed on a module; the message names the module (the cause is chained)."""


def _traced_checkpoint(
    forward: Callable[..., Any], save_ops: Sequence[torch._ops.OpOverload] | None, preserve_rng_state: bool
) -> Callable[..., Any]:
    """``forward`` under non-reentrant ``torch.utils.checkpoint`` (selective with ``save_ops``)."""
    context: dict[str, Any] = {}
    if save_ops:
        context["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, selective_policy(save_ops)
        )

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(
            forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **context, **kwargs
        )

    return checkpointed_forward


class _GraphCounter:
    """A ``torch.compile`` backend that counts the graphs dynamo captures and hands them to ``backend``."""

    def __init__(self, backend: str | Callable[..., Any]) -> None:
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        self.graphs += 1
        return self.backend(graph, example_inputs, **kwargs)


def _reporting(
    compiled: Callable[..., Any],
    name: str,
    module: nn.Module,
    hint: str,
    counter: _GraphCounter,
    checkpointed: bool,
) -> Callable[..., Any]:
    """``compiled``, with dynamo's and inductor's errors raised again as :class:`CompileError`, and a first
    call that captured no graph refused."""
    what = f"{name or '(root)'} ({type(module).__name__})"
    first_call = [True]

    def fail(verb: str, detail: str) -> CompileError:
        return CompileError(f"torch.compile {verb} on {what}{detail}" + (f"; {hint}" if hint else ""))

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        try:
            with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointed):
                out = compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            cause = getattr(exc, "inner_exception", None) or exc  # a backend's (inductor's) own error
            first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
            raise fail("failed", f": {type(cause).__name__}: {first}") from exc
        if first_call[0]:
            first_call[0] = False
            if not counter.graphs:
                raise fail(
                    "captured no graph",
                    " (dynamo ran its whole forward eagerly; TORCH_LOGS=graph_breaks shows why)",
                )
        return out

    return compiled_forward


def compile_modules(
    modules: Iterable[tuple[str, nn.Module]],
    *,
    checkpointed: Collection[str] = (),
    save_ops: Sequence[torch._ops.OpOverload] | None = None,
    preserve_rng_state: bool = True,
    error_hint: str = "",
    **compile_kwargs: Any,
) -> list[str]:
    """Compile each ``(name, module)``'s ``forward`` in place with ``torch.compile(**compile_kwargs)``.

    Call before ``fully_shard``. The modules named in ``checkpointed`` are recomputed in backward by a
    checkpoint inside their compiled forward (selective with ``save_ops``; None: full recompute); give them no
    :func:`~mm_parallel.memory.apply_recompute` hooks, and no recomputed module inside a compiled one (its
    hooks would break the graph). Compilation happens at the first call; a failure then raises
    :class:`CompileError` naming the module, with ``error_hint`` appended, and so does a first call after
    which no graph of these modules reached the backend (``backend`` in ``compile_kwargs``: a registered name
    or a callable, default inductor; ``mode`` and ``options`` are not accepted, as with any callable backend).
    Returns the names of the compiled modules.
    """
    counter = _GraphCounter(compile_kwargs.pop("backend", "inductor"))
    done = []
    for name, module in modules:
        forward = module.forward
        if name in checkpointed:
            forward = _traced_checkpoint(forward, save_ops, preserve_rng_state)
        compiled = torch.compile(forward, backend=counter, **compile_kwargs)
        module.forward = _reporting(compiled, name, module, error_hint, counter, name in checkpointed)
        done.append(name)
    return done
