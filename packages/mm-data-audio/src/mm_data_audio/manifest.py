"""``asr_manifest``: speech recognition from JSONL manifest lines ``{"audio": "a.wav", "text": "transcript"}``
(optional ``"language"``), each turned into a conversation:

- user: ``<audio>`` + ``preprocess_parameters.asr_prompt`` (default empty: the family's chat template writes
  the rest of the prompt);
- assistant: ``preprocess_parameters.asr_prefix`` (default empty) + the transcript. Qwen3-ASR answers
  ``language English<asr_text>...``: ``asr_prefix: "language {language}<asr_text>"`` writes that, with
  ``{language}`` replaced by the line's ``language`` (a line without one is refused).

Everything else (audio loading, encoding, errors, ``on_error: skip``) is
:class:`~mm_data_audio.dataset.AudioDataset`, as for ``audio_sft``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mm_core.data.params import Field

from .dataset import AudioDataset
from .records import Record, manifest_record


def _text(default: str) -> Field:
    return Field("a string", lambda v: isinstance(v, str), default)


class ASRManifestDataset(AudioDataset):
    """ASR samples from manifest lines (see the module docstring)."""

    NAME: ClassVar[str] = "asr_manifest"
    EXTRA_FIELDS: ClassVar[dict[str, Field]] = {"asr_prompt": _text(""), "asr_prefix": _text("")}

    def read_record(self, record: dict[str, Any]) -> Record:
        return manifest_record(record, self.dataset_dir, self.params["asr_prompt"], self.params["asr_prefix"])
