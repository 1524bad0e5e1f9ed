"""The two models of the ``lm_gan`` task, as ``mm.models`` plugins (each FSDP-sharded by its plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.utils import ModelOutput

from mm_core.models import BaseModel, ModelArguments, ModelPlan


@dataclass
class LMOutput(ModelOutput):  # type: ignore[misc]  # transformers: untyped base
    logits: torch.Tensor | None = None


def _blocks(hidden: int, n_blocks: int) -> nn.ModuleList:
    return nn.ModuleList(
        nn.Sequential(
            nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
        )
        for _ in range(n_blocks)
    )


class TinyLM(nn.Module, BaseModel):
    """Embedding, residual MLP blocks (each an FSDP unit), a head over the vocabulary."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(fsdp_units=("blocks.{*}",))

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = _blocks(hidden, n_blocks)
        self.head = nn.Linear(hidden, vocab_size)

    @classmethod
    def _from_config(cls, args: ModelArguments) -> TinyLM:
        return cls(**args.config_overrides)

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> TinyLM:
        return cls._from_config(args)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> LMOutput:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return LMOutput(logits=self.head(h))


class TinyCritic(nn.Module, BaseModel):
    """Scores each position's next-token distribution [B, T, V] (one-hot for real text): a projection of
    the distribution, residual MLP blocks (each an FSDP unit), one score per position."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(fsdp_units=("blocks.{*}",))

    def __init__(self, vocab_size: int = 4096, hidden: int = 16, n_blocks: int = 1) -> None:
        super().__init__()
        self.proj = nn.Linear(vocab_size, hidden)
        self.blocks = _blocks(hidden, n_blocks)
        self.score = nn.Linear(hidden, 1)

    @classmethod
    def _from_config(cls, args: ModelArguments) -> TinyCritic:
        return cls(**args.config_overrides)

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> TinyCritic:
        return cls._from_config(args)

    def forward(self, distributions: torch.Tensor) -> torch.Tensor:
        h = self.proj(distributions)
        for block in self.blocks:
            h = h + block(h)
        scores: torch.Tensor = self.score(h).squeeze(-1)
        return scores
