"""Losses normalised so that every parallel layout trains what one process would.

For ``per_token_loss`` (the default) each rank returns ``sum of its token losses * grad_scale / global
label tokens``; FSDP's gradient averaging over ``grad_scale`` ranks then yields the gradient of the global
token mean. ``per_sample_loss`` does the same with samples. ``raw`` uses the model's own ``.loss``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the label of positions that do not count; the one definition (data plugins import it from here)
IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with inputs (Hugging Face convention) -> the target of each position."""
    pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross entropy in fp32, zero where ``targets`` is ignored; shape of ``targets``."""
    flat = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return flat.view(targets.shape)


def count_units(targets: torch.Tensor, loss_type: str) -> torch.Tensor:
    """How many units (label tokens, or samples with any label) this micro-batch contributes."""
    valid = targets != IGNORE_INDEX
    if loss_type == "per_sample_loss":
        return valid.any(dim=-1).sum()
    return valid.sum()


def loss_weights(targets: torch.Tensor, loss_type: str) -> torch.Tensor | None:
    """Per-position factors under which the plain sum of token losses is :func:`loss_sum`: None (all 1) over
    tokens; 1 / the sample's label tokens for ``per_sample_loss`` (for losses summed elsewhere, e.g. in
    chunks at the output head)."""
    if loss_type != "per_sample_loss":
        return None
    n = (targets != IGNORE_INDEX).sum(dim=-1, keepdim=True).clamp(min=1)
    return (1.0 / n.to(torch.float32)).expand_as(targets)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The summed loss of a micro-batch: over tokens, or over per-sample token means."""
    losses = token_losses(logits, targets)
    if loss_type == "per_sample_loss":
        n = (targets != IGNORE_INDEX).sum(dim=-1)
        return (losses.sum(dim=-1) / n.clamp(min=1)).sum()
    return losses.sum()


def loss_sum_and_rows(
    logits: torch.Tensor, targets: torch.Tensor, loss_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`loss_sum` (the same operations, so the same value to the bit) and each row's part of it
    (``[batch]``, detached): a row's token loss sum, or its per-sample mean for ``per_sample_loss``."""
    losses = token_losses(logits, targets)
    if loss_type == "per_sample_loss":
        n = (targets != IGNORE_INDEX).sum(dim=-1)
        rows = losses.sum(dim=-1) / n.clamp(min=1)
        return rows.sum(), rows.detach()
    return losses.sum(), losses.detach().sum(dim=-1)


def row_units(targets: torch.Tensor, loss_type: str) -> torch.Tensor:
    """Each row's loss units (``[batch]``): its label tokens, or 1 for a row with any label
    (``per_sample_loss``); they add up to :func:`count_units`."""
    valid = targets != IGNORE_INDEX
    if loss_type == "per_sample_loss":
        return valid.any(dim=-1).long()
    return valid.sum(dim=-1)
