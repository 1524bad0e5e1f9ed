"""Reading data files as UTF-8 text: an error names the file, the line and the byte offset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mm_core.errors import DataError


def _not_utf8(path: Path, line: int, e: UnicodeDecodeError, offset: int) -> DataError:
    return DataError(
        f"{path}:{line}: not valid UTF-8 at byte offset {offset} ({e.reason}); save the file as UTF-8"
    )


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for each line of ``path`` (line endings kept), read lazily."""
    offset = 0  # byte offset of the line in the file
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, lineno, e, offset + e.start) from None
            offset += len(raw)
            yield lineno, line


def read_utf8(path: Path) -> str:
    """The whole of ``path`` as text."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw.count(b"\n", 0, e.start) + 1, e, e.start) from None
