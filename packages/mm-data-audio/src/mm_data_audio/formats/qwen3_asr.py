"""Qwen3-ASR audio: transformers' own ``Qwen3ASRFeatureExtractor`` (numpy + torch STFT, no torchaudio) gives
``input_features`` [audios, 128, T] and ``input_features_mask`` [audios, T] (the names
``Qwen3ASRForConditionalGeneration.forward`` takes; the extractor calls the mask ``attention_mask`` and
``Qwen3ASRProcessor`` renames it).

The published rules this format follows (``Qwen3ASRFeatureExtractor`` / ``Qwen3ASRProcessor`` /
``Qwen3ASREncoder``):

- a clip shorter than ``min_length`` samples (8000: half a second) is zero-padded to it, and the padding
  counts as valid frames;
- the clip has ``samples // hop_length`` mel frames, all valid; the time axis is right-padded with zeros to a
  multiple of ``2 * n_window`` (100 frames: one encoder chunk), the padding masked out;
- the encoder cuts the frames into chunks of ``2 * n_window``; three stride-2 convolutions leave
  ``ceil(ceil(ceil(r / 2) / 2) / 2)`` rows of a chunk of ``r`` valid frames (13 of a full 100-frame one); one
  ``<|audio_pad|>`` per row, between ``<|audio_start|>`` and ``<|audio_end|>`` (the text the official chat
  template writes for an audio item, ``<|audio_pad|>`` expanded as the processor does).

Each audio is featurised alone, so a sample's inputs never depend on the other audios of its batch (the
processor pads a batch's raw waveforms to the longest before the STFT, which changes the last partial chunk of
the shorter clips); the collator pads features and mask with zeros along time, as the extractor pads one clip
to its chunk multiple, which keeps T a multiple of ``2 * n_window``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import EncodeError
from . import AudioFormat

AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"


def _after_convs(frames: int) -> int:
    """Rows left of ``frames`` mel frames by the encoder's three (k=3, s=2, p=1) convolutions."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


class Qwen3ASRFormat(AudioFormat):
    name: ClassVar[str] = "qwen3-asr"
    extractor_types: ClassVar[tuple[str, ...]] = ("Qwen3ASRFeatureExtractor",)
    audio_token: ClassVar[str] = AUDIO_PAD
    special_tokens: ClassVar[tuple[str, ...]] = (AUDIO_START, AUDIO_PAD, AUDIO_END)

    def __init__(self, config: Mapping[str, Any]) -> None:
        from transformers.models.qwen3_asr import Qwen3ASRFeatureExtractor

        super().__init__(config)
        try:
            self.extractor = Qwen3ASRFeatureExtractor.from_dict(self.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Qwen3ASRFeatureExtractor refused the configuration: {e}") from None
        fe = self.extractor
        for key in ("hop_length", "sampling_rate", "feature_size"):
            value = getattr(fe, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if not isinstance(fe.n_window, int) or fe.n_window <= 0:
            raise ValueError(f"n_window must be a positive integer, got {fe.n_window!r}")
        self.hop_length: int = fe.hop_length
        self.min_length: int = max(0, int(fe.min_length or 0))
        #: mel frames per encoder chunk (must equal the model's ``audio_config.n_window * 2``)
        self.chunk_frames: int = 2 * fe.n_window

    @property
    def sampling_rate(self) -> int:
        return int(self.extractor.sampling_rate)

    def frames(self, num_samples: int) -> int:
        """Valid mel frames of a clip of ``num_samples`` samples."""
        return max(num_samples, self.min_length) // self.hop_length

    def tokens(self, num_samples: int) -> int:
        """Audio tokens of a clip of ``num_samples`` samples (``Qwen3ASRProcessor``'s rule)."""
        full, rest = divmod(self.frames(num_samples), self.chunk_frames)
        return full * _after_convs(self.chunk_frames) + _after_convs(rest)

    def placeholder(self, num_samples: int) -> str:
        return AUDIO_START + AUDIO_PAD * self.tokens(num_samples) + AUDIO_END

    def _one(self, wave: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out = self.extractor(
                np.asarray(wave, dtype=np.float32),
                sampling_rate=self.sampling_rate,
                padding="longest",
                return_attention_mask=True,
                return_tensors="pt",
            )
        except (ValueError, RuntimeError) as e:
            raise EncodeError(f"Qwen3ASRFeatureExtractor refused the audio: {e}") from None
        return out["input_features"][0].float(), out["attention_mask"][0].long()

    def features(self, waves: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        feats, masks = zip(*(self._one(w) for w in waves))
        width = max(f.shape[-1] for f in feats)
        pad = torch.nn.functional.pad
        return {
            "input_features": torch.stack([pad(f, (0, width - f.shape[-1])) for f in feats]),
            "input_features_mask": torch.stack([pad(m, (0, width - m.shape[-1])) for m in masks]),
        }

    def feature_rows(self, features: Mapping[str, torch.Tensor]) -> int:
        """Rows as ``Qwen3ASREncoder`` counts them: per chunk of the mask, its valid frames after the
        convolutions."""
        mask = features["input_features_mask"]
        audios, width = mask.shape
        if width % self.chunk_frames:
            raise EncodeError(
                f"input_features have {width} frames, not a multiple of the encoder chunk "
                f"({self.chunk_frames})"
            )
        per_chunk = mask.reshape(audios, width // self.chunk_frames, self.chunk_frames).sum(-1)
        return sum(_after_convs(int(n)) for n in per_chunk.flatten())

    def describe(self) -> str:
        seconds = self.chunk_frames * self.hop_length / self.sampling_rate
        return (
            f"{self.name} audio at {self.sampling_rate} Hz, {self.extractor.feature_size} mel bins, "
            f"{_after_convs(self.chunk_frames)} tokens per {seconds:g} s chunk"
        )
