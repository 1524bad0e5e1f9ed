"""Qwen3-Omni audio (the thinker of ``Qwen3OmniMoeForConditionalGeneration``): transformers' own
``WhisperFeatureExtractor`` (128 mel bins, 16 kHz, hop 160) gives ``input_features`` [audios, 128, T] and
``feature_attention_mask`` [audios, T] (the names the thinker's forward takes; the extractor calls the mask
``attention_mask`` and ``Qwen3OmniMoeProcessor`` renames it).

The published rules this format follows (``Qwen3OmniMoeProcessor`` / ``Qwen3OmniMoeAudioEncoder``):

- a clip of ``n`` samples has ``n // hop_length`` mel frames, all valid; it is padded to the longest clip of
  the batch only (the processor's ``padding=True``; the thinker keeps the mask's valid frames, so any padding
  works), never to 30 s;
- the encoder cuts a clip's frames into chunks of ``2 * n_window`` (100: one second); three stride-2
  convolutions leave 13 rows of a full chunk and ``ceil(ceil(ceil(r / 2) / 2) / 2)`` of the last one of ``r``
  frames; one ``<|audio_pad|>`` per row, between ``<|audio_start|>`` and ``<|audio_end|>`` (what the official
  chat template writes for an audio item, ``<|audio_pad|>`` expanded as the processor does).

``n_window`` is the processor's (``Qwen3OmniMoeProcessor.n_window``, 50), read from the folder's
``preprocessor_config.json`` when it names one; it must equal the model's ``audio_config.n_window``. The
encoder counts 13 rows per full chunk whatever ``n_window`` is, so only chunks that the convolutions leave 13
rows of (97 to 104 frames: ``n_window`` 49 to 52) work; another value is refused.

Each audio is featurised alone (:mod:`.qwen_audio`, shared with Qwen3-ASR), so a sample's inputs never depend
on the other audios of its batch (the processor pads a batch's raw waveforms before the STFT, which changes
the last frames of the shorter clips: there the STFT window reaches into zero padding instead of the clip's
reflected end); the collator pads features and mask with zeros along time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..errors import EncodeError
from .qwen_audio import QwenAudioFormat, after_convs

#: ``Qwen3OmniMoeProcessor.n_window``: half the mel frames of one encoder chunk
DEFAULT_N_WINDOW = 50
#: rows the thinker's audio encoder counts for every full chunk (``_get_feat_extract_output_lengths``)
ROWS_PER_CHUNK = 13


class Qwen3OmniFormat(QwenAudioFormat):
    name: ClassVar[str] = "qwen3-omni"
    extractor_types: ClassVar[tuple[str, ...]] = ("WhisperFeatureExtractor",)
    mask_key: ClassVar[str] = "feature_attention_mask"
    extract_options: ClassVar[dict[str, Any]] = {"truncation": False}

    def __init__(self, config: Mapping[str, Any]) -> None:
        from transformers.models.whisper import WhisperFeatureExtractor

        super().__init__(config)
        fe = self.load_extractor(
            WhisperFeatureExtractor, ("hop_length", "sampling_rate", "feature_size", "n_fft")
        )
        n_window = self.config.get("n_window", DEFAULT_N_WINDOW)
        if not isinstance(n_window, int) or isinstance(n_window, bool) or n_window <= 0:
            raise ValueError(f"n_window must be a positive integer, got {n_window!r}")
        if after_convs(2 * n_window) != ROWS_PER_CHUNK:
            raise ValueError(
                f"n_window: got {n_window}; Qwen3-Omni's audio encoder counts {ROWS_PER_CHUNK} rows per "
                f"chunk of 2 * n_window frames, which its convolutions give only for n_window 49 to 52 "
                f"(published: {DEFAULT_N_WINDOW})"
            )
        self.chunk_frames = 2 * n_window
        #: the shortest clip the STFT takes (its centred first window reflects ``n_fft // 2`` samples)
        self.min_samples: int = max(fe.n_fft // 2 + 1, fe.hop_length)

    def frames(self, num_samples: int) -> int:
        """Valid mel frames of a clip of ``num_samples`` samples."""
        return num_samples // self.hop_length

    def tokens(self, num_samples: int) -> int:
        """Audio tokens of a clip of ``num_samples`` samples (``Qwen3OmniMoeProcessor``'s rule)."""
        return self._rows(self.frames(num_samples))

    def _rows(self, frames: int) -> int:
        full, rest = divmod(frames, self.chunk_frames)
        return full * ROWS_PER_CHUNK + after_convs(rest)

    def check_length(self, num_samples: int) -> None:
        if num_samples < self.min_samples:
            ms = 1000 * self.min_samples / self.sampling_rate
            raise EncodeError(
                f"the audio has {num_samples} samples; {self.name} needs at least {self.min_samples} "
                f"({ms:g} ms at {self.sampling_rate} Hz: the STFT's first window)"
            )

    def feature_rows(self, features: Mapping[str, torch.Tensor]) -> int:
        """Rows as the thinker's audio encoder counts them: per audio, from its valid frames."""
        return sum(self._rows(int(n)) for n in features["feature_attention_mask"].sum(-1))
