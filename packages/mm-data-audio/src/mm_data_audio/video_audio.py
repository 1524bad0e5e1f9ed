"""The audio track of a video file (Qwen3-Omni's ``use_audio_in_video``), read with PyAV.

- :func:`track_info` reads the container and stream headers only (nothing decoded): the track's rate, its
  channels and its length in samples, from the stream's duration (MP4, MOV), else its ``DURATION`` tag
  (Matroska / WebM, which store no per-stream duration), else the container's duration. A file without an
  audio stream is refused here, so preparation counts a video's audio tokens, and refuses a silent video,
  without decoding it.
- :func:`load_track` decodes the first audio stream, mixes its channels down to their mean and resamples it
  as :func:`~mm_data_audio.audio.load_audio` does a WAV file (``scipy.signal.resample_poly``), so a video's
  sound reaches the feature extractor exactly like the same sound in an audio file. Codecs decode in whole
  frames (an AAC frame is 1024 samples), so the decoded length differs a little from the header's: the track
  is cut or padded with silence to the header's length, which keeps the token count taken from the header;
  a track that decodes to less than half of it is refused as truncated.

Every failure is an :class:`~mm_data_audio.errors.AudioError` naming the file; the datasets add the record
(``file:line``) and ``data.dataset_param.on_error: skip`` counts and skips it.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .audio import AudioInfo, resampled_length
from .errors import AudioError

USE_AUDIO_KEY = "data.dataset_param.preprocess_parameters.use_audio_in_video"
_TAG = re.compile(r"^(\d+):(\d\d):(\d\d(?:\.\d+)?)$")


def _av() -> Any:
    import av

    return av


def _tag_seconds(tag: str | None) -> float | None:
    """Seconds of a Matroska ``DURATION`` tag (``HH:MM:SS.nnnnnnnnn``), or None."""
    match = _TAG.match(tag or "")
    if match is None:
        return None
    hours, minutes, seconds = match.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def track_info(path: Path) -> AudioInfo:
    """The header of ``path``'s first audio stream (nothing decoded); AudioError when the file cannot be
    opened, has no audio stream, or its header gives no rate or length."""
    av = _av()
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioError(
                    f"video {path} has no audio track, but {USE_AUDIO_KEY} is true (every video's sound is "
                    "trained on): give the video a sound track, or turn the option off"
                )
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate or stream.rate or 0)
            channels = int(stream.codec_context.channels or 0)
            seconds: float | None = None
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            if not seconds:
                seconds = _tag_seconds(stream.metadata.get("DURATION"))
            if not seconds and container.duration is not None:
                seconds = float(Fraction(container.duration, av.time_base))
    except AudioError:
        raise
    except (av.FFmpegError, ValueError, IndexError, UnicodeDecodeError) as e:
        raise AudioError(f"cannot read the audio track of video {path}: {type(e).__name__}: {e}") from None
    if rate <= 0 or channels <= 0:
        raise AudioError(f"video {path}: its audio track's header gives {rate} Hz, {channels} channel(s)")
    frames = round((seconds or 0.0) * rate)
    if frames <= 0:
        raise AudioError(f"video {path}: its audio track's header gives no duration (0 samples)")
    return AudioInfo(frames, rate, channels)


def load_track(path: Path, info: AudioInfo, sampling_rate: int) -> np.ndarray:
    """The audio track of ``path`` as mono float32 at ``sampling_rate``, ``resampled_length(info.frames,
    info.sampling_rate, sampling_rate)`` samples long (see the module docstring); AudioError naming the file
    when it cannot be decoded or holds less than half of what its header says."""
    from scipy.signal import resample_poly  # type: ignore[import-untyped]

    av = _av()
    parts: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.audio[0]
            planar = av.AudioResampler(format="fltp", layout=stream.layout, rate=info.sampling_rate)
            for frame in container.decode(stream):
                for out in planar.resample(frame):
                    parts.append(out.to_ndarray())
            for out in planar.resample(None):
                parts.append(out.to_ndarray())
    except (av.FFmpegError, ValueError, IndexError) as e:
        raise AudioError(f"cannot decode the audio track of video {path}: {type(e).__name__}: {e}") from None
    decoded = np.concatenate(parts, axis=1) if parts else np.zeros((1, 0), dtype=np.float32)
    if decoded.shape[1] * 2 < info.frames:
        raise AudioError(
            f"video {path}: its audio track decodes to {decoded.shape[1]:,} samples but its header says "
            f"{info.frames:,}; the file is truncated or its header is wrong"
        )
    wave = decoded.mean(axis=0, dtype=np.float32)[: info.frames]
    wave = np.pad(wave, (0, info.frames - len(wave)))
    if info.sampling_rate != sampling_rate:
        wave = resample_poly(wave, sampling_rate, info.sampling_rate).astype(np.float32, copy=False)
    samples = resampled_length(info.frames, info.sampling_rate, sampling_rate)
    if len(wave) != samples:  # resample_poly's documented length; never differs
        raise AudioError(f"video {path}: resampled to {len(wave)} samples, expected {samples}")
    return np.ascontiguousarray(wave, dtype=np.float32)


def write_video_with_audio(
    path: Path,
    frames: np.ndarray,
    fps: float,
    wave: np.ndarray | None,
    sampling_rate: int,
    *,
    channels: int = 2,
) -> Path:
    """Write uint8 ``[T, H, W, 3]`` ``frames`` at ``fps`` (H.264) and, unless ``wave`` is None, the mono float
    ``wave`` at ``sampling_rate`` as an AAC track of ``channels`` identical channels, in the container of
    ``path``'s suffix (width and height even). For examples and tests."""
    from mm_data_vlm.videos import write_video

    if wave is None:
        return write_video(path, frames, fps)
    av = _av()
    frames = np.asarray(frames, dtype=np.uint8)
    layout = "mono" if channels == 1 else "stereo"
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        video.width, video.height = int(frames.shape[2]), int(frames.shape[1])
        video.pix_fmt = "yuv420p"
        video.options = {"crf": "12"}
        audio = container.add_stream("aac", rate=sampling_rate)
        audio.layout = layout
        for array in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        data = np.tile(np.asarray(wave, dtype=np.float32)[None], (1 if channels == 1 else 2, 1))
        size = audio.codec_context.frame_size or 1024
        for start in range(0, data.shape[1], size):
            chunk = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(data[:, start : start + size]), format="fltp", layout=layout
            )
            chunk.sample_rate, chunk.pts = sampling_rate, start
            for packet in audio.encode(chunk):
                container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)
    return Path(path)
