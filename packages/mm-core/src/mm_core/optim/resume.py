"""Resuming with a changed schedule: the configured values win, each change is announced in one line.

A checkpoint holds the optimizer's param groups (lr, weight decay, betas, ...) and the scheduler's base
learning rates. Loaded as they are, they would silently override the YAML of the resumed run: a run resumed
with ``training.lr: 1e-5`` would go on at the old lr, and a run extended to more ``train_iters`` would use the
old schedule's lr for its first step. mm's policy: every optimizer and schedule setting comes from the
current config; the checkpoint contributes only the state (moments, step counts, the step reached). With an
unchanged config this is bit-exact (the same values are recomputed).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.optim.lr_scheduler import LambdaLR

from mm_core.checkpoint.dcp_io import CONFIG_FILE
from mm_core.config.schema import MMConfig

#: settings under ``training`` that change the optimizer's hyper-parameters or the lr schedule
SCHEDULE_KEYS = (
    "lr",
    "lr_min",
    "lr_warmup_ratio",
    "lr_decay_style",
    "train_iters",
    "train_epochs",
    "lr_scaling_plan",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "muon",
)
_STATE_ONLY = ("params", "lr", "initial_lr")


def _flat(block: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in block.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def schedule_changes(saved: Mapping[str, Any], cfg: MMConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value in the checkpoint, value now)`` for each schedule setting that differs."""
    before = _flat(saved.get("training") or {}, "")
    now = _flat(cfg.training.model_dump(mode="json"), "")
    keys = sorted(k for k in before if k.split(".")[0] in SCHEDULE_KEYS)
    return [(f"training.{k}", before[k], now.get(k)) for k in keys if before[k] != now.get(k)]


def apply_schedule_changes(
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    configured: list[dict[str, Any]],
    checkpoint: Path,
    cfg: MMConfig,
) -> list[str]:
    """After loading ``checkpoint``: put the configured hyper-parameters (``configured``: the param groups
    as built from this run's config, before loading) back into the loaded groups and the scheduler, and set
    each group's lr for the next step from the current schedule. Returns one notice per changed setting."""
    notices = []
    saved_file = Path(checkpoint) / CONFIG_FILE
    if saved_file.is_file():
        saved = yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {}
        step = scheduler.last_epoch
        for key, old, new in schedule_changes(saved, cfg):
            notices.append(
                f"resume: {key} was {old!r} in the checkpoint, now {new!r}; the new value applies from "
                f"step {step + 1}"
            )
    groups = optimizer.param_groups
    if len(groups) != len(configured):
        return notices
    base_lrs: list[float | torch.Tensor] = [float(c["initial_lr"]) for c in configured]  # as LRScheduler
    for group, mine, base in zip(groups, configured, base_lrs):
        for key, value in mine.items():
            if key not in _STATE_ONLY:
                group[key] = value
        group["initial_lr"] = base
    scheduler.base_lrs = base_lrs
    for group, base, factor in zip(groups, base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    return notices
