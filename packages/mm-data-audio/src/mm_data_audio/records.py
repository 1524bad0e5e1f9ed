"""Reading records: LLaMA-Factory / ShareGPT style conversations with ``<audio>`` (and ``<image>``,
``<video>``) placeholders, and ASR manifest lines, both turned into one :class:`Record` (turns, audio, image
and video paths).
The ShareGPT layout itself (turns, file lists, JSON/JSONL files) is read by :mod:`mm_core.data.records`,
shared with mm-data-vlm.

A problem with one record's structure is a :class:`RecordError` saying what is wrong; the dataset, which knows
where the record is (``file:line`` for JSONL, ``file[index]`` for a JSON list), turns it into a ``DataError``
naming it. A problem with a whole file is a ``DataError`` naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mm_core.data.records import (
    IMAGE_PLACEHOLDER,
    RecordError,
    iter_records,
    record_paths,
    record_turns,
    resolve_files,
    resolve_path,
)
from mm_data_vlm.records import VIDEO_PLACEHOLDER

__all__ = [
    "AUDIO_PLACEHOLDER",
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "Record",
    "RecordError",
    "check_placeholders",
    "iter_records",
    "manifest_record",
    "resolve_files",
    "sft_record",
]

AUDIO_PLACEHOLDER = "<audio>"


@dataclass(frozen=True, slots=True)
class Record:
    """One conversation: turns ``{"role", "content"}`` and the media its placeholders stand for, in order."""

    messages: tuple[dict[str, str], ...]
    audios: tuple[Path, ...]
    images: tuple[Path, ...]
    videos: tuple[Path, ...] = ()


def check_placeholders(
    messages: list[dict[str, str]], audios: list[Path], images: list[Path], videos: Sequence[Path] = ()
) -> None:
    """One ``<audio>`` per audio, one ``<image>`` per image and one ``<video>`` per video, else a RecordError
    saying which disagree."""
    for placeholder, files, key in (
        (AUDIO_PLACEHOLDER, audios, "audios"),
        (IMAGE_PLACEHOLDER, images, "images"),
        (VIDEO_PLACEHOLDER, videos, "videos"),
    ):
        found = sum(m["content"].count(placeholder) for m in messages)
        if found != len(files):
            raise RecordError(
                f'the conversation has {found} {placeholder} placeholder(s) but "{key}" lists {len(files)} '
                "file(s); they must match one to one, in order"
            )


def sft_record(record: dict[str, Any], dataset_dir: str | None) -> Record:
    """An ``audio_sft`` record: ``messages``/``conversations`` + ``audios`` (+ ``images``, ``videos``: video
    files, ``video`` read when there is no ``videos``)."""
    messages = record_turns(record)
    audios = record_paths(record.get("audios", []), "audios", dataset_dir)
    images = record_paths(record.get("images", []), "images", dataset_dir)
    videos = record_paths(record.get("videos", record.get("video", [])), "videos", dataset_dir, "video")
    check_placeholders(messages, audios, images, videos)
    return Record(tuple(messages), tuple(audios), tuple(images), tuple(videos))


def manifest_record(record: dict[str, Any], dataset_dir: str | None, prompt: str, prefix: str) -> Record:
    """An ``asr_manifest`` line ``{"audio", "text"[, "language"]}`` as a conversation: the user turn is
    ``<audio>`` + ``prompt``, the assistant's ``prefix`` + text; ``{language}`` in either is replaced by the
    line's ``language``."""
    audio, text, language = record.get("audio"), record.get("text"), record.get("language")
    if not isinstance(audio, str) or not audio:
        raise RecordError(f'"audio" must be the path of an audio file (keys: {", ".join(record) or "none"})')
    if not isinstance(text, str):
        raise RecordError('"text" must be the transcript (a string)')
    if language is not None and not isinstance(language, str):
        raise RecordError('"language" must be a string when given')
    parts = []
    for template in (prompt, prefix):
        if "{language}" in template:
            if not language:
                raise RecordError(
                    'asr_prompt/asr_prefix use {language} but the line has no "language": add one, or change '
                    "the parameters"
                )
            template = template.replace("{language}", language)
        parts.append(template)
    tags = (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)
    if any(tag in parts[0] + parts[1] + text for tag in tags):
        raise RecordError(f"the transcript or prompt holds a {', '.join(tags)} tag")
    messages = (
        {"role": "user", "content": AUDIO_PLACEHOLDER + parts[0]},
        {"role": "assistant", "content": parts[1] + text},
    )
    return Record(messages, (resolve_path(audio, dataset_dir),), ())
