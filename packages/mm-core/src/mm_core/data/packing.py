"""Packing variable-length samples (``data.dataloader_param.packing: true``): a micro-batch's samples
concatenated into one row instead of right-padded rows.

The contract every packing collator follows (mm-data-text's ``sft``, mm-data-vlm's ``vlm``, mm-data-audio's
``audio``): each sample gives its per-token fields (``input_ids``, ``labels``, and e.g. ``mm_token_type_ids``)
plus its own non-token inputs (pixel or audio features, concatenated in sample order as when padding: that
is the order their placeholder tokens appear in the packed row). :func:`pack_tokens` then builds one row:

- the per-token fields concatenated in sample order into ``[1, T]`` (``T`` = the samples' tokens, rounded up
  to ``pad_to_multiple_of`` with the pad values; the padded tail is a document of its own);
- ``labels`` -100 at every sample's first token, so after the shift no position predicts across a boundary
  (the unpacked run never predicts a sample's first token either: the same label tokens count);
- ``position_ids`` ``[1, T]`` restarting at 0 at every sample (models with 3-D rope positions build theirs
  per sample from these boundaries, e.g. mm-models-qwen's Qwen-VL);
- ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 cumulative document lengths ``[documents + 1]``) and
  ``max_length_q`` / ``max_length_k`` (the longest document), the keyword names of transformers' variable-
  length attention, so attention never crosses a sample: transformers' sdpa/eager masks find the documents
  from the restarting ``position_ids`` (no ``attention_mask`` is given), flash/varlen kernels read these.

The sampler fills each micro-batch up to ``data.dataloader_param.max_tokens_per_batch`` tokens in all (see
:class:`mm_core.data.sampling.TokenBudgetBatchSampler` with ``packed``), so the row is never longer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.collate import Padding
from mm_core.errors import ConfigError, DataError
from mm_core.train.loss import IGNORE_INDEX

PACKING_KEY = "data.dataloader_param.packing"
#: the keyword arguments of transformers' variable-length attention a packed batch carries
DOCUMENT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def pack_tokens(
    features: Sequence[Mapping[str, Any]], pads: Mapping[str, int], padding: Padding
) -> dict[str, Any]:
    """One packed row of ``features`` (module docstring): each field of ``pads`` (``labels`` among them)
    concatenated into a ``[1, T]`` long tensor, ``position_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``.
    A DataError for an empty list or a sample whose fields differ in length."""
    if not features:
        raise DataError("collate: got an empty list of samples")
    lengths = [int(f["input_ids"].shape[-1]) for f in features]
    for i, (f, n) in enumerate(zip(features, lengths)):
        for key in pads:
            if int(f[key].shape[-1]) != n:
                raise DataError(f"collate: sample {i} has {n} input_ids but {f[key].shape[-1]} {key}")
    total = sum(lengths)
    width = padding.width(total)
    docs = lengths + ([width - total] if width > total else [])
    batch: dict[str, Any] = {}
    for key, pad in pads.items():
        parts = [f[key].reshape(-1).long() for f in features]
        if width > total:
            parts.append(torch.full((width - total,), pad, dtype=torch.long))
        batch[key] = torch.cat(parts).unsqueeze(0)
    bounds = torch.tensor([0, *docs], dtype=torch.int64).cumsum(0)
    starts = torch.zeros(width, dtype=torch.long)
    starts[bounds[:-1]] = bounds[:-1]
    starts = starts.cummax(0).values
    batch["position_ids"] = (torch.arange(width) - starts).unsqueeze(0)
    if "labels" in batch:
        batch["labels"][0, bounds[:-1]] = IGNORE_INDEX
    cu = bounds.to(torch.int32)
    longest = max(docs)
    batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest, max_length_k=longest)
    return batch


def enable_packing(collate: Any, collator_name: str) -> None:
    """Switch a collator to packing: it must have a ``packing`` attribute (mm's ``sft``, ``vlm``/``qwen3vl``
    and ``audio`` collators do); any other is a ConfigError naming :data:`PACKING_KEY`."""
    if not hasattr(collate, "packing"):
        raise ConfigError(
            f"{PACKING_KEY}: true, but the collator {collator_name!r} ({type(collate).__name__}) does not "
            "pack samples; packing works with the collators sft, vlm (qwen3vl) and audio, or give a collator "
            "a `packing` attribute and build its batch with mm_core.data.packing.pack_tokens"
        )
    collate.packing = True
