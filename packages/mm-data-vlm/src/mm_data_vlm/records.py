"""Reading LLaMA-Factory / ShareGPT style records: conversations with ``<image>`` placeholders and images.

The layout is read by :mod:`mm_core.data.records` (shared with mm-data-audio); what is ``vlm_sft``'s own is
here: the images (``images``, or LLaMA-Factory's ``image``), and records that are refused rather than skipped
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

__all__ = [
    "IMAGE_PLACEHOLDER",
    "RecordError",
    "conversation",
    "image_paths",
    "iter_records",
    "parse_record",
    "read_json_list",
    "read_record",
    "record_images",
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
