"""``audio_sft``: conversations with audio (and images), LLaMA-Factory / ShareGPT style JSON or JSONL.

A record::

    {"messages": [{"role": "user", "content": "<audio>What is said?"},
                  {"role": "assistant", "content": "Hello."}],
     "audios": ["a/1.wav"], "images": ["i/1.png"]}

(or ShareGPT ``conversations`` with ``from``/``value``); one ``<audio>`` per entry of ``audios`` and one
``<image>`` per entry of ``images``, in order. Images need a processor folder whose preprocessor_config.json
also configures a Qwen-VL image processor (Qwen3-Omni's thinker). Everything else is
:class:`~mm_data_audio.dataset.AudioDataset`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .dataset import AudioDataset
from .records import Record, sft_record


class AudioSFTDataset(AudioDataset):
    """Audio (+ image) SFT samples from ShareGPT-style records (see the module docstring)."""

    NAME: ClassVar[str] = "audio_sft"

    def read_record(self, record: dict[str, Any]) -> Record:
        return sft_record(record, self.dataset_dir)
