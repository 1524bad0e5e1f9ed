"""The output projection and the cross entropy, chunk by chunk: full-vocabulary logits never exist at once.

A causal LM's largest activation is usually its logits: ``tokens x vocabulary`` (151,936 for Qwen) in fp32,
plus their gradient. :func:`linear_cross_entropy` computes ``sum_i w_i * CE(h_i @ W.T + b, t_i)`` over
chunks of ``chunk_size`` positions, and computes the gradients of ``h``, ``W`` and ``b`` in the same pass
(the backward only scales them by the incoming gradient), so the whole loss does the matrix products of the
unfused one (1 forward, 2 backward) while holding one chunk of logits at a time.

:class:`ChunkedLossHead` is the ``nn.Linear`` a model's output head is swapped for: it keeps the head's own
parameters (same objects, so tied embeddings stay tied and state-dict names stay the same) and behaves as
the plain linear layer, except inside :meth:`ChunkedLossHead.computing_loss`, where its one call returns the
summed loss of the targets given instead of the logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ChunkedLossHead", "linear_cross_entropy"]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        weights: torch.Tensor | None,
        chunk_size: int,
        ignore_index: int,
        position_losses: torch.Tensor | None,
    ) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        grad_h = torch.empty_like(hidden) if need_h else None
        # the weight's gradient accumulates over the chunks in fp32 (exact sums for low-precision weights)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            stop = start + chunk_size
            h, t = hidden[start:stop], targets[start:stop]
            logits = F.linear(h, weight, bias).float()
            valid = t != ignore_index
            safe = torch.where(valid, t, 0).unsqueeze(1)
            # log-sum-exp in the logits' own memory (torch.logsumexp takes chunk-sized temporaries): the
            # target's logit first, then exp(logits - max) in place, which the gradient below reuses
            picked = logits.gather(1, safe).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)
            sums = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
            lse = (top + sums.log()).squeeze(1)
            coef = valid.float() if weights is None else torch.where(valid, weights[start:stop].float(), 0.0)
            losses = (lse - picked) * coef
            total += losses.sum()
            if position_losses is not None:
                position_losses[start:stop] = losses
            if not (need_h or need_w or need_b):
                continue
            # d(loss)/d(logits) = coef * (softmax - onehot(target)), built in the logits' memory
            g = logits.div_(sums)  # softmax
            g.scatter_add_(1, safe, -valid.float().unsqueeze(1))
            g.mul_(coef.unsqueeze(1))
            if grad_b is not None:
                grad_b += g.sum(dim=0)
            g = g.to(weight.dtype)
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[start:stop])
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w += torch.mm(g.t(), h)
        ctx.grads = (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None and bias is not None else None,
        )
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice (retain_graph is not supported)")
        grads, ctx.grads = ctx.grads, None
        scaled = tuple(g.mul_(grad_out.to(g.dtype)) if g is not None else None for g in grads)
        return (*scaled, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    position_losses: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_i weights_i * cross_entropy(hidden_i @ weight.T + bias, targets_i)`` in fp32, positions whose
    target is ``ignore_index`` left out, computed ``chunk_size`` positions at a time.

    ``hidden``: ``[..., H]``; ``targets`` (and ``weights``, default 1): the leading shape of ``hidden``.
    Returns a 0-dim fp32 tensor; ``position_losses`` (fp32, the shape of ``targets``), when given, receives
    each position's weighted loss (no gradient; e.g. for losses per sample). The gradients are computed in
    the forward (only when autograd needs them), so a backward must follow at most once."""
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: targets of shape {tuple(targets.shape)} do not match the hidden states "
            f"{tuple(hidden.shape)} (one target per position)"
        )
    if weights is not None and weights.shape != targets.shape:
        raise ValueError(
            f"linear_cross_entropy: weights of shape {tuple(weights.shape)}, targets {tuple(targets.shape)}"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = weights.reshape(-1) if weights is not None else None
    if position_losses is not None and (
        position_losses.shape != targets.shape or position_losses.dtype != torch.float32
    ):
        raise ValueError(
            f"linear_cross_entropy: position_losses must be fp32 of the targets' shape {tuple(targets.shape)}"
        )
    out_losses = position_losses.view(-1) if position_losses is not None else None
    args = (flat, weight, bias, targets.reshape(-1), w, chunk_size, ignore_index, out_losses)
    out: torch.Tensor = _LinearCrossEntropy.apply(*args)  # type: ignore[no-untyped-call]
    return out


class ChunkedLossHead(nn.Linear):
    """An output head that, inside :meth:`computing_loss`, returns the summed chunked cross entropy of the
    targets instead of the logits; elsewhere the plain linear layer. Build it with :meth:`replacing`."""

    chunk_size: int
    ignore_index: int

    @classmethod
    def replacing(cls, linear: nn.Linear, chunk_size: int, ignore_index: int = -100) -> ChunkedLossHead:
        """A head over ``linear``'s own parameters (the same objects: ties and names are kept)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"ChunkedLossHead replaces a plain nn.Linear, not {type(linear).__name__}")
        with torch.device("meta"):
            head = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        head.weight = linear.weight
        head.bias = linear.bias
        head.train(linear.training)
        head.chunk_size = chunk_size
        head.ignore_index = ignore_index
        return head

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.chunk_size = 1024
        self.ignore_index = -100
        self._pending: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        self.calls = 0

    @contextmanager
    def computing_loss(
        self,
        targets: torch.Tensor,
        weights: torch.Tensor | None = None,
        position_losses: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Within this block the head's one call returns the summed loss of ``targets`` (``[batch, seq]``,
        aligned with the head's input positions; ``weights``: per-position factors) as a 0-dim tensor, and
        fills ``position_losses`` (fp32, the targets' shape) when given; :attr:`calls` then counts the calls
        (a model must call its head exactly once)."""
        self._pending, self.calls = (targets, weights, position_losses), 0
        try:
            yield
        finally:
            self._pending = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._pending is None:
            return super().forward(hidden)
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                "the output head was called twice in one forward; the chunked loss needs a model that "
                "projects its hidden states once (set model.loss_cfg.chunked_loss: false)"
            )
        targets, weights, position_losses = self._pending
        return linear_cross_entropy(
            hidden,
            self.weight,
            self.bias,
            targets,
            weights,
            chunk_size=self.chunk_size,
            ignore_index=self.ignore_index,
            position_losses=position_losses,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"
