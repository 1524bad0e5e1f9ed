"""``audio``: batch audio (+ image) samples of ``audio_sft`` / ``asr_manifest`` with any number of clips per
sample, for every audio format of mm-data-audio. The padding of the token fields is mm-core's
(:mod:`mm_core.data.collate`, shared with the text and image collators)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.collate import COLLATE_FIELDS, META_FIELDS, Padding, meta_fields, pad_tokens
from mm_core.data.packing import pack_tokens
from mm_core.data.params import COLLATE
from mm_core.errors import ConfigError, DataError
from mm_data_vlm.qwen_vl_videos import VIDEO_FIELDS

from .formats import AudioFormat
from .images import IMAGE_FIELDS
from .media import SECONDS_FIELD, USE_AUDIO_FIELD

__all__ = ["COLLATE_FIELDS", "META_FIELDS", "TOKEN_FIELDS", "AudioCollator"]

#: per-token fields, right-padded to the batch's width
TOKEN_FIELDS = ("input_ids", "labels")


class AudioCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (-100) to the longest sample (rounded up to
    ``pad_to_multiple_of``) and adds ``attention_mask``; batches the audio inputs of the samples that have
    audio through the dataset's format (:meth:`~mm_data_audio.formats.AudioFormat.collate`: one row per clip,
    in the order the audio tokens appear in the flattened batch) and concatenates image inputs
    (``pixel_values``, ``image_grid_thw``) and video inputs (``pixel_values_videos``, ``video_grid_thw``)
    along dim 0. ``video_second_per_grid`` is a list of floats, one per video (plain values, which reach the
    model as they are, never cast to the training dtype), and ``use_audio_in_video`` is true when the videos
    carry their sound (Qwen3-Omni's rule is one for the whole forward: a batch mixing videos with and without
    sound is refused). A batch without audio has no audio key, one without images no image key.
    ``sample_id`` is a tensor [B]; ``skipped_samples`` (records skipped by ``on_error: skip``) an int. With
    ``packing`` (``data.dataloader_param.packing``) the token fields are concatenated into one row
    (:func:`mm_core.data.packing.pack_tokens`); the clips stay one row each, in sample order, and the audio
    tower encodes each clip alone as before."""

    #: set by mm_core.data.builder when ``data.dataloader_param.packing`` is true
    packing = False

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        self.padding = Padding.read(collate_param, dataset)
        fmt = getattr(dataset, "format", None)
        if not isinstance(fmt, AudioFormat):
            raise ConfigError(
                f"{COLLATE}.collator_id: the audio collator needs a dataset of mm-data-audio (audio_sft, "
                f"asr_manifest), which knows the model's audio format; got {type(dataset).__name__}"
            )
        self.format = fmt

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        pads = {"input_ids": self.padding.pad_token_id, "labels": self.padding.label_pad_id}
        batch: dict[str, Any] = (pack_tokens if self.packing else pad_tokens)(features, pads, self.padding)
        for key in (*IMAGE_FIELDS, *VIDEO_FIELDS, SECONDS_FIELD):
            parts = [f[key] for f in features if key in f]
            if parts:
                batch[key] = torch.cat(parts)
        if SECONDS_FIELD in batch:
            batch[SECONDS_FIELD] = [float(s) for s in batch[SECONDS_FIELD]]
            sound = {bool(f.get(USE_AUDIO_FIELD)) for f in features if SECONDS_FIELD in f}
            if len(sound) > 1:
                raise DataError(
                    "a batch mixes videos read with their sound and videos read without (use_audio_in_video "
                    "differs between its datasets); Qwen3-Omni takes one rule for a whole forward"
                )
            batch[USE_AUDIO_FIELD] = sound.pop()
        skip = {*TOKEN_FIELDS, *META_FIELDS, *IMAGE_FIELDS, *VIDEO_FIELDS, SECONDS_FIELD, USE_AUDIO_FIELD}
        audio = [{k: v for k, v in f.items() if k not in skip} for f in features]
        audio = [a for a in audio if a]
        if audio:
            batch.update(self.format.collate(audio))
        batch.update(meta_fields(features))
        return batch
