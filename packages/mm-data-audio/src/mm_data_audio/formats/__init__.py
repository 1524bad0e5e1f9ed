"""Audio formats: how one model family turns waveforms into its forward's audio inputs and placeholder text.

``audio_sft`` and ``asr_manifest`` serve every audio family; what differs between families is fixed here, in
one small class per family (:class:`AudioFormat`):

- the audio inputs of its forward (Qwen3-ASR: ``input_features`` [audios, mels, frames] +
  ``input_features_mask``; Qwen3-Omni's thinker: ``input_features`` + ``feature_attention_mask``;
  Fun-ASR-Nano: low-frame-rate filter banks; ...), computed in numpy/torch (never torchaudio, which does not
  load beside torch 2.13), from the values of the model's ``preprocessor_config.json``;
- the text an ``<audio>`` placeholder becomes (special tokens around N audio tokens), from the length of the
  waveform in samples, so the index counts tokens from a file's header without decoding it;
- the special tokens its tokenizer must hold;
- how the audio inputs of several samples are batched (:meth:`AudioFormat.collate`).

The format of a processor folder is chosen by its ``preprocessor_config.json``'s ``feature_extractor_type``
(:func:`format_for`); :data:`FORMATS` lists them. A format module is imported only when a folder needs it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import EncodeError


class AudioFormat(ABC):
    """One family's audio inputs. Subclasses set the class attributes and implement the abstract methods.

    Contract, checked on every sample by the datasets: for waveforms of ``n`` samples each (mono float32 at
    :attr:`sampling_rate`), the text of :meth:`placeholder` holds exactly as many :attr:`audio_token` as the
    model's audio tower produces rows for them (:meth:`feature_rows` of the audio inputs)."""

    #: the name ``mm check`` and messages use
    name: ClassVar[str] = ""
    #: ``feature_extractor_type`` values of a ``preprocessor_config.json`` this format serves
    extractor_types: ClassVar[tuple[str, ...]] = ()
    #: the token whose rows take audio features (never labelled)
    audio_token: ClassVar[str] = ""
    #: every special token :meth:`placeholder` writes (the tokenizer must know each as one token)
    special_tokens: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Mapping[str, Any]) -> None:
        """``config``: the folder's ``preprocessor_config.json``. Raise ``ValueError`` naming the value when
        one is unusable for this family."""
        self.config = dict(config)

    @property
    def sampling_rate(self) -> int:
        """The rate (Hz) the feature extractor expects; audio at another rate is resampled to it (or refused
        with ``resample: false``)."""
        return int(self.config.get("sampling_rate") or 16000)

    @property
    def max_samples(self) -> int | None:
        """The longest waveform (in samples) the family's feature extractor takes, or None: no bound."""
        return None

    @abstractmethod
    def features(self, waves: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """The forward's audio inputs for one sample's waveforms (mono float32 at :attr:`sampling_rate`, in
        placeholder order). Raises :class:`EncodeError` when a waveform cannot be processed."""

    @abstractmethod
    def placeholder(self, num_samples: int) -> str:
        """The text that replaces one ``<audio>`` for a waveform of ``num_samples`` samples."""

    @abstractmethod
    def feature_rows(self, features: Mapping[str, torch.Tensor]) -> int:
        """How many audio-token rows the audio tower produces for these audio inputs."""

    def collate(self, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The batch's audio inputs from the samples' (those with audio, in order). Default: every field is
        right-padded with zeros along its last dimension to the longest, then concatenated along dim 0
        (one row per audio, as the audio towers take them)."""
        out: dict[str, torch.Tensor] = {}
        for key in parts[0]:
            tensors = [p[key] for p in parts]
            width = max(t.shape[-1] for t in tensors)
            padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors]
            out[key] = torch.cat(padded)
        return out

    def describe(self) -> str:
        """One line for ``mm check``."""
        return f"{self.name} audio at {self.sampling_rate} Hz"


#: ``feature_extractor_type`` -> ``module:class`` of its format in this package
FORMATS: dict[str, str] = {
    "Qwen3ASRFeatureExtractor": "qwen3_asr:Qwen3ASRFormat",
    "WhisperFeatureExtractor": "qwen3_omni:Qwen3OmniFormat",
    "FunAsrNanoFeatureExtractor": "fun_asr:FunAsrNanoFormat",
}


def format_for(config: Mapping[str, Any]) -> type[AudioFormat]:
    """The format serving a ``preprocessor_config.json``; ``ValueError`` naming the known ones otherwise."""
    kind = str(config.get("feature_extractor_type") or "")
    target = FORMATS.get(kind)
    if target is None:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(
            f"feature_extractor_type {kind or '(missing)'!r} is not one mm-data-audio knows ({known})"
        )
    module, name = target.split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if kind not in cls.extractor_types:
        raise TypeError(f"{cls.__name__} does not list {kind!r} in extractor_types")
    return cls


__all__ = ["FORMATS", "AudioFormat", "EncodeError", "format_for"]
