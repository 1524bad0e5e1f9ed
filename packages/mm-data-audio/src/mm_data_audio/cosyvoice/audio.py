"""Audio for CosyVoice3: the one log-mel every stage uses, and reading / writing / resampling waves.

**The log-mel** (:func:`log_mel`) is the Matcha-TTS / HiFi-GAN extractor CosyVoice3 trains on, at 24 kHz:
the wave is reflect-padded by ``(n_fft − hop) / 2 = 720`` samples on each side, cut into frames of
``n_fft = win = 1920`` samples every ``hop = 480`` (a periodic Hann window, no centring), the STFT magnitude
``sqrt(re² + im² + 1e-9)`` goes through an 80-bin Slaney-normalised mel filterbank over 0..12 kHz (the
filterbank ``librosa.filters.mel`` gives with its defaults, computed here in numpy so that librosa is not a
dependency) and the result is ``log(clamp(mel, 1e-5))``. ``L`` samples give exactly ``T = L / 480`` frames
(50 Hz), so a wave of a multiple of 960 samples has two frames per 25 Hz speech token. The flow stage's
target, the vocoder's input and the vocoder's mel loss are all this function.

**Waves** are read with ``soundfile`` (mixed down to mono) and resampled with
``scipy.signal.resample_poly`` (polyphase FIR, factor ``rate / file rate`` reduced by their gcd); they are
written as mono PCM16.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

SAMPLE_RATE = 24000
N_FFT = 1920
HOP = 480
N_MELS = 80
F_MIN = 0.0
F_MAX = 12000.0
#: samples per 25 Hz speech token (= 2 mel frames)
TOKEN_SAMPLES = 2 * HOP


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    f_sp = 200.0 / 3.0
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    mels = hz / f_sp
    log_region = hz >= min_log_hz
    mels[log_region] = min_log_hz / f_sp + np.log(hz[log_region] / min_log_hz) / logstep
    return mels


def _mel_to_hz(mels: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    f_sp = 200.0 / 3.0
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    hz = mels * f_sp
    log_region = mels >= min_log_mel
    hz[log_region] = min_log_hz * np.exp(logstep * (mels[log_region] - min_log_mel))
    return hz


@lru_cache(maxsize=8)
def mel_filterbank(
    sample_rate: int = SAMPLE_RATE,
    n_fft: int = N_FFT,
    n_mels: int = N_MELS,
    fmin: float = F_MIN,
    fmax: float = F_MAX,
) -> npt.NDArray[np.float32]:
    """The ``[n_mels, n_fft // 2 + 1]`` Slaney-normalised triangular mel filters (``librosa.filters.mel``'s
    defaults: ``htk=False, norm="slaney"``)."""
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, 1 + n_fft // 2)
    edges = _mel_to_hz(
        np.linspace(_hz_to_mel(np.array([fmin]))[0], _hz_to_mel(np.array([fmax]))[0], n_mels + 2)
    )
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[:, None]
    return weights.astype(np.float32)


def log_mel(wave: torch.Tensor) -> torch.Tensor:
    """The CosyVoice3 log-mel of a 24 kHz wave (module docstring): ``[L] -> [L / 480, 80]`` or
    ``[B, L] -> [B, L / 480, 80]``, float32, on the wave's device. The wave needs more than 720 samples
    (the reflect padding); a length that is not a multiple of 480 drops the last partial frame."""
    if wave.dim() not in (1, 2):
        raise ValueError(f"log_mel: expected a wave [L] or a batch [B, L], got shape {tuple(wave.shape)}")
    batch = wave.float().reshape(-1, wave.shape[-1])
    pad = (N_FFT - HOP) // 2
    if batch.shape[-1] <= pad:
        raise ValueError(f"log_mel: {batch.shape[-1]} samples; the reflect padding needs more than {pad}")
    padded = torch.nn.functional.pad(batch.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(N_FFT, device=wave.device, dtype=torch.float32)
    spec = torch.stft(
        padded,
        N_FFT,
        hop_length=HOP,
        win_length=N_FFT,
        window=window,
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(spec.real.square() + spec.imag.square() + 1e-9)
    filters = torch.from_numpy(mel_filterbank()).to(wave.device)
    mel = torch.log(torch.clamp(filters @ magnitude, min=1e-5)).transpose(1, 2)
    return mel[0] if wave.dim() == 1 else mel


def resample(wave: npt.NDArray[np.floating], source: int, target: int) -> npt.NDArray[np.float32]:
    """``wave`` at ``source`` Hz resampled to ``target`` Hz (``scipy.signal.resample_poly``), float32."""
    if source == target:
        return np.asarray(wave, dtype=np.float32)
    from scipy.signal import resample_poly  # type: ignore[import-untyped]

    g = math.gcd(int(source), int(target))
    return np.asarray(resample_poly(wave, target // g, source // g), dtype=np.float32)


def read_wav(path: str | Path, sample_rate: int = SAMPLE_RATE) -> npt.NDArray[np.float32]:
    """A mono float32 wave at ``sample_rate`` from any file libsndfile reads (channels averaged, resampled
    when the file's rate differs). Raises ValueError naming the file when it cannot be read or is empty."""
    import soundfile as sf  # type: ignore[import-untyped]

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, OSError, ValueError, TypeError) as exc:  # LibsndfileError is a RuntimeError
        raise ValueError(
            f"{path}: not an audio file soundfile can read: {' '.join(str(exc).split())}"
        ) from None
    if data.shape[0] == 0:
        raise ValueError(f"{path}: empty audio (0 frames)")
    return resample(data.mean(axis=1), int(rate), sample_rate)


def write_wav(path: str | Path, wave: npt.NDArray[np.floating], sample_rate: int = SAMPLE_RATE) -> None:
    """Write a mono wave (values in [-1, 1], clipped) as 16-bit PCM."""
    import soundfile as sf

    data = np.clip(np.asarray(wave, dtype=np.float32), -1.0, 1.0)
    sf.write(str(path), data, sample_rate, subtype="PCM_16")


def fit_length(wave: npt.NDArray[np.floating], samples: int) -> npt.NDArray[np.float32]:
    """``wave`` zero-padded at the end, or cut, to exactly ``samples`` samples."""
    out = np.zeros(samples, dtype=np.float32)
    n = min(samples, len(wave))
    out[:n] = wave[:n]
    return out
