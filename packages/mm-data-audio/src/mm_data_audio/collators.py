"""``audio``: batch audio (+ image) samples of ``audio_sft`` / ``asr_manifest`` with any number of clips per
sample, for every audio format of mm-data-audio."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.params import COLLATE, anything, boolean, optional_positive_int, read_params
from mm_core.errors import ConfigError, DataError
from mm_core.train.loss import IGNORE_INDEX

from .formats import AudioFormat
from .images import IMAGE_FIELDS

COLLATE_FIELDS = {
    "collator_id": anything(None),
    "model_name": anything(None),
    "ignore_pad_token_for_loss": boolean(True),
    "pad_to_multiple_of": optional_positive_int(None),
}

#: per-token fields, right-padded to the batch's width
TOKEN_FIELDS = ("input_ids", "labels")
#: per-sample bookkeeping
META_FIELDS = ("sample_id", "skipped_samples")


class AudioCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (-100) to the longest sample (rounded up to
    ``pad_to_multiple_of``) and adds ``attention_mask``; batches the audio inputs of the samples that have
    audio through the dataset's format (:meth:`~mm_data_audio.formats.AudioFormat.collate`: one row per clip,
    in the order the audio tokens appear in the flattened batch) and concatenates image inputs
    (``pixel_values``, ``image_grid_thw``) along dim 0. A batch without audio has no audio key, one without
    images no image key. ``sample_id`` is a tensor [B]; ``skipped_samples`` (records skipped by
    ``on_error: skip``) an int."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        params = read_params(collate_param, COLLATE_FIELDS, COLLATE)
        fmt = getattr(dataset, "format", None)
        if not isinstance(fmt, AudioFormat):
            raise ConfigError(
                f"{COLLATE}.collator_id: the audio collator needs a dataset of mm-data-audio (audio_sft, "
                f"asr_manifest), which knows the model's audio format; got {type(dataset).__name__}"
            )
        self.format = fmt
        self.pad_to_multiple_of: int | None = params["pad_to_multiple_of"]
        self.pad_token_id = int(getattr(dataset, "pad_token_id", 0) or 0)
        self.label_pad_id = IGNORE_INDEX if params["ignore_pad_token_for_loss"] else self.pad_token_id

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise DataError("collate: got an empty list of samples")
        lengths = [int(f["input_ids"].shape[-1]) for f in features]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(features)
        pads = {"input_ids": self.pad_token_id, "labels": self.label_pad_id}
        batch: dict[str, Any] = {k: torch.full((b, width), pads[k], dtype=torch.long) for k in TOKEN_FIELDS}
        batch["attention_mask"] = torch.zeros((b, width), dtype=torch.long)
        for row, (f, n) in enumerate(zip(features, lengths)):
            for k in TOKEN_FIELDS:
                batch[k][row, :n] = f[k]
            batch["attention_mask"][row, :n] = 1
        for key in IMAGE_FIELDS:
            parts = [f[key] for f in features if key in f]
            if parts:
                batch[key] = torch.cat(parts)
        skip = {*TOKEN_FIELDS, *META_FIELDS, *IMAGE_FIELDS}
        audio = [{k: v for k, v in f.items() if k not in skip} for f in features]
        audio = [a for a in audio if a]
        if audio:
            batch.update(self.format.collate(audio))
        batch["sample_id"] = torch.tensor([int(f.get("sample_id", -1)) for f in features], dtype=torch.long)
        batch["skipped_samples"] = sum(int(f.get("skipped_samples", 0)) for f in features)
        return batch
