"""Custom models as a third-party plugin writes them, loaded through ``training.plugin: [_plugin_models]``.

``RootLM``: embedding and head at the root (outside every FSDP unit), residual MLP blocks as units. Its
forward returns the output kind named by ``output``: a transformers ``ModelOutput``, a
``types.SimpleNamespace``, a plain dataclass or a dict. ``nan_after: N`` turns the logits into NaN from the
(N+1)-th training forward on, ``crash: true`` raises inside the forward. ``LabelsLM`` computes its own loss
and cannot run without labels.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from mm_core.models import BaseModel, ModelArguments, ModelPlan
from mm_core.registry import model_register


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100)


@dataclasses.dataclass
class HFOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclasses.dataclass
class PlainOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class _Tiny(nn.Module, BaseModel):
    mm_plan: ClassVar[ModelPlan] = ModelPlan(fsdp_units=("blocks.{*}",))

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, n_blocks: int = 2, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
            )
            for _ in range(n_blocks)
        )
        self.head = nn.Linear(hidden, vocab_size)
        self.forwards = 0

    @classmethod
    def _from_config(cls, args: ModelArguments) -> nn.Module:
        return cls(**args.config_overrides)

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> nn.Module:
        return cls._from_config(args)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


@model_register.register("test_root_lm")
class RootLM(_Tiny):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if self.options.get("crash"):
            raise ValueError("plugin exploded in forward")
        logits = self.logits(input_ids)
        if self.training:
            self.forwards += 1
            if self.forwards > self.options.get("nan_after", 1 << 30):
                logits = logits * float("nan")
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        kind = self.options.get("output", "model_output")
        if kind == "namespace":
            return types.SimpleNamespace(loss=loss, logits=logits)
        if kind == "dataclass":
            return PlainOutput(loss=loss, logits=logits)
        if kind == "dict":
            return {"loss": loss, "logits": logits}
        if kind == "loss_only":
            return types.SimpleNamespace(loss=loss)
        return HFOutput(loss=loss, logits=logits)


@model_register.register("test_labels_lm")
class LabelsLM(_Tiny):
    """Computes its own loss; labels are a required argument."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        logits = self.logits(input_ids)
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )
        return types.SimpleNamespace(loss=loss)
