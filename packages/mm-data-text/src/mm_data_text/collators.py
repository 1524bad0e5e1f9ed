"""Collators: ``llm_pretrain`` (stack fixed-length packed blocks) and ``sft`` (right-pad to the longest)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.collate import COLLATE_FIELDS, Padding
from mm_core.data.packing import pack_tokens
from mm_core.errors import DataError

__all__ = ["COLLATE_FIELDS", "LLMPretrainCollator", "SFTCollator", "pad_batch"]

SEQUENCE_KEYS = ("input_ids", "labels", "position_ids")


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def _extra(features: Sequence[Mapping[str, Any]], key: str) -> torch.Tensor:
    values = [f[key] for f in features]
    if all(isinstance(v, torch.Tensor) for v in values) and len({tuple(v.shape) for v in values}) == 1:
        return torch.stack(values)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return torch.tensor(values)
    raise DataError(f'collate: feature "{key}" cannot be batched (needs tensors of one shape or numbers)')


def pad_batch(
    features: Sequence[Mapping[str, Any]],
    pad_token_id: int,
    label_pad_id: int,
    pad_to_multiple_of: int | None,
    with_attention_mask: bool,
) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids``/``labels``/``position_ids`` of each feature into a [B, T] batch.

    Padding: input_ids with ``pad_token_id``, labels with ``label_pad_id``, position_ids with 0;
    ``attention_mask`` (1 = real token) when asked. ``sample_id`` becomes a long tensor [B]; any other
    key is stacked.
    """
    if not features:
        raise DataError("collate: got an empty list of samples")
    for i, f in enumerate(features):
        if "input_ids" not in f or "labels" not in f:
            raise DataError(f"collate: sample {i} has no input_ids/labels (keys: {', '.join(f)})")
    lengths = [int(f["input_ids"].shape[-1]) for f in features]
    width = _round_up(max(lengths), pad_to_multiple_of)
    batch_size = len(features)
    input_ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, width), label_pad_id, dtype=torch.long)
    position_ids = torch.zeros((batch_size, width), dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for row, (f, n) in enumerate(zip(features, lengths)):
        if int(f["labels"].shape[-1]) != n:
            raise DataError(f"collate: sample {row} has {n} input_ids but {f['labels'].shape[-1]} labels")
        input_ids[row, :n] = f["input_ids"]
        labels[row, :n] = f["labels"]
        position_ids[row, :n] = f["position_ids"] if "position_ids" in f else torch.arange(n)
        attention_mask[row, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if with_attention_mask:
        batch["attention_mask"] = attention_mask
    for key in features[0]:
        if key not in SEQUENCE_KEYS and key != "attention_mask":
            batch[key] = _extra(features, key).long() if key == "sample_id" else _extra(features, key)
    return batch


class _PadCollator:
    with_attention_mask = True

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        padding = Padding.read(collate_param, dataset)
        self.pad_to_multiple_of = padding.pad_to_multiple_of
        self.pad_token_id = padding.pad_token_id
        self.label_pad_id = padding.label_pad_id

    def _pad(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_batch(
            features, self.pad_token_id, self.label_pad_id, self.pad_to_multiple_of, self.with_attention_mask
        )


class SFTCollator(_PadCollator):
    """Right-pads variable-length SFT samples to the longest in the batch (rounded up to
    ``pad_to_multiple_of``); adds ``attention_mask``. With ``packing`` (``data.dataloader_param.packing``)
    the samples are concatenated into one row instead (:func:`mm_core.data.packing.pack_tokens`)."""

    #: set by mm_core.data.builder when ``data.dataloader_param.packing`` is true
    packing = False

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not self.packing:
            return self._pad(features)
        pads = {"input_ids": self.pad_token_id, "labels": self.label_pad_id}
        batch = pack_tokens(
            features, pads, Padding(self.pad_token_id, self.label_pad_id, self.pad_to_multiple_of)
        )
        for key in features[0]:
            if key not in SEQUENCE_KEYS and key != "attention_mask":
                batch[key] = _extra(features, key).long() if key == "sample_id" else _extra(features, key)
        return batch


class LLMPretrainCollator(_PadCollator):
    """Stacks packed blocks of one length. No ``attention_mask``: document boundaries are carried by
    ``position_ids``; with ``pad_to_multiple_of`` the blocks are right-padded (labels -100)."""

    with_attention_mask = False

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = {int(f["input_ids"].shape[-1]) for f in features if "input_ids" in f}
        if len(lengths) > 1:
            raise DataError(
                f"llm_pretrain collator: samples have different lengths {sorted(lengths)}; it expects "
                "fixed-length packed blocks (use collator_id: sft for variable-length samples)"
            )
        return self._pad(features)
