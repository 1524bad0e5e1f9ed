"""A tiny torch-only decoder (attention via SDPA + MLP) and a fixed-data training loop, for the memory
feature tests: every feature must give the same per-step losses as a plain run."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, LAYERS, SEQ, VOCAB, BATCH = 32, 4, 3, 16, 64, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """``order`` picks the order the layers run in (to test execution-order prefetch)."""

    def __init__(self, order: list[int] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)
        self.order = order or list(range(LAYERS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i in self.order:
            x = self.layers[i](x)
        return self.head(x)


def batches(rank: int, steps: int) -> list[torch.Tensor]:
    """The same batch every step (so the loss falls), different on each rank."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return [ids] * steps


def train_losses(
    model: nn.Module, rank: int, steps: int = 3, after_step: Callable[[], None] | None = None
) -> list[float]:
    """Per-step global mean loss over ranks (AdamW, fixed data); ``after_step`` runs after each optimizer
    step."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for ids in batches(rank, steps):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        out.append(value.item() / dist.get_world_size())
    return out


def build(seed: int = 0, order: list[int] | None = None) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(order)


def assert_same(ref: list[float], got: list[float], what: str, rtol: float = 1e-6) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert abs(a - b) <= rtol * max(abs(a), abs(b)), f"{what}: step {i + 1}: {a!r} vs {b!r}"
