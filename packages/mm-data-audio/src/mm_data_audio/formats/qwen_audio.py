"""What the Qwen audio formats (Qwen3-ASR, Qwen3-Omni's thinker) share: the audio tokens, the encoder's three
stride-2 convolutions, loading and checking transformers' feature extractor, featurising each clip alone and
stacking a sample's clips.

A subclass sets the mask's name (:attr:`QwenAudioFormat.mask_key`), loads its extractor with
:meth:`QwenAudioFormat.load_extractor`, and says how many tokens a clip has (:meth:`QwenAudioFormat.tokens`)
and how many rows the encoder gives for its features; it may refuse a clip's length
(:meth:`QwenAudioFormat.check_length`) and pass the extractor more options
(:attr:`QwenAudioFormat.extract_options`).

Each audio is featurised alone, so a sample's inputs never depend on the other audios of its batch (the
processors pad a batch's raw waveforms before the STFT, which changes the last frames of the shorter clips);
a sample's clips, and the collator's batch, are padded with zeros along time.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import EncodeError
from . import AudioFormat

AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"


def after_convs(frames: int) -> int:
    """Rows left of ``frames`` mel frames by the encoder's three (k=3, s=2, p=1) convolutions."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


class QwenAudioFormat(AudioFormat):
    """A Qwen audio format: ``input_features`` [audios, mels, T] and a [audios, T] mask named
    :attr:`mask_key`; one ``<|audio_pad|>`` per encoder row between ``<|audio_start|>`` and
    ``<|audio_end|>``."""

    audio_token: ClassVar[str] = AUDIO_PAD
    special_tokens: ClassVar[tuple[str, ...]] = (AUDIO_START, AUDIO_PAD, AUDIO_END)
    #: the name the model's forward takes the feature mask by
    mask_key: ClassVar[str] = ""
    #: options passed to the extractor besides the rate, padding, mask and tensor type
    extract_options: ClassVar[dict[str, Any]] = {}

    extractor: Any
    hop_length: int
    #: mel frames per encoder chunk (must equal the model's ``audio_config.n_window * 2``)
    chunk_frames: int

    def load_extractor(self, cls: Any, positive: Sequence[str]) -> Any:
        """``cls.from_dict`` of the folder's config, each of its ``positive`` attributes a positive integer;
        a ValueError saying which value is refused. Sets :attr:`extractor` and :attr:`hop_length`."""
        try:
            extractor = cls.from_dict(self.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{cls.__name__} refused the configuration: {e}") from None
        for key in positive:
            value = getattr(extractor, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        self.extractor = extractor
        self.hop_length = int(extractor.hop_length)
        return extractor

    @property
    def sampling_rate(self) -> int:
        return int(self.extractor.sampling_rate)

    @abstractmethod
    def tokens(self, num_samples: int) -> int:
        """Audio tokens of a clip of ``num_samples`` samples."""

    def check_length(self, num_samples: int) -> None:
        """Refuse (EncodeError) a clip too short for the extractor; default: every length works."""

    def placeholder(self, num_samples: int) -> str:
        self.check_length(num_samples)
        return AUDIO_START + AUDIO_PAD * self.tokens(num_samples) + AUDIO_END

    def _one(self, wave: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        wave = np.asarray(wave, dtype=np.float32)
        self.check_length(int(wave.shape[-1]))
        try:
            out = self.extractor(
                wave,
                sampling_rate=self.sampling_rate,
                padding="longest",
                **self.extract_options,
                return_attention_mask=True,
                return_tensors="pt",
            )
        except (ValueError, RuntimeError) as e:
            raise EncodeError(f"{self.extractor_types[0]} refused the audio: {e}") from None
        return out["input_features"][0].float(), out["attention_mask"][0].long()

    def features(self, waves: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        feats, masks = zip(*(self._one(w) for w in waves))
        width = max(f.shape[-1] for f in feats)
        pad = torch.nn.functional.pad
        return {
            "input_features": torch.stack([pad(f, (0, width - f.shape[-1])) for f in feats]),
            self.mask_key: torch.stack([pad(m, (0, width - m.shape[-1])) for m in masks]),
        }

    def describe(self) -> str:
        seconds = self.chunk_frames * self.hop_length / self.sampling_rate
        return (
            f"{self.name} audio at {self.sampling_rate} Hz, {self.extractor.feature_size} mel bins, "
            f"{after_convs(self.chunk_frames)} tokens per {seconds:g} s chunk"
        )
