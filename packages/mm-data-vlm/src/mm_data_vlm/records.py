"""Reading LLaMA-Factory / ShareGPT style records: conversations with ``<image>`` placeholders and images.

A problem with one record's structure is a :class:`RecordError` saying what is wrong; whoever knows where the
record is (``file:line``, ``file[index]``) turns it into a ``DataError`` naming it (:func:`conversation` and
:func:`image_paths` do so for a given ``where``). A problem with a whole file is a ``DataError`` naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mm_core.data.textfile import read_utf8, utf8_lines
from mm_core.errors import ConfigError, DataError

IMAGE_PLACEHOLDER = "<image>"
# ShareGPT speaker names -> chat roles
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_ROLES = ("system", "user", "assistant")


def resolve_files(dataset: str | list[str], dataset_dir: str | None, key: str) -> list[Path]:
    """Files named by ``basic_parameters.dataset`` (paths relative to ``dataset_dir``)."""
    names = [dataset] if isinstance(dataset, str) else list(dataset)
    base = Path(dataset_dir) if dataset_dir else Path(".")
    files = []
    for name in names:
        path = Path(name) if Path(name).is_absolute() else base / name
        if not path.is_file():
            raise ConfigError(f"{key}: {str(path)!r} is not a file (relative paths start at dataset_dir)")
        if path.suffix not in (".json", ".jsonl"):
            raise ConfigError(f"{key}: {str(path)!r} must be a .json (a list of records) or .jsonl file")
        files.append(path)
    return files


class RecordError(ValueError):
    """A record's structure is invalid; the message says what, the caller adds where (``file:line``)."""


def parse_record(text: str) -> dict[str, Any]:
    """One record from its JSON text (a JSON object)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise RecordError("a record must be a JSON object")
    return obj


def iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each record; ``where`` is ``file:line`` (jsonl) or ``file[index]`` (json)."""
    if path.suffix == ".jsonl":
        for lineno, line in utf8_lines(path):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = parse_record(line)
            except RecordError as e:
                raise DataError(f"{where}: {e}") from None
            yield where, obj
        return
    for i, obj in enumerate(read_json_list(path)):
        if not isinstance(obj, dict):
            raise DataError(f"{path}[{i}]: a record must be a JSON object")
        yield f"{path}[{i}]", obj


def read_json_list(path: Path) -> list[Any]:
    """The list a ``.json`` dataset file holds (items unchecked); else a DataError naming the file."""
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must hold a list of records")
    return data


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


def record_turns(record: dict[str, Any]) -> list[dict[str, str]]:
    """The record's turns as ``{"role", "content"}``: ``messages`` (role/content) or ``conversations``
    (ShareGPT from/value with human/gpt/system)."""
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise RecordError(f'no "messages" or "conversations" key (keys: {", ".join(record) or "none"})')
    if not isinstance(turns, list) or not turns:
        raise RecordError("the conversation must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"turn {i} must be an object")
        # str(): an unhashable "from" value (a list, ...) is reported below as an unknown role, not a crash
        role = _SHAREGPT_ROLES.get(str(turn.get(role_key))) if role_key == "from" else turn.get(role_key)
        if role not in _ROLES:
            raise RecordError(
                f"turn {i} has {role_key}={turn.get(role_key)!r}; expected a user, assistant or system turn"
            )
        text = turn.get(text_key)
        if not isinstance(text, str):
            raise RecordError(f"turn {i}.{text_key} must be a string")
        out.append({"role": role, "content": text})
    if not any(t["role"] == "assistant" for t in out):
        raise RecordError("the conversation has no assistant turn, so nothing would be trained")
    return out


def record_images(record: dict[str, Any], dataset_dir: str | None) -> list[Path]:
    """The record's ``images`` (a list, or one string) resolved against ``dataset_dir``."""
    images = record.get("images", record.get("image", []))
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise RecordError('"images" must be a list of image paths')
    base = Path(dataset_dir) if dataset_dir else Path(".")
    return [Path(p) if Path(p).is_absolute() else base / p for p in images]
