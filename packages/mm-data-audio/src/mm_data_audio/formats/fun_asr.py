"""Fun-ASR-Nano audio: Kaldi log-mel filter banks stacked to a low frame rate, computed in torch.

transformers' ``FunAsrNanoFeatureExtractor`` calls ``torchaudio.compliance.kaldi.fbank`` (torchaudio does not
load beside torch 2.13 here), so this format computes the same features from Kaldi's published definition of
``compute-fbank-feats`` with the extractor's settings, in float32 and in the same order of operations:

1. frames of ``frame_length`` ms every ``frame_shift`` ms (400 / 160 samples at 16 kHz), only frames that fit
   whole (Kaldi's ``snip_edges``): ``1 + (n - 400) // 160`` frames; no dither (the extractor's is 0), so the
   features are deterministic;
2. per frame: the mean removed (DC offset), pre-emphasis ``x[j] - 0.97 x[j-1]`` (``x[-1] = x[0]``), the
   ``window`` (symmetric Hamming: 0.54 - 0.46 cos), zero-padded to the next power of two (512);
3. the power spectrum (``|rfft|²``, 257 bins) times ``feature_size`` triangular filters equally spaced on
   Kaldi's mel scale ``1127 ln(1 + f / 700)`` between 20 Hz and Nyquist (the last FFT bin has no weight);
4. ``log(max(energy, float32 eps))``; the waveform is not rescaled (the extractor feeds it as given) and no
   CMVN is applied (the extractor applies none);
5. low frame rate (LFR): the first frame repeated ``(m - 1) // 2`` times in front and the last one at the
   end, then every ``stride_lfr``-th window of ``num_frames_lfr`` consecutive frames concatenated
   (``m = 7``, stride 6: 560 values per row, ``ceil(frames / 6)`` rows).

Checked against kaldi-native-fbank (a C++ port of Kaldi's fbank): log energies agree within 2e-4 (float32
rounding); ``tests/test_funasr_families.py`` checks the LFR rows against funasr's own front end.

The audio tower keeps one row per LFR frame (no subsampling: the SAN-M encoder and the adaptor run at the LFR
rate and ``get_audio_features`` keeps the rows where ``input_features_mask`` is 1), so a clip takes one
``<|object_ref_start|>`` per LFR row, the placeholder ``FunAsrNanoProcessor`` writes. A clip shorter than one
window (400 samples) has no frame and is refused, as the extractor refuses it.

Forward inputs (the names ``FunAsrNanoForConditionalGeneration.forward`` takes): ``input_features``
[audios, rows, 560] and ``input_features_mask`` [audios, rows]; the collator pads both with zeros along rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import EncodeError
from . import AudioFormat

#: the token ``FunAsrNanoProcessor`` writes once per audio row (Qwen's ``<|object_ref_start|>``)
AUDIO_TOKEN = "<|object_ref_start|>"
#: window functions Kaldi's fbank knows (blackman needs a coefficient the extractor never sets)
WINDOWS = ("hamming", "hanning", "povey", "rectangular")
#: Kaldi's defaults that the extractor leaves as they are
PREEMPHASIS = 0.97
LOW_FREQ = 20.0
#: the floor before the log (``std::numeric_limits<float>::epsilon()``)
EPSILON = float(torch.finfo(torch.float32).eps)


def _positive_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive_number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{key} must be a positive number (milliseconds), got {value!r}")
    return float(value)


def kaldi_window(kind: str, size: int) -> torch.Tensor:
    """Kaldi's analysis window of ``size`` samples (symmetric, float32)."""
    if kind == "hamming":
        return torch.hamming_window(size, periodic=False, alpha=0.54, beta=0.46)
    if kind == "hanning":
        return torch.hann_window(size, periodic=False)
    if kind == "povey":
        return torch.hann_window(size, periodic=False).pow(0.85)
    if kind == "rectangular":
        return torch.ones(size)
    raise ValueError(f"window must be one of {', '.join(WINDOWS)}, got {kind!r}")


def kaldi_mel_banks(
    num_bins: int, fft_size: int, sampling_rate: float, low_freq: float = LOW_FREQ
) -> torch.Tensor:
    """Kaldi's triangular mel filters [num_bins, fft_size // 2 + 1] (upper edge at Nyquist, float32).

    Filter ``i`` rises from mel ``low + i·Δ`` to ``low + (i+1)·Δ`` and falls to ``low + (i+2)·Δ``, with
    ``Δ = (mel(nyquist) - mel(low)) / (num_bins + 1)``; FFT bin ``k`` sits at ``k · rate / fft_size`` Hz; the
    Nyquist bin gets no weight."""
    nyquist = 0.5 * sampling_rate
    if not 0.0 <= low_freq < nyquist:
        raise ValueError(f"low frequency {low_freq} Hz must lie below Nyquist ({nyquist} Hz)")
    mel_low = 1127.0 * math.log(1.0 + low_freq / 700.0)
    mel_high = 1127.0 * math.log(1.0 + nyquist / 700.0)
    delta = (mel_high - mel_low) / (num_bins + 1)
    index = torch.arange(num_bins).unsqueeze(1)
    left = mel_low + index * delta
    center = mel_low + (index + 1.0) * delta
    right = mel_low + (index + 2.0) * delta
    bin_hz = sampling_rate / fft_size
    mel = (1127.0 * (1.0 + bin_hz * torch.arange(float(fft_size // 2)) / 700.0).log()).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down))
    return torch.nn.functional.pad(banks, (0, 1))


class FunAsrNanoFormat(AudioFormat):
    """``FunAsrNanoFeatureExtractor``'s features without torchaudio (see the module docstring)."""

    name: ClassVar[str] = "fun-asr-nano"
    extractor_types: ClassVar[tuple[str, ...]] = ("FunAsrNanoFeatureExtractor",)
    audio_token: ClassVar[str] = AUDIO_TOKEN
    special_tokens: ClassVar[tuple[str, ...]] = (AUDIO_TOKEN,)

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        cfg = self.config
        self.num_mel_bins = _positive_int(cfg, "feature_size", 80)
        if self.num_mel_bins <= 3:
            raise ValueError(f"feature_size must be at least 4 mel bins, got {self.num_mel_bins}")
        rate = _positive_int(cfg, "sampling_rate", 16000)
        frame_ms = _positive_number(cfg, "frame_length", 25)
        shift_ms = _positive_number(cfg, "frame_shift", 10)
        self.num_frames_lfr = _positive_int(cfg, "num_frames_lfr", 7)
        self.stride_lfr = _positive_int(cfg, "stride_lfr", 6)
        window = cfg.get("window", "hamming")
        padding = cfg.get("padding_value", 0.0)
        if padding not in (0, 0.0):
            raise ValueError(f"padding_value must be 0.0 (what the collator pads with), got {padding!r}")
        # Kaldi truncates the window and shift to whole samples
        self.window_size = int(rate * frame_ms * 0.001)
        self.window_shift = int(rate * shift_ms * 0.001)
        if self.window_size < 2 or self.window_shift < 1:
            raise ValueError(
                f"frame_length {frame_ms} ms / frame_shift {shift_ms} ms give a window of {self.window_size} "
                f"and a shift of {self.window_shift} samples at {rate} Hz; need at least 2 and 1"
            )
        self.fft_size = 1 << (self.window_size - 1).bit_length()
        self.window = kaldi_window(str(window), self.window_size)
        self.mel_banks = kaldi_mel_banks(self.num_mel_bins, self.fft_size, float(rate))

    @property
    def feature_dim(self) -> int:
        """Values per LFR row (``feature_size × num_frames_lfr``: the encoder's ``input_size``)."""
        return self.num_mel_bins * self.num_frames_lfr

    def fbank_frames(self, num_samples: int) -> int:
        """Kaldi frames of a clip (whole windows only)."""
        if num_samples < self.window_size:
            return 0
        return 1 + (num_samples - self.window_size) // self.window_shift

    def tokens(self, num_samples: int) -> int:
        """Audio tokens (LFR rows) of a clip of ``num_samples`` samples."""
        return -(-self.fbank_frames(num_samples) // self.stride_lfr)

    def _check_length(self, num_samples: int) -> None:
        if num_samples < self.window_size:
            raise EncodeError(
                f"a clip of {num_samples} samples is shorter than one {self.window_size}-sample analysis "
                f"window ({self.window_size / self.sampling_rate * 1000:g} ms at {self.sampling_rate} Hz); "
                "Fun-ASR-Nano's features need at least one"
            )

    def placeholder(self, num_samples: int) -> str:
        self._check_length(num_samples)
        return AUDIO_TOKEN * self.tokens(num_samples)

    def fbank(self, wave: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Kaldi log-mel filter banks [frames, feature_size] of one mono waveform."""
        signal = torch.as_tensor(np.asarray(wave, dtype=np.float32)).reshape(-1)
        self._check_length(int(signal.numel()))
        frames = signal.unfold(0, self.window_size, self.window_shift)
        frames = frames - frames.mean(dim=1, keepdim=True)
        previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
        frames = (frames - PREEMPHASIS * previous) * self.window
        frames = torch.nn.functional.pad(frames, (0, self.fft_size - self.window_size))
        power = torch.fft.rfft(frames).abs().pow(2.0)
        energies = torch.mm(power, self.mel_banks.T)
        return torch.clamp(energies, min=EPSILON).log()

    def lfr(self, fbank: torch.Tensor) -> torch.Tensor:
        """Low-frame-rate rows [ceil(frames / stride), feature_size × num_frames_lfr] of filter banks."""
        m, n = self.num_frames_lfr, self.stride_lfr
        rows = -(-fbank.shape[0] // n)
        front = (m - 1) // 2
        # the last window must be complete: repeat the last frame as far as it needs
        back = max(m - 1 - front, (rows - 1) * n + m - front - fbank.shape[0])
        padded = torch.cat([fbank[:1].expand(front, -1), fbank, fbank[-1:].expand(back, -1)])
        windows = padded.unfold(0, m, n)[:rows]  # [rows, bins, m]
        return windows.transpose(1, 2).reshape(rows, -1)

    def _one(self, wave: np.ndarray) -> torch.Tensor:
        return self.lfr(self.fbank(wave))

    def features(self, waves: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        rows = [self._one(w) for w in waves]
        width = max(r.shape[0] for r in rows)
        feats = torch.zeros(len(rows), width, self.feature_dim)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            feats[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = 1
        return {"input_features": feats, "input_features_mask": mask}

    def feature_rows(self, features: Mapping[str, torch.Tensor]) -> int:
        """Rows the adaptor hands to the language model: the mask's ones (``get_audio_features``)."""
        return int(features["input_features_mask"].sum())

    def collate(self, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Features [audios, rows, dim] and mask [audios, rows], zero-padded along rows to the longest."""
        width = max(int(p["input_features_mask"].shape[1]) for p in parts)
        pad = torch.nn.functional.pad
        feats = [pad(p["input_features"], (0, 0, 0, width - p["input_features"].shape[1])) for p in parts]
        masks = [pad(p["input_features_mask"], (0, width - p["input_features_mask"].shape[1])) for p in parts]
        return {"input_features": torch.cat(feats), "input_features_mask": torch.cat(masks)}

    def describe(self) -> str:
        seconds = self.window_shift * self.stride_lfr / self.sampling_rate
        return (
            f"{self.name} audio at {self.sampling_rate} Hz, {self.num_mel_bins} log-mel bins × LFR "
            f"{self.num_frames_lfr}/{self.stride_lfr} ({self.feature_dim} values), "
            f"one token per {seconds:g} s"
        )
