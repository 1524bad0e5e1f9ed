"""Reading records: LLaMA-Factory / ShareGPT style conversations with ``<audio>`` (and ``<image>``)
placeholders, and ASR manifest lines, both turned into one :class:`Record` (turns, audio paths, image paths).

A problem with one record's structure is a :class:`RecordError` saying what is wrong; the dataset, which knows
where the record is (``file:line`` for JSONL, ``file[index]`` for a JSON list), turns it into a ``DataError``
naming it. A problem with a whole file is a ``DataError`` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mm_core.data.textfile import read_utf8, utf8_lines
from mm_core.errors import ConfigError, DataError

AUDIO_PLACEHOLDER = "<audio>"
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


@dataclass(frozen=True, slots=True)
class Record:
    """One conversation: turns ``{"role", "content"}`` and the media its placeholders stand for, in order."""

    messages: tuple[dict[str, str], ...]
    audios: tuple[Path, ...]
    images: tuple[Path, ...]


def resolve_files(dataset: str | list[str], dataset_dir: str | None, key: str) -> list[Path]:
    """Files named by ``basic_parameters.dataset`` (relative paths start at ``dataset_dir``)."""
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


def parse_record(text: str) -> dict[str, Any]:
    """One record from its JSON text (a JSON object)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise RecordError("a record must be a JSON object")
    return obj


def iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(where, record)`` for each record, or ``(where, RecordError)`` for a line that is not a JSON object;
    ``where`` is ``file:line`` (jsonl) or ``file[index]`` (json). A ``.json`` file that is not a JSON list is
    a DataError naming it."""
    if path.suffix == ".jsonl":
        for lineno, line in utf8_lines(path):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", parse_record(line)
            except RecordError as e:
                yield f"{path}:{lineno}", e
        return
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must hold a list of records")
    for i, obj in enumerate(data):
        yield f"{path}[{i}]", obj if isinstance(obj, dict) else RecordError("a record must be a JSON object")


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


def _resolve(path: str, dataset_dir: str | None) -> Path:
    base = Path(dataset_dir) if dataset_dir else Path(".")
    return Path(path) if Path(path).is_absolute() else base / path


def record_paths(record: dict[str, Any], key: str, dataset_dir: str | None) -> list[Path]:
    """The record's ``key`` (``audios`` / ``images``: a list of paths, or one path), relative paths resolved
    against ``dataset_dir``."""
    value = record.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise RecordError(f'"{key}" must be a list of file paths')
    return [_resolve(p, dataset_dir) for p in value]


def check_placeholders(messages: list[dict[str, str]], audios: list[Path], images: list[Path]) -> None:
    """One ``<audio>`` per audio and one ``<image>`` per image, else a RecordError saying which disagree."""
    for placeholder, files, key in (
        (AUDIO_PLACEHOLDER, audios, "audios"),
        (IMAGE_PLACEHOLDER, images, "images"),
    ):
        found = sum(m["content"].count(placeholder) for m in messages)
        if found != len(files):
            raise RecordError(
                f'the conversation has {found} {placeholder} placeholder(s) but "{key}" lists {len(files)} '
                "file(s); they must match one to one, in order"
            )


def sft_record(record: dict[str, Any], dataset_dir: str | None) -> Record:
    """An ``audio_sft`` record: ``messages``/``conversations`` + ``audios`` (+ ``images``)."""
    messages = record_turns(record)
    audios = record_paths(record, "audios", dataset_dir)
    images = record_paths(record, "images", dataset_dir)
    check_placeholders(messages, audios, images)
    return Record(tuple(messages), tuple(audios), tuple(images))


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
    if AUDIO_PLACEHOLDER in parts[0] + parts[1] + text or IMAGE_PLACEHOLDER in parts[0] + parts[1] + text:
        raise RecordError(f"the transcript or prompt holds a {AUDIO_PLACEHOLDER} or {IMAGE_PLACEHOLDER} tag")
    messages = (
        {"role": "user", "content": AUDIO_PLACEHOLDER + parts[0]},
        {"role": "assistant", "content": parts[1] + text},
    )
    return Record(messages, (_resolve(audio, dataset_dir),), ())
