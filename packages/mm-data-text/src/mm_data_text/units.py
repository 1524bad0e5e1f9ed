"""Cutting data files into work units that local processes prepare independently, and reading one unit.

A unit is a piece of one file that holds whole documents (records): a byte range of a ``.jsonl`` file that
starts and ends at line boundaries, a byte range of a ``.txt`` file that starts and ends right after a blank
line (so no document of the ``blank_line`` rule is cut), the whole of a ``.txt`` file read as one document,
or a run of row groups of a ``.parquet`` file. Reading the units of a file in order yields exactly the
documents of the whole file, so the prepared result does not depend on how many processes prepared it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mm_core.data.cache import parallel_map
from mm_core.errors import DataError

from .sources import _check_parquet_schema, _jsonl_text, _txt_documents, describe_files

logger = logging.getLogger(__name__)

#: source bytes per unit (a unit is the grain of parallel preparation and of one token shard)
UNIT_BYTES = 32 << 20
_SCAN = 1 << 22


@dataclass(frozen=True)
class Unit:
    """``path[start:end]`` (bytes, or row groups for parquet); ``first_line`` is the 1-based line number of
    ``start`` (the first row's index for parquet)."""

    path: str
    kind: str  # "lines" (jsonl), "blocks" (txt, blank_line), "file" (txt, one document), "parquet"
    start: int
    end: int
    first_line: int


def _count_newlines(f: Any, start: int, end: int) -> int:
    f.seek(start)
    count, left = 0, end - start
    while left > 0:
        chunk = f.read(min(_SCAN, left))
        if not chunk:
            break
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count


def _next_boundary(f: Any, pos: int, after_blank: bool) -> int:
    """The first line boundary at or after ``pos`` (after a blank line when ``after_blank``)."""
    f.seek(pos)
    if pos > 0:
        f.seek(pos - 1)
        if f.read(1) != b"\n":
            f.readline()  # finish the line ``pos`` falls in
    while after_blank:
        line = f.readline()
        if not line or not line.strip():
            break
    return int(f.tell())


def plan_units(path: Path, txt_document: str = "blank_line", unit_bytes: int | None = None) -> list[Unit]:
    """The units of one file, in order (see the module docstring)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    name = str(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        units, lo, row, size = [], 0, 0, 0
        first_row = 0
        for g in range(meta.num_row_groups):
            size += meta.row_group(g).total_byte_size
            row += meta.row_group(g).num_rows
            if size >= unit_bytes or g == meta.num_row_groups - 1:
                units.append(Unit(name, "parquet", lo, g + 1, first_row))
                lo, size, first_row = g + 1, 0, row
        return units
    total = path.stat().st_size
    if path.suffix == ".txt" and txt_document == "file":
        return [Unit(name, "file", 0, total, 1)]
    kind = "lines" if path.suffix == ".jsonl" else "blocks"
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + unit_bytes < total:
            nxt = _next_boundary(f, cuts[-1] + unit_bytes, kind == "blocks")
            if nxt >= total:
                break
            cuts.append(nxt)
        cuts.append(total)
        units, line = [], 1
        for lo, hi in zip(cuts, cuts[1:]):
            units.append(Unit(name, kind, lo, hi, line))
            line += _count_newlines(f, lo, hi)
    return units


def _text(unit: Unit, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = unit.first_line + raw.count(b"\n", 0, e.start)
        raise DataError(
            f"{unit.path}:{line}: not valid UTF-8 at byte offset {unit.start + e.start} ({e.reason}); "
            "save the file as UTF-8"
        ) from None


def _read(unit: Unit) -> bytes:
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        return f.read(unit.end - unit.start)


def unit_records(unit: Unit) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a jsonl unit; DataError names ``file:line``."""
    for i, line in enumerate(_text(unit, _read(unit)).split("\n")):
        if not line.strip():
            continue
        lineno = unit.first_line + i
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{unit.path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{unit.path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def unit_documents(unit: Unit, text_key: str = "text", txt_document: str = "blank_line") -> list[str]:
    """The non-empty documents of one unit, in file order."""
    if unit.kind == "lines":
        docs = []
        for lineno, obj in unit_records(unit):
            value = _jsonl_text(Path(unit.path), lineno, obj, text_key)
            if value:
                docs.append(value)
        return docs
    if unit.kind in ("blocks", "file"):
        return _txt_documents(_text(unit, _read(unit)), txt_document)
    import pyarrow.parquet as pq

    path = Path(unit.path)
    _check_parquet_schema(path, text_key)
    parquet = pq.ParquetFile(path)
    docs, row = [], unit.first_line
    for group in range(unit.start, unit.end):
        for value in parquet.read_row_group(group, columns=[text_key]).column(0).to_pylist():
            if value is None:
                raise DataError(f'{path}: row {row}: "{text_key}" is null')
            if value:
                docs.append(value)
            row += 1
    return docs


def prepare_units(
    name: str,
    task: Callable[[tuple[Unit, dict[str, Any], str, str]], Any],
    entry_files: list[list[Path]],
    settings: dict[str, Any],
    folder: Path,
    workers: int,
    txt_document: str = "blank_line",
) -> list[list[Any]]:
    """Cut every source's files into units, run ``task((unit, settings, folder, stem))`` on each across
    ``workers`` local processes (one shard ``s<source>-<unit>`` each), and return the results grouped by
    source, in order."""
    units = [[u for f in files for u in plan_units(f, txt_document)] for files in entry_files]
    tasks = [
        (u, settings, str(folder), f"s{s:03d}-{i:05d}")
        for s, source_units in enumerate(units)
        for i, u in enumerate(source_units)
    ]
    logger.info(
        "%s: preparing %s in %d unit(s) with %d process(es) into %s",
        name,
        describe_files([f for files in entry_files for f in files]),
        len(tasks),
        min(workers, len(tasks)),
        folder.parent,
    )
    done = parallel_map(task, tasks, workers)
    out, lo = [], 0
    for source_units in units:
        out.append(done[lo : lo + len(source_units)])
        lo += len(source_units)
    return out
