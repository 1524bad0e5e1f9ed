"""Reading LLaMA-Factory / ShareGPT style records: conversations (``messages`` or ``conversations``) whose
``<image>`` / ``<audio>`` placeholders stand for the files a record lists, in JSON or JSONL files.

Shared by the data plugins that read this layout (mm-data-vlm's ``vlm_sft``, mm-data-audio's ``audio_sft``),
which may not import each other. A problem with one record's structure is a :class:`RecordError` saying what
is wrong; whoever knows where the record is (``file:line`` for JSONL, ``file[index]`` for a JSON list) turns
it into a ``DataError`` naming it. A problem with a whole file is a ``DataError`` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mm_core.data.textfile import read_utf8, utf8_lines
from mm_core.errors import ConfigError, DataError

#: the placeholder of one image in a turn's text (LLaMA-Factory's)
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


class RecordError(ValueError):
    """A record's structure is invalid; the message says what, the caller adds where (``file:line``)."""


def resolve_path(path: str, dataset_dir: str | None) -> Path:
    """``path`` as given when absolute, else relative to ``dataset_dir`` (the current directory when None)."""
    base = Path(dataset_dir) if dataset_dir else Path(".")
    return Path(path) if Path(path).is_absolute() else base / path


def resolve_files(dataset: str | list[str], dataset_dir: str | None, key: str) -> list[Path]:
    """Files named by ``basic_parameters.dataset`` (relative paths start at ``dataset_dir``); a ConfigError
    naming ``key`` for a missing file or one that is not ``.json`` / ``.jsonl``."""
    names = [dataset] if isinstance(dataset, str) else list(dataset)
    files = []
    for name in names:
        path = resolve_path(name, dataset_dir)
        if not path.is_file():
            raise ConfigError(f"{key}: {str(path)!r} is not a file (relative paths start at dataset_dir)")
        if path.suffix not in (".json", ".jsonl"):
            raise ConfigError(f"{key}: {str(path)!r} must be a .json (a list of records) or .jsonl file")
        files.append(path)
    return files


def parse_record(text: str) -> dict[str, Any]:
    """One record from its JSON text (a JSON object)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise RecordError("a record must be a JSON object")
    return obj


def read_json_list(path: Path) -> list[Any]:
    """The list a ``.json`` dataset file holds (items unchecked); else a DataError naming the file."""
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must hold a list of records")
    return data


def iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(where, record)`` for each record, or ``(where, RecordError)`` for one that is not a JSON object (so
    a caller may refuse it or skip it); ``where`` is ``file:line`` (jsonl) or ``file[index]`` (json). A
    ``.json`` file that is not a JSON list is a DataError naming it."""
    if path.suffix == ".jsonl":
        for lineno, line in utf8_lines(path):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", parse_record(line)
            except RecordError as e:
                yield f"{path}:{lineno}", e
        return
    for i, obj in enumerate(read_json_list(path)):
        yield f"{path}[{i}]", obj if isinstance(obj, dict) else RecordError("a record must be a JSON object")


def iter_store_index(index: Path, required: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The records of a sample store's ``index.jsonl`` (mm-data-video's latent stores, mm-models-cosyvoice's
    speech stores): ``(where, record)`` for each JSON object, ``where`` being ``index:line (id)``. Each must
    hold the ``required`` keys and an ``id``, a non-empty string no other line has; anything else is a
    DataError naming the line."""
    seen: dict[str, str] = {}
    with index.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{index}:{line_no}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{where}: not a JSON object ({exc})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in ("id", *required) if k not in obj]
            if missing:
                raise DataError(f"{where}: missing {', '.join(missing)}")
            sid = obj["id"]
            if not isinstance(sid, str) or not sid:
                raise DataError(f"{where}: id must be a non-empty string, got {sid!r}")
            where = f"{where} ({sid})"
            if sid in seen:
                raise DataError(f"{where}: id {sid!r} is also at {seen[sid]}")
            seen[sid] = where
            yield where, obj


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
        out.append({"role": str(role), "content": text})
    if not any(t["role"] == "assistant" for t in out):
        raise RecordError("the conversation has no assistant turn, so nothing would be trained")
    return out


def record_paths(value: Any, key: str, dataset_dir: str | None, kind: str = "file") -> list[Path]:
    """The files a record lists under ``key`` (``value``: a list of paths, or one path), relative paths
    resolved against ``dataset_dir``; a RecordError saying ``"key" must be a list of <kind> paths``."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise RecordError(f'"{key}" must be a list of {kind} paths')
    return [resolve_path(p, dataset_dir) for p in value]
