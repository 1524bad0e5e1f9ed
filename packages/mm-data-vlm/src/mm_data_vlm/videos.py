"""Opening training videos with PyAV: the size from the container header, and decoding only the frames used.

1. :func:`probe_video` reads the container and stream headers (no frame is decoded): the frame count, the
   frame rate, width and height. A file that cannot be opened, has no video stream, or whose header says
   more frames or pixels per frame than the limits (``video_max_source_frames``,
   ``video_max_source_pixels``) is refused there, before anything is decoded. Preparation counts a video's
   tokens from this header alone.
2. :func:`load_frames` decodes the stream from the start and keeps the frames at the sampled indices,
   stopping after the last one; a stream that ends before the header's frame count (a truncated or lying
   file) is refused.

Every failure is an ``OSError`` naming the file; the dataset turns it into a ``DataError`` naming the record
(``file:line``), which ``data.dataset_param.on_error: skip`` counts and skips like a bad image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

#: default of ``video_max_source_pixels``: a 4096 × 2160 (4K) frame
DEFAULT_MAX_SOURCE_PIXELS = 4096 * 2160
#: default of ``video_max_source_frames``: 20 minutes at 30 frames a second
DEFAULT_MAX_SOURCE_FRAMES = 36_000

KEY = "data.dataset_param.preprocess_parameters"


class VideoRefused(OSError):
    """The header says the video is over a limit, or is not a usable video; nothing was decoded."""


@dataclass(frozen=True)
class VideoHeader:
    """What the container header says about a file's first video stream."""

    frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.frames / self.fps


def _av() -> Any:
    import av

    return av


def probe_video(
    path: Path,
    *,
    max_source_frames: int | None = DEFAULT_MAX_SOURCE_FRAMES,
    max_source_pixels: int | None = DEFAULT_MAX_SOURCE_PIXELS,
) -> VideoHeader:
    """The header of ``path``'s first video stream (no frame decoded), checked against the limits (None: no
    limit of mm's own). The frame count is the stream's own (``nb_frames``), else its duration × frame rate
    (containers such as Matroska store no count). Raises ``OSError`` naming the file."""
    av = _av()
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoRefused(f"video {path} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            frames = int(stream.frames or 0)
            if frames <= 0 and rate:
                seconds: Fraction | float | None = None
                if stream.duration is not None and stream.time_base is not None:
                    seconds = stream.duration * stream.time_base
                elif container.duration is not None:
                    seconds = container.duration / av.time_base
                if seconds is not None:
                    frames = round(float(seconds) * float(rate))
    except VideoRefused:
        raise
    except (av.FFmpegError, ValueError, IndexError, UnicodeDecodeError) as e:
        raise OSError(f"cannot read video {path}: {type(e).__name__}: {e}") from None
    if not rate or float(rate) <= 0:
        raise VideoRefused(f"video {path}: the header gives no frame rate")
    if frames <= 0 or width <= 0 or height <= 0:
        raise VideoRefused(
            f"video {path}: the header gives {frames} frames of {width}x{height}; nothing to train on"
        )
    if max_source_frames is not None and frames > max_source_frames:
        raise VideoRefused(
            f"video {path} has {frames:,} frames (read from its header), over "
            f"{KEY}.video_max_source_frames = {max_source_frames:,}; refused before decoding. Cut the video, "
            "or raise the limit"
        )
    if max_source_pixels is not None and width * height > max_source_pixels:
        raise VideoRefused(
            f"video {path} is {width}x{height} = {width * height:,} pixels a frame (read from its header), "
            f"over {KEY}.video_max_source_pixels = {max_source_pixels:,}; refused before decoding. Shrink "
            "the video, or raise the limit"
        )
    return VideoHeader(frames=frames, fps=float(rate), width=width, height=height)


def load_frames(path: Path, header: VideoHeader, indices: Sequence[int]) -> np.ndarray:
    """The frames of ``path`` at ``indices`` (ascending, repeats allowed) as uint8 ``[T, H, W, 3]`` RGB,
    decoded from the start and stopping after the last index. Raises ``OSError`` naming the file when the
    stream ends early or a frame's size differs from the header's."""
    av = _av()
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        raise ValueError("no frame index to decode")
    kept: dict[int, np.ndarray] = {}
    last = wanted[-1]
    count = 0
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                count = i + 1
                if i in wanted:
                    array = frame.to_ndarray(format="rgb24")
                    if array.shape[:2] != (header.height, header.width):
                        raise VideoRefused(
                            f"video {path}: frame {i} is {array.shape[1]}x{array.shape[0]} but the header "
                            f"says {header.width}x{header.height}"
                        )
                    kept[i] = array
                if i >= last:
                    break
    except VideoRefused:
        raise
    except (av.FFmpegError, ValueError, IndexError) as e:
        raise OSError(f"cannot decode video {path}: {type(e).__name__}: {e}") from None
    if len(kept) < len(wanted):
        raise VideoRefused(
            f"video {path}: only {count} frames decode but its header says {header.frames} (frame {last} is "
            "needed); the file is truncated or its header is wrong"
        )
    return np.stack([kept[int(i)] for i in indices])


def write_video(path: Path, frames: np.ndarray, fps: float, *, codec: str = "libx264", crf: int = 12) -> Path:
    """Write uint8 ``[T, H, W, 3]`` RGB ``frames`` as a video file at ``fps`` frames a second (H.264 in the
    container of ``path``'s suffix, ``crf`` its quality; width and height even). For examples and tests."""
    av = _av()
    frames = np.asarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3] uint8, got shape {frames.shape}")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)} if codec == "libx264" else {}
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return Path(path)
