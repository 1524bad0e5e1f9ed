"""``audio_sft``: conversations with audio (and images, videos), LLaMA-Factory / ShareGPT style JSON or JSONL.

A record::

    {"messages": [{"role": "user", "content": "<audio>What is said?"},
                  {"role": "assistant", "content": "Hello."}],
     "audios": ["a/1.wav"], "images": ["i/1.png"], "videos": ["v/1.mp4"]}

(or ShareGPT ``conversations`` with ``from``/``value``); one ``<audio>`` per entry of ``audios``, one
``<image>`` per entry of ``images`` and one ``<video>`` per entry of ``videos``, in order. Images need a
processor folder whose preprocessor_config.json also configures a Qwen-VL image processor (Qwen3-Omni's
thinker); videos are read for Qwen3-Omni (:mod:`mm_data_audio.omni_videos`), with their sound when
``use_audio_in_video`` is true (:mod:`mm_data_audio.video_audio`: a video without an audio track is then
refused, naming the record). Everything else is :class:`~mm_data_audio.dataset.AudioDataset`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mm_core.data.params import Field, boolean, optional_positive_int
from mm_data_vlm.videos import DEFAULT_MAX_SOURCE_FRAMES, DEFAULT_MAX_SOURCE_PIXELS

from .dataset import AudioDataset
from .records import Record, sft_record


def _positive_or_null(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)


#: Qwen3-Omni's videos; null: the folder's or the processor's own (see mm_data_audio.omni_videos)
VIDEO_FIELDS = {
    "video_fps": Field("a positive number or null", _positive_or_null, None),
    "video_max_frames": optional_positive_int(None),
    "video_min_pixels": optional_positive_int(None),  # pixels of one frame
    "video_max_pixels": optional_positive_int(None),
    # a video whose header says more frames, or more pixels a frame, is refused before decoding
    "video_max_source_frames": optional_positive_int(DEFAULT_MAX_SOURCE_FRAMES),
    "video_max_source_pixels": optional_positive_int(DEFAULT_MAX_SOURCE_PIXELS),
    # each video's sound interleaved with its frames (Qwen3OmniMoeProcessor's use_audio_in_video)
    "use_audio_in_video": boolean(False),
    # must be the model's (thinker config) position_id_per_seconds; null: the processor's (13)
    "position_id_per_seconds": Field("a positive number or null", _positive_or_null, None),
}


class AudioSFTDataset(AudioDataset):
    """Audio (+ image, video) SFT samples from ShareGPT-style records (see the module docstring)."""

    NAME: ClassVar[str] = "audio_sft"
    EXTRA_FIELDS: ClassVar[dict[str, Field]] = VIDEO_FIELDS

    def read_record(self, record: dict[str, Any]) -> Record:
        return sft_record(record, self.dataset_dir)
