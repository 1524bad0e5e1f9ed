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

Optional, for audio-video models (LTX-2's joint audio + video training), per record:

- ``audio_latents`` + ``audio_latent_shape`` ``[C, L, M]``: the audio VAE's normalised latents (channels,
  latent frames, latent mel bins), float32;
- ``audio_text`` + ``audio_text_shape`` ``[L, D]``: a second text embedding for the audio stream (LTX-2: the
  audio text connector's output, the ``text`` array being the video connector's), with the same number of
  tokens as ``text`` (one mask serves both).

A record without them is video-only (Wan, or LTX-2 text-to-video); a store may mix both kinds (they fall in
different buckets).

Samples are read with ``numpy.load(mmap_mode="r")``: only the pages of the sample being read are loaded, so
a store of any size costs no memory until used. Every problem is a :class:`~mm_core.errors.DataError` naming
the record as ``index.jsonl:line (id)``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mm_core.data.records import iter_store_index
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
    audio_latents: Path | None = None
    audio_latent_shape: tuple[int, int, int] | None = None
    audio_text: Path | None = None
    audio_text_shape: tuple[int, int] | None = None


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


def _audio_fields(root: Path, obj: dict[str, Any], text_shape: tuple[int, ...], where: str) -> dict[str, Any]:
    """The optional audio fields of a record (module docstring), checked; {} for a video-only record."""
    out: dict[str, Any] = {}
    for key, shape_key, rank in (
        ("audio_latents", "audio_latent_shape", 3),
        ("audio_text", "audio_text_shape", 2),
    ):
        if key not in obj and shape_key not in obj:
            continue
        if key not in obj or shape_key not in obj:
            raise DataError(f"{where}: {key} and {shape_key} go together; got only one of them")
        out[key] = _relative(root, obj[key], key, where)
        out[shape_key] = _shape(obj[shape_key], rank, shape_key, where)
    if "audio_text" in out and "audio_latents" not in out:
        raise DataError(
            f"{where}: audio_text without audio_latents; the audio text belongs to an audio stream"
        )
    text_tokens = out.get("audio_text_shape", text_shape)[0]
    if text_tokens != text_shape[0]:
        raise DataError(
            f"{where}: audio_text_shape has {text_tokens} tokens, text_shape {text_shape[0]}; the two text "
            "embeddings of a sample share one mask and must have the same length"
        )
    return out


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
    for where, obj in iter_store_index(index, ("latents", "text", "latent_shape", "text_shape")):
        caption = obj.get("caption", "")
        if not isinstance(caption, str):
            raise DataError(f"{where}: caption must be a string, got {caption!r}")
        latent_shape = _shape(obj["latent_shape"], 4, "latent_shape", where)
        text_shape = _shape(obj["text_shape"], 2, "text_shape", where)
        audio = _audio_fields(root, obj, text_shape, where)
        records.append(
            LatentRecord(
                where=where,
                id=obj["id"],
                caption=caption,
                latents=_relative(root, obj["latents"], "latents", where),
                text=_relative(root, obj["text"], "text", where),
                latent_shape=latent_shape,  # type: ignore[arg-type]  # rank checked by _shape
                text_shape=text_shape,  # type: ignore[arg-type]  # rank checked by _shape
                **audio,
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


_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]+$")


def _save(path: Path, array: torch.Tensor | npt.NDArray[Any], what: str, sample_id: str) -> list[int]:
    data = np.asarray(array.detach().float().cpu() if isinstance(array, torch.Tensor) else array, np.float32)
    if not np.isfinite(data).all():
        raise DataError(f"clip {sample_id!r}: the {what} hold NaN/inf; check the model and the input")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, data)
    return [int(s) for s in data.shape]


class StoreWriter:
    """Writes a new latent store (the layout above) sample by sample: :meth:`add` saves a sample's arrays,
    :meth:`finish` writes ``meta.json`` and then ``index.jsonl`` (atomically, last: a store is complete once
    its index exists). :func:`mm_data_video.encode_clips` writes through it; so can any encoder of one's own
    (e.g. LTX-2's audio VAE and text connectors)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        if (self.out / INDEX).exists():
            raise DataError(f"{self.out}: already holds a latent store ({INDEX}); choose a new folder")
        self.lines: list[str] = []
        self.seen: set[str] = set()
        self.dims: dict[str, int] = {}

    def check_id(self, sample_id: str) -> None:
        """A DataError for an id that cannot name files or is already in the store."""
        if not _SAFE_ID.match(sample_id) or sample_id in self.seen:
            why = (
                "is used twice"
                if sample_id in self.seen
                else "may only hold letters, digits, '.', '_' and '-'"
            )
            raise DataError(f"clip id {sample_id!r} {why}")

    def _same(self, key: str, value: int, sample_id: str) -> None:
        if self.dims.setdefault(key, value) != value:
            raise DataError(f"clip {sample_id!r}: {key} {value}, earlier samples had {self.dims[key]}")

    def add(
        self,
        sample_id: str,
        caption: str,
        latents: torch.Tensor,
        text: torch.Tensor,
        audio_latents: torch.Tensor | None = None,
        audio_text: torch.Tensor | None = None,
    ) -> None:
        """Save one sample: ``latents`` [C, F, H, W], ``text`` [L, D] (its real tokens), optionally
        ``audio_latents`` [C_a, L_a, M] and ``audio_text`` [L, D_a]."""
        self.check_id(sample_id)
        shapes = {"latents": (latents, 4), "text": (text, 2), "audio_latents": (audio_latents, 3)}
        shapes["audio_text"] = (audio_text, 2)
        for key, (value, rank) in shapes.items():
            if value is not None and (value.dim() != rank or 0 in value.shape):
                raise DataError(
                    f"clip {sample_id!r}: {key} of shape {list(value.shape)}; expected {rank} dims"
                )
        if audio_text is not None and (audio_latents is None or audio_text.shape[0] != text.shape[0]):
            raise DataError(
                f"clip {sample_id!r}: audio_text needs audio_latents and as many tokens as text "
                f"({text.shape[0]})"
            )
        self._same("latent channels", int(latents.shape[0]), sample_id)
        self._same("text dim", int(text.shape[1]), sample_id)
        record: dict[str, Any] = {"id": sample_id, "caption": caption}
        arrays = {"latents": latents, "text": text, "audio_latents": audio_latents, "audio_text": audio_text}
        names = {"latents": "latents", "text": "text embeddings"}
        for key, value in arrays.items():
            if value is None:
                continue
            rel = f"{key}/{sample_id}.npy"
            shape = _save(self.out / rel, value, names.get(key, key.replace("_", " ")), sample_id)
            shape_key = {"latents": "latent_shape", "audio_latents": "audio_latent_shape"}.get(
                key, f"{key}_shape"
            )
            record.update({key: rel, shape_key: shape})
        self.seen.add(sample_id)
        self.lines.append(json.dumps(record, ensure_ascii=False))

    def finish(self, meta: Mapping[str, Any]) -> Path:
        """Write ``meta.json`` (``meta`` plus the format and the dimensions seen) and then the index; returns
        the path of ``index.jsonl``."""
        if not self.lines:
            raise DataError(f"{self.out}: no sample was added; a latent store needs at least one")
        info = {"format": STORE_FORMAT, **meta}
        info.setdefault("latent_channels", self.dims["latent channels"])
        info.setdefault("text_dim", self.dims["text dim"])
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / META).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        partial = self.out / (INDEX + ".partial")
        partial.write_text("\n".join(self.lines) + "\n", encoding="utf-8")
        os.replace(partial, self.out / INDEX)
        return self.out / INDEX
