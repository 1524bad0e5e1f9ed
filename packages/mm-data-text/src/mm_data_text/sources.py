"""Finding data files and reading documents from .txt, .jsonl and .parquet files."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mm_core.data.params import BASIC
from mm_core.data.textfile import read_utf8, utf8_lines
from mm_core.errors import ConfigError, DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def resolve_paths(
    spec: str | list[str], dataset_dir: str | None, suffixes: tuple[str, ...], key: str = f"{BASIC}.dataset"
) -> list[Path]:
    """Turn ``basic_parameters.dataset`` into a list of files, in the order given.

    Each entry is a file, a directory (all files below it with an accepted suffix, sorted) or a glob
    pattern (matches sorted). Relative entries are relative to ``dataset_dir`` when given, else to the
    current directory.
    """
    base = Path(dataset_dir) if dataset_dir else None
    if base is not None and not base.is_dir():
        raise ConfigError(f"{BASIC}.dataset_dir: got {dataset_dir!r}; expected an existing directory")
    entries = [spec] if isinstance(spec, str) else list(spec)
    where = (
        f" (relative to dataset_dir {str(base)!r})"
        if base is not None
        else " (relative to the current directory)"
    )
    files: list[Path] = []
    for entry in entries:
        path = Path(entry)
        if base is not None and not path.is_absolute():
            path = base / path
        if any(ch in entry for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(str(path), recursive=True)) if Path(m).is_file()]
            if not matches:
                raise ConfigError(f"{key}: pattern {entry!r} matches no file{where}")
            found = matches
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
            if not found:
                raise ConfigError(f"{key}: directory {str(path)!r} holds no {'/'.join(suffixes)} file")
        elif path.is_file():
            found = [path]
        else:
            raise ConfigError(f"{key}: {entry!r} does not exist{where}")
        for f in found:
            if f.suffix not in suffixes:
                raise ConfigError(
                    f"{key}: {str(f)!r} has an unsupported suffix; expected one of " + ", ".join(suffixes)
                )
        files.extend(found)
    return files


def dataset_entries(spec: str | list[str]) -> list[str]:
    """The entries of ``basic_parameters.dataset`` (each one a source for mixing)."""
    return [spec] if isinstance(spec, str) else list(spec)


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line; DataError names ``file:line``."""
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def _txt_documents(text: str, txt_document: str) -> list[str]:
    if txt_document == "file":
        return [text] if text.strip() else []
    docs: list[str] = []
    block: list[str] = []
    for line in text.splitlines():
        if line.strip():
            block.append(line)
        elif block:
            docs.append("\n".join(block))
            block = []
    if block:
        docs.append("\n".join(block))
    return docs


def _read_txt(path: Path, txt_document: str) -> list[str]:
    return _txt_documents(read_utf8(path), txt_document)


def _jsonl_text(path: Path, lineno: int, obj: dict[str, Any], text_key: str) -> str:
    if text_key not in obj:
        raise DataError(
            f'{path}:{lineno}: missing key "{text_key}" (keys present: {", ".join(obj) or "none"})'
        )
    value = obj[text_key]
    if not isinstance(value, str):
        raise DataError(f'{path}:{lineno}: "{text_key}" must be a string, got {type(value).__name__}')
    return value


def _read_jsonl(path: Path, text_key: str) -> list[str]:
    docs: list[str] = []
    for lineno, obj in iter_jsonl(path):
        value = _jsonl_text(path, lineno, obj, text_key)
        if value:
            docs.append(value)
    return docs


def _check_parquet_schema(path: Path, text_key: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as parquet: {e}") from None
    if text_key not in schema.names:
        raise DataError(f'{path}: missing column "{text_key}" (columns: {", ".join(schema.names)})')
    column_type = schema.field(text_key).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f'{path}: column "{text_key}" must hold strings, has type {column_type}')


def _read_parquet(path: Path, text_key: str) -> list[str]:
    import pyarrow.parquet as pq

    _check_parquet_schema(path, text_key)
    values = pq.read_table(path, columns=[text_key]).column(text_key).to_pylist()
    docs: list[str] = []
    for row, value in enumerate(values):
        if value is None:
            raise DataError(f'{path}: row {row}: "{text_key}" is null')
        if value:
            docs.append(value)
    return docs


def read_documents(path: Path, text_key: str = "text", txt_document: str = "blank_line") -> list[str]:
    """Read the non-empty documents of one file, in file order."""
    if path.suffix == ".txt":
        return _read_txt(path, txt_document)
    if path.suffix == ".jsonl":
        return _read_jsonl(path, text_key)
    if path.suffix == ".parquet":
        return _read_parquet(path, text_key)
    raise DataError(f"{path}: unsupported file type; expected one of {', '.join(TEXT_SUFFIXES)}")


#: the most text :func:`first_document` returns (a sample to tokenise, not the whole document)
FIRST_DOCUMENT_CHARS = 65536


def first_document(path: Path, text_key: str = "text", txt_document: str = "blank_line") -> str | None:
    """The start of the first non-empty document of one file (at most ``FIRST_DOCUMENT_CHARS``), read without
    reading the rest of the file; the same errors as :func:`read_documents` for what it reads. None when the
    file holds no document (for preflight checks: ``mm check`` reads this instead of the whole corpus)."""
    if path.suffix == ".jsonl":
        for lineno, obj in iter_jsonl(path):
            value = _jsonl_text(path, lineno, obj, text_key)
            if value:
                return value[:FIRST_DOCUMENT_CHARS]
        return None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        _check_parquet_schema(path, text_key)
        parquet = pq.ParquetFile(path)
        row = 0
        for group in range(parquet.num_row_groups):
            for value in parquet.read_row_group(group, columns=[text_key]).column(0).to_pylist():
                if value is None:
                    raise DataError(f'{path}: row {row}: "{text_key}" is null')
                if value:
                    return value[:FIRST_DOCUMENT_CHARS]
                row += 1
        return None
    if path.suffix == ".txt":
        lines: list[str] = []
        size = 0
        for _, line in utf8_lines(path):
            if txt_document == "blank_line" and not line.strip():
                if lines:
                    break
                continue
            lines.append(line)
            size += len(line)
            if size >= FIRST_DOCUMENT_CHARS:
                break
        text = "".join(lines)
        if txt_document == "blank_line":
            text = text.rstrip("\n")
        return text[:FIRST_DOCUMENT_CHARS] if text.strip() else None
    raise DataError(f"{path}: unsupported file type; expected one of {', '.join(TEXT_SUFFIXES)}")


def describe_files(files: list[Path]) -> str:
    """``N file(s), X MiB (first, ...)`` for ``mm check``."""
    size = sum(p.stat().st_size for p in files)
    more = ", ..." if len(files) > 1 else ""
    return f"{len(files)} file(s), {size / 2**20:.1f} MiB ({files[0]}{more})"
