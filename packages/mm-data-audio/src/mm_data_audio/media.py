"""One record's media, for the datasets: what the headers say (nothing decoded) and, when a sample is
fetched, the decoded inputs.

- :meth:`MediaReader.headers` reads every audio header (``soundfile.info``), image header (Pillow) and video
  container header (PyAV: frames, rate, size and, with ``use_audio_in_video``, the audio track's rate and
  length), and plans each video (:class:`~mm_data_audio.omni_videos.OmniVideos`): the token counts follow from
  these alone.
- :meth:`MediaReader.load` decodes: the clips and the videos' sound tracks as one list of waveforms in the
  order their tokens come in the text (the audio tower's rows are placed at the audio tokens in that order),
  and the pixel inputs of the images and videos.

Every refusal is an ``AudioError`` / ``OSError`` / ``EncodeError`` naming the file; the dataset names the
record (``file:line``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mm_data_vlm.qwen_vl_videos import VideoPlan
from mm_data_vlm.videos import (
    DEFAULT_MAX_SOURCE_FRAMES,
    DEFAULT_MAX_SOURCE_PIXELS,
    VideoHeader,
    load_frames,
    probe_video,
)

from .audio import AudioInfo, audio_info, check_audio, load_audio
from .encode import AudioProcessor, placeholders
from .images import image_size, load_image
from .records import AUDIO_PLACEHOLDER, VIDEO_PLACEHOLDER, Record
from .video_audio import load_track, track_info

#: the fields a sample with videos carries besides ``pixel_values_videos`` and ``video_grid_thw``
SECONDS_FIELD = "video_second_per_grid"
#: the flag of a sample whose videos' tokens interleave their sound (the model's ``use_audio_in_video``)
USE_AUDIO_FIELD = "use_audio_in_video"


@dataclass(frozen=True)
class Headers:
    """What one record's media headers say: the clips' samples (at the format's rate), the images' sizes,
    the videos' headers, plans and sound tracks (None: the video is read without its sound)."""

    samples: list[int]
    sizes: list[tuple[int, int]]
    videos: list[VideoHeader]
    plans: list[VideoPlan]
    tracks: list[AudioInfo | None]


@dataclass(frozen=True)
class MediaReader:
    """The dataset's settings for reading media: the processor, resampling, the longest clip, the video
    header limits (frames, pixels a frame; None: none)."""

    processor: AudioProcessor
    resample: bool
    max_seconds: float | None
    max_source_frames: int | None
    max_source_pixels: int | None

    @classmethod
    def from_params(cls, processor: AudioProcessor, pre: Mapping[str, Any]) -> MediaReader:
        """From the preprocess parameters (``resample``, ``max_audio_seconds``, ``video_max_source_frames``,
        ``video_max_source_pixels``; the video limits absent: mm-data-vlm's defaults)."""
        return cls(
            processor,
            bool(pre.get("resample", True)),
            pre.get("max_audio_seconds"),
            pre.get("video_max_source_frames", DEFAULT_MAX_SOURCE_FRAMES),
            pre.get("video_max_source_pixels", DEFAULT_MAX_SOURCE_PIXELS),
        )

    def _samples(self, path: Path, info: AudioInfo) -> int:
        fmt = self.processor.format
        return check_audio(
            path,
            info,
            fmt.sampling_rate,
            resample=self.resample,
            max_seconds=self.max_seconds,
            max_samples=fmt.max_samples,
        )

    def headers(self, record: Record) -> Headers:
        """The record's media headers and video plans (nothing decoded)."""
        fmt, videos = self.processor.format, self.processor.videos
        samples = [self._samples(p, audio_info(p)) for p in record.audios]
        sizes = [image_size(p) for p in record.images]
        headers = [
            probe_video(p, max_source_frames=self.max_source_frames, max_source_pixels=self.max_source_pixels)
            for p in record.videos
        ]
        if videos is None:  # the conversation's encoding refuses them, saying why
            return Headers(samples, sizes, headers, [], [])
        tracks = [track_info(p) if videos.use_audio else None for p in record.videos]
        plans = []
        for path, header, track in zip(record.videos, headers, tracks):
            tokens = None
            if track is not None:
                tokens = fmt.placeholder(self._samples(path, track)).count(fmt.audio_token)
            plans.append(videos.plan(header, tokens))
        return Headers(samples, sizes, headers, plans, tracks)

    def video_texts(self, headers: Headers) -> list[str]:
        return [plan.text for plan in headers.plans]

    def load(self, record: Record, headers: Headers) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
        """The waveforms (clips and sound tracks, in text order) and the pixel inputs of the record."""
        rate = self.processor.format.sampling_rate
        clips = iter(
            [load_audio(p, rate, resample=self.resample, max_seconds=self.max_seconds) for p in record.audios]
        )
        tracks = iter(
            [
                None if info is None else load_track(path, info, rate)
                for path, info in zip(record.videos, headers.tracks)
            ]
        )
        waves: list[np.ndarray] = []
        for placeholder in placeholders(record.messages):
            if placeholder == AUDIO_PLACEHOLDER:
                waves.append(next(clips))
            elif placeholder == VIDEO_PLACEHOLDER and (track := next(tracks)) is not None:
                waves.append(track)
        pixels: dict[str, torch.Tensor] = {}
        if record.images and self.processor.images is not None:
            pixels = self.processor.images.pixels([load_image(p) for p in record.images])
        videos = self.processor.videos
        if record.videos and videos is not None:
            frames = [
                (load_frames(p, h, plan.indices), plan)
                for p, h, plan in zip(record.videos, headers.videos, headers.plans)
            ]
            pixels.update(videos.pixels(frames))
            seconds = [videos.second_per_grid] * len(record.videos)
            pixels[SECONDS_FIELD] = torch.tensor(seconds, dtype=torch.float64)
        return waves, pixels

    def video_rows(self, pixels: dict[str, torch.Tensor]) -> int:
        videos = self.processor.videos
        return videos.feature_rows(pixels) if videos is not None else 0


def describe_videos(reader: MediaReader) -> str:
    videos = reader.processor.videos
    return f", {videos.describe()}" if videos is not None else ""


__all__ = ["SECONDS_FIELD", "USE_AUDIO_FIELD", "Headers", "MediaReader", "describe_videos"]
