"""The record index of ``vlm_sft``: where each record is and how many tokens it makes, prepared once.

Preparation (:func:`build_index`, run by :func:`mm_core.data.cache.open_cache` under its lock) writes into
the cache folder one ``.npy`` column per property, one entry per record (records in source order, then file
order; blank lines are not records):

- ``offset.npy``, ``nbytes.npy`` (int64): the record's bytes in its *data file*, which is the ``.jsonl``
  source itself, or ``s<k>.jsonl`` in the cache folder: a ``.json`` source (one JSON list) is parsed once and
  copied there as JSONL, one record per line;
- ``line.npy`` (int64): the record's line in a ``.jsonl`` source (messages say ``file:line``) or its index in
  a ``.json`` list (``file[index]``);
- ``tokens.npy`` (int32): the sample's tokens as the collator sees them, image placeholder tokens included
  (0 for a record that cannot be used);
- ``status.npy`` (uint8): :data:`OK`, or why the record cannot be used: :data:`INVALID` (not UTF-8, not
  JSON, not a conversation), :data:`MISSING_IMAGE`, :data:`REFUSED` (an image refused from its header or by
  the processor's resize rule, or a conversation that does not encode);
- ``problems.txt``: for every record that is not OK, in order, its message as one JSON string per line
  (without the ``file:line``, which the reader adds: configs that name the same files differently share the
  cache); ``problem_record.npy`` (int64) holds those records' indices and ``problem_offset.npy`` (int64) the
  byte offset of each line (the file size last): a message is one search and one ``pread`` away.

A record's tokens are counted without decoding a pixel: each image's size is read from its header as
:func:`~mm_data_vlm.images.load_image` will hand it to the processor
(:func:`~mm_data_vlm.images.loaded_size`), each video's frame count, frame rate and size from its
container header (:func:`~mm_data_vlm.videos.probe_video`; a missing video is ``MISSING_IMAGE``, a video
refused from its header ``REFUSED``), and the conversation is encoded with those sizes through
:meth:`~mm_data_vlm.encode.VisionProcessor.encode_sizes`, the path training takes (the family's image format
turns a size into placeholder tokens by the image processor's own resize rule).
Images are not stamped in the cache manifest (there can be millions): training reads them again and checks
every sample against its prepared length.

The work is cut into units of whole lines of about :data:`UNIT_BYTES` (a small file is one unit) that run in
parallel across local processes (:func:`mm_core.data.cache.parallel_map`); a unit does not know the line its
bytes start at, so it reports lines counted from its start and the total is fixed up afterwards.

:class:`RecordIndex` reads a prepared index: memory-mapped columns (opened on first use in each process, never
pickled to DataLoader workers) and one ``pread`` of a record's bytes per sample.
"""

from __future__ import annotations

import json
import os
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mm_core.data.cache import parallel_map
from mm_core.data.params import BASIC

from .encode import EncodeError, VideoOptions, VisionProcessor
from .images import loaded_size
from .records import RecordError, parse_record, read_json_list, read_media
from .videos import probe_video

#: bumped whenever the files above change meaning, so an old index is never misread
INDEX_FORMAT = 1
#: a work unit: whole lines from about this many bytes of a data file
UNIT_BYTES = 4 << 20

OK, INVALID, MISSING_IMAGE, REFUSED = 0, 1, 2, 3
STATUS_NAMES = {OK: "ok", INVALID: "invalid", MISSING_IMAGE: "missing image", REFUSED: "refused"}
COLUMNS = {"offset": np.int64, "nbytes": np.int64, "line": np.int64, "tokens": np.int32, "status": np.uint8}
PROBLEMS = "problems.txt"


@dataclass(frozen=True)
class IndexSettings:
    """What a record's status and tokens depend on besides the record (all of it is in the cache spec)."""

    processor: str  # preprocess_parameters.model_name_or_path
    min_pixels: int | None
    max_pixels: int | None
    max_source_pixels: int | None
    dataset_dir: str | None  # image and video paths are relative to it
    video: VideoOptions = VideoOptions()
    video_max_source_frames: int | None = None
    video_max_source_pixels: int | None = None


@dataclass(frozen=True)
class Unit:
    """Bytes ``[lo, hi)`` (whole lines) of the data file of source ``source``."""

    source: int
    data: str
    lo: int
    hi: int


def missing_image(image: Path, kind: str = "image") -> str:
    return (
        f"{kind} {image} does not exist (paths are relative to {BASIC}.dataset_dir; "
        "data.dataset_param.on_error: skip skips such records)"
    )


_PROCESSORS: dict[tuple[str, int | None, int | None, VideoOptions], VisionProcessor] = {}


def processor_for(settings: IndexSettings, loaded: VisionProcessor | None = None) -> VisionProcessor:
    """The processor of ``settings``, loaded once per process (``loaded``: one already loaded here)."""
    key = (settings.processor, settings.min_pixels, settings.max_pixels, settings.video)
    if loaded is not None:
        _PROCESSORS[key] = loaded
    if key not in _PROCESSORS:
        _PROCESSORS[key] = VisionProcessor.load(
            settings.processor,
            settings.min_pixels,
            settings.max_pixels,
            "data.dataset_param.preprocess_parameters",
            settings.video,
        )
    return _PROCESSORS[key]


def count_record(text: str, settings: IndexSettings, processor: VisionProcessor) -> tuple[int, int, str]:
    """``(status, tokens, problem)`` of one record's JSON text; no image or video is decoded."""
    from PIL import Image

    try:
        messages, images, videos = read_media(parse_record(text), settings.dataset_dir)
    except RecordError as e:
        return INVALID, 0, str(e)
    for image in images:
        if not image.is_file():
            return MISSING_IMAGE, 0, missing_image(image)
    for video in videos:
        if not video.is_file():
            return MISSING_IMAGE, 0, missing_image(video, "video")
    try:
        sizes = []
        for image in images:
            # Pillow warns (or raises, under -W error) of a possible bomb when it opens a large header; the
            # prepared result must not depend on the warning filters of whoever prepared it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                size = loaded_size(
                    image, max_source_pixels=settings.max_source_pixels, target_pixels=processor.target_pixels
                )
            sizes.append(size)
        headers = [
            probe_video(
                video,
                max_source_frames=settings.video_max_source_frames,
                max_source_pixels=settings.video_max_source_pixels,
            )
            for video in videos
        ]
        ids, _ = processor.encode_sizes(messages, sizes, processor.video_plans(headers))
    except (OSError, EncodeError) as e:
        return REFUSED, 0, str(e)
    return OK, len(ids), ""


def index_unit(task: tuple[Unit, IndexSettings]) -> dict[str, Any]:
    """Index and count the records of one unit (runs in a preparation process). Lines are numbered from the
    unit's start; ``lines`` is how many it holds."""
    unit, settings = task
    processor = processor_for(settings)
    with open(unit.data, "rb") as f:
        f.seek(unit.lo)
        buf = f.read(unit.hi - unit.lo)
    cols = {name: array("q") for name in ("offset", "nbytes", "line", "tokens")}
    status = array("B")
    problems: list[tuple[int, str]] = []
    start = line = 0
    while start < len(buf):
        end = buf.find(b"\n", start)
        end = len(buf) if end < 0 else end + 1
        line += 1
        try:
            text = buf[start:end].decode("utf-8")
        except UnicodeDecodeError as e:
            state, tokens = INVALID, 0
            at = unit.lo + start + e.start
            problem = f"not valid UTF-8 at byte offset {at} ({e.reason}); save the file as UTF-8"
        else:
            if not text.strip():
                start = end
                continue
            state, tokens, problem = count_record(text, settings, processor)
        if problem:
            problems.append((len(status), problem))
        for name, value in (
            ("offset", unit.lo + start),
            ("nbytes", end - start),
            ("line", line),
            ("tokens", tokens),
        ):
            cols[name].append(value)
        status.append(state)
        start = end
    out: dict[str, Any] = {name: np.frombuffer(cols[name], np.int64).astype(COLUMNS[name]) for name in cols}
    out["status"] = np.frombuffer(status, np.uint8).copy()
    out["lines"], out["problems"] = line, problems
    return out


def copy_json(task: tuple[str, str]) -> int:
    """Parse a ``.json`` source (one list) and write its items as JSONL, one per line; returns how many."""
    source, copy = task
    items = read_json_list(Path(source))
    with open(copy, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False, separators=(",", ":")))
            f.write("\n")
    return len(items)


def plan_units(source: int, data: Path, unit_bytes: int | None = None) -> list[Unit]:
    """``data`` cut into units of whole lines of about ``unit_bytes`` (default :data:`UNIT_BYTES`; reads one
    line per cut)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    size = data.stat().st_size
    units: list[Unit] = []
    lo = 0
    with open(data, "rb") as f:
        while lo < size:
            hi = lo + unit_bytes
            if hi < size:
                f.seek(hi - 1)
                f.readline()  # to the end of the line that holds byte hi - 1
                hi = f.tell()
            hi = min(hi, size)
            units.append(Unit(source, str(data), lo, hi))
            lo = hi
    return units


def build_index(
    folder: Path, files: Sequence[Path], settings: IndexSettings, workers: int, processor: VisionProcessor
) -> dict[str, Any]:
    """Write the index of ``files`` (one source each) into ``folder``; returns the manifest payload."""
    processor_for(settings, processor)  # units that run in this process reuse the loaded processor
    copies = {s: f"s{s:03d}.jsonl" for s, path in enumerate(files) if path.suffix == ".json"}
    parallel_map(copy_json, [(str(files[s]), str(folder / name)) for s, name in copies.items()], workers)
    data = [folder / copies[s] if s in copies else path for s, path in enumerate(files)]
    units = [u for s, path in enumerate(data) for u in plan_units(s, path)]
    results = parallel_map(index_unit, [(u, settings) for u in units], workers)
    columns: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
    problem_records: list[int] = []
    problem_offsets = [0]
    records = [0] * len(files)
    lines_before = [0] * len(files)  # lines of the source's earlier units
    total = 0
    with open(folder / PROBLEMS, "wb") as messages:
        for unit, result in zip(units, results):
            s = unit.source
            # lines counted from the unit's start -> from the file's; a copy's line k is list index k - 1
            result["line"] += lines_before[s] - (1 if s in copies else 0)
            lines_before[s] += result["lines"]
            for i, message in result["problems"]:
                line = (json.dumps(message, ensure_ascii=False) + "\n").encode("utf-8")
                messages.write(line)
                problem_records.append(total + i)
                problem_offsets.append(problem_offsets[-1] + len(line))
            for name in COLUMNS:
                columns[name].append(result[name])
            n = len(result["status"])
            records[s] += n
            total += n
    for name, dtype in COLUMNS.items():
        np.save(folder / f"{name}.npy", np.concatenate(columns[name]) if units else np.zeros(0, dtype))
    np.save(folder / "problem_record.npy", np.array(problem_records, dtype=np.int64))
    np.save(folder / "problem_offset.npy", np.array(problem_offsets, dtype=np.int64))
    status = np.concatenate(columns["status"]) if units else np.zeros(0, np.uint8)
    counts = {STATUS_NAMES[k]: int(v) for k, v in zip(*np.unique(status, return_counts=True))}
    return {
        "index_format": INDEX_FORMAT,
        "records": total,
        "sources": [{"records": n, "copy": copies.get(s)} for s, n in enumerate(records)],
        "status": counts,
        "units": len(units),
    }


class RecordIndex:
    """A prepared index read back: memory-mapped columns and each record's bytes on demand.

    ``files`` are the sources as configured (``file:line`` in messages, and the data files of ``.jsonl``
    sources); the payload is :func:`build_index`'s."""

    def __init__(self, folder: Path, payload: dict[str, Any], files: Sequence[Path]) -> None:
        self.folder, self.files = Path(folder), list(files)
        sources = payload["sources"]
        self.source_sizes = [int(s["records"]) for s in sources]
        self.base = np.concatenate([[0], np.cumsum(self.source_sizes)]).astype(np.int64)
        self.data = [self.folder / s["copy"] if s["copy"] else f for s, f in zip(sources, self.files)]
        self._maps: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}  # each process maps the files itself
        return state

    def __len__(self) -> int:
        return int(self.base[-1])

    def column(self, name: str) -> np.ndarray:
        """One of :data:`COLUMNS` (or ``problem_record``, ``problem_offset``), memory-mapped."""
        arr = self._maps.get(name)
        if arr is None:
            arr = self._maps[name] = np.load(self.folder / f"{name}.npy", mmap_mode="r")
        return arr

    def source(self, index: int) -> int:
        return int(np.searchsorted(self.base, index, side="right")) - 1

    def where(self, index: int) -> str:
        """``file:line`` (``.jsonl``) or ``file[index]`` (``.json``) of record ``index``."""
        path, line = self.files[self.source(index)], int(self.column("line")[index])
        return f"{path}[{line}]" if path.suffix == ".json" else f"{path}:{line}"

    def problem(self, index: int) -> str:
        """Why record ``index`` cannot be used (its status is not OK)."""
        records = self.column("problem_record")
        k = int(np.searchsorted(records, index))
        if k == len(records) or records[k] != index:
            return "no problem was recorded for it at preparation"
        offsets = self.column("problem_offset")
        message: str = json.loads(
            _pread(self.folder / PROBLEMS, int(offsets[k]), int(offsets[k + 1] - offsets[k]))
        )
        return message

    def text(self, index: int) -> str:
        """Record ``index``'s JSON text, read from its data file."""
        offset, nbytes = int(self.column("offset")[index]), int(self.column("nbytes")[index])
        return _pread(self.data[self.source(index)], offset, nbytes).decode("utf-8", errors="replace")


def _pread(path: Path, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
