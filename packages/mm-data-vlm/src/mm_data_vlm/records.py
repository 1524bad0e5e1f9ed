"""Reading LLaMA-Factory / ShareGPT style records: conversations with ``<image>`` / ``<video>`` placeholders.

The layout is read by :mod:`mm_core.data.records` (shared with mm-data-audio); what is ``vlm_sft``'s own is
here: the images (``images``, or LLaMA-Factory's ``image``), the videos (``videos``, or ``video``: video
files, paths relative to ``dataset_dir`` like the images), and records that are refused rather than skipped
when they are not JSON objects. A problem with one record's structure is a :class:`RecordError` saying what
is wrong; whoever knows where the record is (``file:line``, ``file[index]``) turns it into a ``DataError``
naming it (:func:`iter_records`, :func:`conversation` and :func:`image_paths` do so). A problem with a whole
file is a ``DataError`` naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mm_core.data import records as _records
from mm_core.data.records import (
    IMAGE_PLACEHOLDER,
    RecordError,
    parse_record,
    read_json_list,
    record_paths,
    record_turns,
    resolve_files,
)
from mm_core.errors import DataError

#: the placeholder of one video in a turn's text (LLaMA-Factory's)
VIDEO_PLACEHOLDER = "<video>"

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "RecordError",
    "conversation",
    "image_paths",
    "iter_records",
    "parse_record",
    "read_json_list",
    "read_media",
    "read_record",
    "record_images",
    "record_videos",
    "record_turns",
    "resolve_files",
]


def iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each record; ``where`` is ``file:line`` (jsonl) or ``file[index]`` (json). A
    record that is not a JSON object is a DataError naming it."""
    for where, obj in _records.iter_records(path):
        if isinstance(obj, RecordError):
            raise DataError(f"{where}: {obj}")
        yield where, obj


def read_record(record: dict[str, Any], dataset_dir: str | None) -> tuple[list[dict[str, str]], list[Path]]:
    """The record's turns and image paths (see :func:`record_turns` and :func:`record_images`)."""
    return record_turns(record), record_images(record, dataset_dir)


def read_media(
    record: dict[str, Any], dataset_dir: str | None
) -> tuple[list[dict[str, str]], list[Path], list[Path]]:
    """The record's turns, image paths and video paths (see :func:`record_videos`)."""
    return record_turns(record), record_images(record, dataset_dir), record_videos(record, dataset_dir)


def conversation(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """:func:`record_turns`, a problem being a DataError naming ``where``."""
    try:
        return record_turns(record)
    except RecordError as e:
        raise DataError(f"{where}: {e}") from None


def image_paths(record: dict[str, Any], where: str, dataset_dir: str | None) -> list[Path]:
    """:func:`record_images`, a problem being a DataError naming ``where``."""
    try:
        return record_images(record, dataset_dir)
    except RecordError as e:
        raise DataError(f"{where}: {e}") from None


def record_images(record: dict[str, Any], dataset_dir: str | None) -> list[Path]:
    """The record's ``images`` (a list, or one string; ``image`` is read when there is no ``images``)
    resolved against ``dataset_dir``."""
    return record_paths(record.get("images", record.get("image", [])), "images", dataset_dir, "image")


def record_videos(record: dict[str, Any], dataset_dir: str | None) -> list[Path]:
    """The record's ``videos`` (a list of video files, or one string; ``video`` is read when there is no
    ``videos``) resolved against ``dataset_dir``. LLaMA-Factory's other form, a video given as a list of
    frame images, is refused with a message saying so."""
    value = record.get("videos", record.get("video", []))
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        raise RecordError(
            '"videos" lists frame images; vlm_sft reads video files (mp4, mkv, webm, ...): encode the frames '
            "as a video, or give them as images"
        )
    return record_paths(value, "videos", dataset_dir, "video")
