"""Batching variable-length token samples: the collate parameters, right-padding the per-token fields with an
``attention_mask``, and the per-sample bookkeeping the datasets add.

Shared by the collators of the data plugins (mm-data-text's ``sft``, mm-data-vlm's ``vlm``, mm-data-audio's
``audio``), which may not import each other; what each adds (pixel or audio inputs, position ids) stays with
it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mm_core.data.params import COLLATE, Field, anything, boolean, optional_positive_int, read_params
from mm_core.errors import DataError
from mm_core.train.loss import IGNORE_INDEX

#: the keys of ``collate_param`` a padding collator accepts
COLLATE_FIELDS: dict[str, Field] = {
    "collator_id": anything(None),
    "model_name": anything(None),
    "ignore_pad_token_for_loss": boolean(True),
    "pad_to_multiple_of": optional_positive_int(None),
}
#: per-sample bookkeeping the datasets add: the record's index and the records ``on_error: skip`` passed over
META_FIELDS = ("sample_id", "skipped_samples")


@dataclass(frozen=True)
class Padding:
    """What padding a batch takes: the pad id of ``input_ids`` (the dataset's ``pad_token_id``, else 0), of
    ``labels`` (-100 with ``ignore_pad_token_for_loss``, else the pad id) and the multiple the width is
    rounded up to."""

    pad_token_id: int
    label_pad_id: int
    pad_to_multiple_of: int | None

    @classmethod
    def read(cls, collate_param: Mapping[str, Any] | None, dataset: Any) -> Padding:
        """From ``collate_param`` (:data:`COLLATE_FIELDS`; a ConfigError naming a bad key) and the dataset."""
        params = read_params(collate_param, COLLATE_FIELDS, COLLATE)
        pad_token_id = int(getattr(dataset, "pad_token_id", 0) or 0)
        label_pad_id = IGNORE_INDEX if params["ignore_pad_token_for_loss"] else pad_token_id
        return cls(pad_token_id, label_pad_id, params["pad_to_multiple_of"])

    def width(self, longest: int) -> int:
        """The batch's width for a longest sample of ``longest`` tokens."""
        multiple = self.pad_to_multiple_of
        return longest if not multiple else -(-longest // multiple) * multiple


def pad_tokens(
    features: Sequence[Mapping[str, Any]], pads: Mapping[str, int], padding: Padding
) -> dict[str, torch.Tensor]:
    """Each field of ``pads`` right-padded with its value to the longest ``input_ids`` (rounded up as
    ``padding`` says) into a [B, T] long tensor, and ``attention_mask`` (1 at real tokens); a DataError for
    an empty list of samples."""
    if not features:
        raise DataError("collate: got an empty list of samples")
    lengths = [int(f["input_ids"].shape[-1]) for f in features]
    shape = (len(features), padding.width(max(lengths)))
    batch = {k: torch.full(shape, pad, dtype=torch.long) for k, pad in pads.items()}
    batch["attention_mask"] = torch.zeros(shape, dtype=torch.long)
    for row, (f, n) in enumerate(zip(features, lengths)):
        for k in pads:
            batch[k][row, :n] = f[k]
        batch["attention_mask"][row, :n] = 1
    return batch


def meta_fields(features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``sample_id`` as a long tensor [B] (-1 where a sample has none) and ``skipped_samples`` summed."""
    return {
        "sample_id": torch.tensor([int(f.get("sample_id", -1)) for f in features], dtype=torch.long),
        "skipped_samples": sum(int(f.get("skipped_samples", 0)) for f in features),
    }
