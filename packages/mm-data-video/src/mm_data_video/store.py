"""The on-disk layout of precomputed video latents and text embeddings, and reading it back with checks.

A *latent store* is a folder written once by :func:`mm_data_video.encode.encode_clips`:

- ``index.jsonl``: one JSON object per sample: ``id`` (unique text), ``caption``, ``latents`` and ``text``
  (paths relative to the folder of ``.npy`` files), ``latent_shape`` ``[C, F, H, W]`` and ``text_shape``
  ``[L, D]``;
- ``latents/<id>.npy``: float32 ``[C, F, H, W]``, the VAE's latent mean, normalised as the transformer sees
  it (``(z − latents_mean) / latents_std``);
- ``text/<id>.npy``: float32 ``[L, D]``, the text encoder's output for the caption's ``L`` real tokens (the
  dataset pads it with zeros, as Wan's pipeline does);
- ``meta.json``: what produced them (``format``, the VAE's compression factors and latent channels, the text
  dimension).

Samples are read with ``numpy.load(mmap_mode="r")``: only the pages of the sample being read are loaded, so
a store of any size costs no memory until used. Every problem is a :class:`~mm_core.errors.DataError` naming
the record as ``index.jsonl:line (id)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mm_core.errors import DataError

INDEX = "index.jsonl"
META = "meta.json"
#: bumped when the layout above changes meaning
STORE_FORMAT = 1


@dataclass(frozen=True)
class LatentRecord:
    """One sample of a store: where its arrays are and the shapes the index promises."""

    where: str  # "<store>/index.jsonl:<line> (<id>)", for messages
    id: str
    caption: str
    latents: Path
    text: Path
    latent_shape: tuple[int, int, int, int]
    text_shape: tuple[int, int]


def _shape(value: Any, rank: int, key: str, where: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) != rank
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise DataError(f"{where}: {key} must be a list of {rank} positive integers, got {value!r}")
    return tuple(value)


def _relative(root: Path, value: Any, key: str, where: str) -> Path:
    if not isinstance(value, str) or not value or Path(value).is_absolute() or ".." in Path(value).parts:
        raise DataError(f"{where}: {key} must be a path inside the store, relative to it; got {value!r}")
    return root / value


def read_index(root: str | Path) -> list[LatentRecord]:
    """The records of the store at ``root`` (checked: fields, types, unique ids; not the files)."""
    root = Path(root)
    index = root / INDEX
    if not index.is_file():
        raise DataError(
            f"{root}: no {INDEX}; a latent store is written by mm_data_video.encode_clips (see its README)"
        )
    meta = root / META
    if meta.is_file():
        fmt = json.loads(meta.read_text(encoding="utf-8")).get("format")
        if fmt != STORE_FORMAT:
            raise DataError(f"{meta}: store format {fmt!r}; this mm-data-video reads format {STORE_FORMAT}")
    records: list[LatentRecord] = []
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
            missing = [k for k in ("id", "latents", "text", "latent_shape", "text_shape") if k not in obj]
            if missing:
                raise DataError(f"{where}: missing {', '.join(missing)}")
            sid = obj["id"]
            if not isinstance(sid, str) or not sid:
                raise DataError(f"{where}: id must be a non-empty string, got {sid!r}")
            where = f"{where} ({sid})"
            if sid in seen:
                raise DataError(f"{where}: id {sid!r} is also at {seen[sid]}")
            seen[sid] = where
            caption = obj.get("caption", "")
            if not isinstance(caption, str):
                raise DataError(f"{where}: caption must be a string, got {caption!r}")
            latent_shape = _shape(obj["latent_shape"], 4, "latent_shape", where)
            text_shape = _shape(obj["text_shape"], 2, "text_shape", where)
            records.append(
                LatentRecord(
                    where=where,
                    id=sid,
                    caption=caption,
                    latents=_relative(root, obj["latents"], "latents", where),
                    text=_relative(root, obj["text"], "text", where),
                    latent_shape=latent_shape,  # type: ignore[arg-type]  # rank checked by _shape
                    text_shape=text_shape,  # type: ignore[arg-type]  # rank checked by _shape
                )
            )
    if not records:
        raise DataError(f"{index}: holds no record")
    return records


def load_array(path: Path, shape: tuple[int, ...], what: str, where: str) -> npt.NDArray[np.float32]:
    """The ``.npy`` array at ``path`` as float32, checked against ``shape`` and for NaN/inf."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{where}: {what} file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: {what} file {path} is not a readable .npy array ({exc})") from None
    if tuple(arr.shape) != tuple(shape):
        raise DataError(f"{where}: {what} {path} has shape {tuple(arr.shape)}, the index says {tuple(shape)}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise DataError(f"{where}: {what} {path} holds {arr.dtype}, expected floating-point values")
    out = np.array(arr, dtype=np.float32)  # the sample's pages only, copied out of the map
    if not np.isfinite(out).all():
        bad = int((~np.isfinite(out)).sum())
        raise DataError(f"{where}: {what} {path} holds {bad} NaN/inf values of {out.size}")
    return out
