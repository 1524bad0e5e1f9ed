"""Reading LLaMA-Factory / ShareGPT style records: conversations with ``<image>`` placeholders and images."""

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


def iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each record; ``where`` is ``file:line`` (jsonl) or ``file[index]`` (json)."""
    if path.suffix == ".jsonl":
        for lineno, line in utf8_lines(path):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: a record must be a JSON object")
            yield where, obj
        return
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must hold a list of records")
    for i, obj in enumerate(data):
        if not isinstance(obj, dict):
            raise DataError(f"{path}[{i}]: a record must be a JSON object")
        yield f"{path}[{i}]", obj


def conversation(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The record's turns as ``{"role", "content"}``: ``messages`` (role/content) or ``conversations``
    (ShareGPT from/value with human/gpt/system)."""
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise DataError(
            f'{where}: no "messages" or "conversations" key (keys: {", ".join(record) or "none"})'
        )
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: the conversation must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turn {i} must be an object")
        # str(): an unhashable "from" value (a list, ...) is reported below as an unknown role, not a crash
        role = _SHAREGPT_ROLES.get(str(turn.get(role_key))) if role_key == "from" else turn.get(role_key)
        if role not in _ROLES:
            raise DataError(
                f"{where}: turn {i} has {role_key}={turn.get(role_key)!r}; expected a user, "
                "assistant or system turn"
            )
        text = turn.get(text_key)
        if not isinstance(text, str):
            raise DataError(f"{where}: turn {i}.{text_key} must be a string")
        out.append({"role": role, "content": text})
    if not any(t["role"] == "assistant" for t in out):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing would be trained")
    return out


def image_paths(record: dict[str, Any], where: str, dataset_dir: str | None) -> list[Path]:
    """The record's ``images`` (a list, or one string) resolved against ``dataset_dir``."""
    images = record.get("images", record.get("image", []))
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise DataError(f'{where}: "images" must be a list of image paths')
    base = Path(dataset_dir) if dataset_dir else Path(".")
    return [Path(p) if Path(p).is_absolute() else base / p for p in images]
