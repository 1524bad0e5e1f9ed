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

Each audio is featurised alone (:mod:`.qwen_audio`, shared with Qwen3-Omni), so a sample's inputs never depend
on the other audios of its batch (the processor pads a batch's raw waveforms to the longest before the STFT,
which changes the last partial chunk of the shorter clips); the collator pads features and mask with zeros
along time, as the extractor pads one clip to its chunk multiple, which keeps T a multiple of
``2 * n_window``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..errors import EncodeError
from .qwen_audio import AUDIO_END, AUDIO_PAD, AUDIO_START, QwenAudioFormat, after_convs

__all__ = ["AUDIO_END", "AUDIO_PAD", "AUDIO_START", "Qwen3ASRFormat"]


class Qwen3ASRFormat(QwenAudioFormat):
    name: ClassVar[str] = "qwen3-asr"
    extractor_types: ClassVar[tuple[str, ...]] = ("Qwen3ASRFeatureExtractor",)
    mask_key: ClassVar[str] = "input_features_mask"

    def __init__(self, config: Mapping[str, Any]) -> None:
        from transformers.models.qwen3_asr import Qwen3ASRFeatureExtractor

        super().__init__(config)
        fe = self.load_extractor(Qwen3ASRFeatureExtractor, ("hop_length", "sampling_rate", "feature_size"))
        if not isinstance(fe.n_window, int) or fe.n_window <= 0:
            raise ValueError(f"n_window must be a positive integer, got {fe.n_window!r}")
        self.min_length: int = max(0, int(fe.min_length or 0))
        self.chunk_frames = 2 * fe.n_window

    def frames(self, num_samples: int) -> int:
        """Valid mel frames of a clip of ``num_samples`` samples."""
        return max(num_samples, self.min_length) // self.hop_length

    def tokens(self, num_samples: int) -> int:
        """Audio tokens of a clip of ``num_samples`` samples (``Qwen3ASRProcessor``'s rule)."""
        full, rest = divmod(self.frames(num_samples), self.chunk_frames)
        return full * after_convs(self.chunk_frames) + after_convs(rest)

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
        return sum(after_convs(int(n)) for n in per_chunk.flatten())
