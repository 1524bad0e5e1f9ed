"""Reading training audio: mono float32 at the feature extractor's rate, every refusal decided as early as it
can be.

- :func:`audio_info` reads a file's header only (``soundfile.info``: frames, rate, channels), so the datasets
  count a clip's audio tokens, and refuse an empty, unreadable or too long one, without decoding it.
- :func:`load_audio` decodes WAV / FLAC / OGG (anything libsndfile reads) through ``soundfile``, mixes several
  channels down to their mean, and resamples with ``scipy.signal.resample_poly`` (a polyphase FIR filter with
  the rational factor ``rate / file rate`` reduced by their gcd) when the file's rate differs. With
  ``resample=False`` a differing rate is refused instead, naming both rates.

The resampled length is known from the header (:func:`resampled_length`: ``ceil(frames * up / down)``, what
``resample_poly`` returns), and a decoded clip must hold the frames its header announced, so the token count
taken from the header is the one the sample gets.

Every failure is an :class:`~mm_data_audio.errors.AudioError` whose message starts with the path; the datasets
add the record (``file:line``) and ``data.dataset_param.on_error: skip`` skips and counts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import AudioError

RESAMPLE_KEY = "data.dataset_param.preprocess_parameters.resample"
MAX_SECONDS_KEY = "data.dataset_param.preprocess_parameters.max_audio_seconds"


@dataclass(frozen=True)
class AudioInfo:
    """What a file's header says."""

    frames: int
    sampling_rate: int
    channels: int

    @property
    def seconds(self) -> float:
        return self.frames / self.sampling_rate


def audio_info(path: str | Path) -> AudioInfo:
    """The header of an audio file (nothing decoded); AudioError when it is missing, unreadable or empty."""
    import soundfile as sf  # type: ignore[import-untyped]

    path = Path(path)
    if not path.is_file():
        raise AudioError(f"{path}: no such audio file")
    try:
        info = sf.info(str(path))
    except (RuntimeError, OSError, ValueError, TypeError) as e:  # LibsndfileError is a RuntimeError
        raise AudioError(
            f"{path}: not an audio file soundfile can read (WAV, FLAC, OGG, ...): {' '.join(str(e).split())}"
        ) from None
    frames, rate, channels = int(info.frames), int(info.samplerate), int(info.channels)
    if rate <= 0 or channels <= 0:
        raise AudioError(f"{path}: the header gives {rate} Hz and {channels} channel(s); not usable audio")
    if frames <= 0:
        raise AudioError(f"{path}: empty audio (0 frames)")
    return AudioInfo(frames, rate, channels)


def _factors(source: int, target: int) -> tuple[int, int]:
    g = math.gcd(source, target)
    return target // g, source // g


def resampled_length(frames: int, source: int, target: int) -> int:
    """Samples of ``frames`` at ``source`` Hz once resampled to ``target`` Hz (``resample_poly``'s length)."""
    up, down = _factors(source, target)
    return -(-frames * up // down)


def check_audio(
    path: str | Path,
    info: AudioInfo,
    sampling_rate: int,
    *,
    resample: bool = True,
    max_seconds: float | None = None,
    max_samples: int | None = None,
) -> int:
    """The samples the clip will have at ``sampling_rate``, from its header; AudioError when it is refused:
    the wrong rate with ``resample`` off, longer than ``max_seconds``, or over ``max_samples`` (the family's
    bound) once resampled."""
    if info.sampling_rate != sampling_rate and not resample:
        raise AudioError(
            f"{path}: sampled at {info.sampling_rate} Hz but the feature extractor takes {sampling_rate} Hz; "
            f"set {RESAMPLE_KEY}: true (or resample the file)"
        )
    if max_seconds is not None and info.seconds > max_seconds:
        raise AudioError(
            f"{path}: {info.seconds:.2f} s long, over {MAX_SECONDS_KEY} = {max_seconds:g}; raise the limit "
            "(null: none) or cut the clip"
        )
    samples = resampled_length(info.frames, info.sampling_rate, sampling_rate)
    if max_samples is not None and samples > max_samples:
        raise AudioError(
            f"{path}: {samples:,} samples at {sampling_rate} Hz ({samples / sampling_rate:.2f} s), more than "
            f"the {max_samples:,} ({max_samples / sampling_rate:.2f} s) the model's feature extractor takes"
        )
    return samples


def load_audio(
    path: str | Path,
    sampling_rate: int,
    *,
    resample: bool = True,
    max_seconds: float | None = None,
    max_samples: int | None = None,
) -> np.ndarray:
    """The clip as mono float32 at ``sampling_rate`` (see the module docstring); AudioError naming the file
    when it is missing, empty, not audio, at the wrong rate with ``resample`` off, or too long (decided from
    the header, before decoding)."""
    import soundfile as sf
    from scipy.signal import resample_poly  # type: ignore[import-untyped]

    info = audio_info(path)
    samples = check_audio(
        path, info, sampling_rate, resample=resample, max_seconds=max_seconds, max_samples=max_samples
    )
    try:
        data, _rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, OSError, ValueError, TypeError) as e:
        raise AudioError(f"{path}: cannot decode the audio: {' '.join(str(e).split())}") from None
    if data.shape[0] != info.frames:
        raise AudioError(
            f"{path}: decoded {data.shape[0]:,} frames but the header announces {info.frames:,} "
            "(a truncated or corrupt file)"
        )
    wave = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    if info.sampling_rate != sampling_rate:
        up, down = _factors(info.sampling_rate, sampling_rate)
        wave = resample_poly(wave, up, down).astype(np.float32, copy=False)
    if len(wave) != samples:  # resample_poly's documented length; never differs
        raise AudioError(f"{path}: resampled to {len(wave)} samples, expected {samples}")
    return np.ascontiguousarray(wave, dtype=np.float32)
