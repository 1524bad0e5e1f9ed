"""Packing tokenised documents into fixed-length blocks with per-document position ids and labels.

Rules (also in the package README):
- Documents are concatenated in order (each followed by eos when ``add_eos``) into one token stream,
  which is cut into consecutive blocks of ``seq_len`` tokens; the last partial block is dropped.
- ``position_ids`` count from 0 at the start of every block and restart at 0 wherever a document
  starts inside the block.
- ``labels`` equal ``input_ids`` (Hugging Face convention, not shifted) except at a document's first
  token when that token is not the block's first token: there the label is -100. After the trainer's
  shift this means no position predicts the first token of the next document (the last token of one
  document, usually eos, never learns to predict across the boundary), while eos itself is still
  predicted from its own document.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from mm_core.train.loss import IGNORE_INDEX


class PackedStream:
    """A token stream plus document-start flags, read as ``len(self)`` blocks of ``seq_len`` tokens."""

    def __init__(self, tokens: torch.Tensor, doc_start: torch.Tensor, seq_len: int) -> None:
        if tokens.shape != doc_start.shape:
            raise ValueError("tokens and doc_start must have the same shape")
        self.tokens = tokens
        self.doc_start = doc_start
        self.seq_len = seq_len

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def block(self, index: int) -> dict[str, torch.Tensor]:
        """The ``input_ids``, ``labels`` and ``position_ids`` of block ``index``."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block {index} out of range for {n} blocks")
        index %= n
        lo, hi = index * self.seq_len, (index + 1) * self.seq_len
        return block_fields(self.tokens[lo:hi].long(), self.doc_start[lo:hi])


def block_fields(input_ids: torch.Tensor, starts: torch.Tensor) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` and ``position_ids`` of one block from its tokens (long) and its
    document-start flags (bool), by the rules in the module docstring."""
    idx = torch.arange(input_ids.numel())
    seg_start = torch.where(starts | (idx == 0), idx, torch.zeros_like(idx)).cummax(0).values
    position_ids = idx - seg_start
    labels = input_ids.clone()
    labels[starts & (idx > 0)] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def pack_documents(token_lists: Sequence[Sequence[int]], seq_len: int, eos_id: int | None) -> PackedStream:
    """Concatenate documents (appending ``eos_id`` to each unless None) into a PackedStream."""
    tokens = array("q")
    starts = array("b")
    for ids in token_lists:
        length = len(ids) + (eos_id is not None)
        if length == 0:
            continue
        tokens.extend(ids)
        if eos_id is not None:
            tokens.append(eos_id)
        starts.append(1)
        starts.frombytes(bytes(length - 1))
    if not tokens:
        return PackedStream(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool), seq_len)
    token_tensor = torch.frombuffer(tokens, dtype=torch.int64).to(torch.int32)
    start_tensor = torch.frombuffer(starts, dtype=torch.int8).bool()
    return PackedStream(token_tensor, start_tensor, seq_len)
