"""Read DCP checkpoints as data: a restricted unpickler for ``.metadata``, tensors only, one-line errors.

A checkpoint is data, never code. DCP stores its ``.metadata`` as a pickle and reads it back with
``pickle.load``, and reads any value stored as bytes with ``torch.load`` and ``weights_only=False``; either
would run whatever a crafted file asks for. Every read mm makes goes through this module instead:

- :func:`read_metadata` unpickles ``.metadata`` with an unpickler that admits only DCP's metadata classes,
  ``torch.Size``, torch dtypes and layouts, paths and plain containers; anything else is refused, naming the
  file and the class, before it is imported or called. It then checks the structure and that every data
  file the metadata lists is present and long enough (a truncated ``.distcp`` is named with its tensor).
- :class:`SafeReader` (a ``FileSystemReader``) reads metadata that way and names the file and tensor when
  a data file cannot be read; :class:`SafeLoadPlanner` refuses values stored as pickled bytes (mm writes
  tensors only, see :mod:`mm_core.checkpoint.json_state`); tensors themselves are read by DCP with
  ``torch.load(weights_only=True)``.
- :func:`load_dcp` runs ``dcp.load`` with both and turns DCP's per-rank failure report into the one-line
  error of the first failing rank, the same on every rank.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from mm_core.errors import CheckpointError, MMError

METADATA_FILE = ".metadata"
T = TypeVar("T")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` may name (found by unpickling real mm checkpoints with a logging
    ``find_class``): DCP's metadata classes, ``torch.Size``, dtypes, layouts by name, paths, containers."""
    allowed: dict[tuple[str, str], Any] = {}
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _MEM_FORMAT_ENCODING,
    ):
        allowed["torch.distributed.checkpoint.metadata", cls.__name__] = cls
    allowed["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = _StorageInfo
    allowed["torch", "Size"] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed["torch", name] = value
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout  # a lookup by name
    # StorageMeta.checkpoint_id may be a path (pathlib moved to pathlib._local in Python 3.13); a Windows
    # path is read as a pure path, which every platform can build
    for module in ("pathlib", "pathlib._local"):
        for name in ("Path", "PosixPath", "PurePath", "PurePosixPath"):
            allowed[module, name] = pathlib.PurePosixPath if name.startswith("Pure") else pathlib.Path
        for name in ("WindowsPath", "PureWindowsPath"):
            allowed[module, name] = pathlib.PureWindowsPath
    allowed["collections", "OrderedDict"] = OrderedDict
    for container in (set, frozenset, list, dict, tuple):
        allowed["builtins", container.__name__] = container
    return allowed


_ALLOWED = _allowed_globals()


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.what = f"{module}.{name}"


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP metadata and nothing else: every global outside the allowlist is
    refused before it is imported, so a crafted file's payload never runs."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[module, name]
        except KeyError:
            raise _Refused(module, name) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def _unpickle(file: Path) -> Metadata:
    try:
        with open(file, "rb") as f:
            meta: Metadata = MetadataUnpickler(f).load()  # checked by _check_structure below
    except _Refused as exc:
        raise CheckpointError(
            f"{file}: refused: it asks to import {exc.what}, which DCP checkpoint metadata never holds; a "
            "checkpoint is data and mm runs no code from it (the file was crafted or written by another "
            "tool: do not use it)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a corrupt pickle is the same user error
        raise CheckpointError(
            f"{file}: is truncated or corrupt ({type(exc).__name__}: {exc}); copy the checkpoint again or "
            "load an earlier one"
        ) from None
    _check_structure(file, meta)
    return meta


def _check_structure(file: Path, meta: Any) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: is not the metadata of a DCP checkpoint ({what})")

    if not isinstance(meta, Metadata):
        raise bad(f"it holds a {type(meta).__name__}, not a Metadata")
    sd = meta.state_dict_metadata
    if not isinstance(sd, dict):
        raise bad("state_dict_metadata is not a dict")
    for key, md in sd.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"entry {key!r} is a {type(md).__name__}")
    if not isinstance(meta.storage_data, dict):
        raise bad("storage_data is not a dict")
    for index, info in meta.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage entry {index!r} is a {type(info).__name__}")
        rel = info.relative_path
        ok_ints = all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length))
        if not isinstance(rel, str) or not rel or not ok_ints:
            raise bad(f"storage entry of {index.fqn!r} has no valid file, offset and length")
        parts = pathlib.PurePath(rel).parts
        if pathlib.PurePath(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise bad(f"{index.fqn!r} is stored in {rel!r}, outside the checkpoint folder")


def _check_files(folder: Path, meta: Metadata) -> None:
    """Every data file the metadata lists is present and long enough for the tensors it holds."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, index.fqn))
    for rel, items in sorted(by_file.items()):
        path = folder / rel
        items.sort()
        if not path.is_file():
            more = f" and {len(items) - 1} more" if len(items) > 1 else ""
            raise CheckpointError(
                f"{path}: is missing; the checkpoint's metadata says it holds {items[0][2]}{more} (an "
                "incomplete copy?): copy the checkpoint again or load an earlier one"
            )
        size = path.stat().st_size
        cut = [item for item in items if item[1] > size]
        if cut:
            start, end, fqn = cut[0]
            raise CheckpointError(
                f"{path}: is truncated: it has {size} bytes, but {fqn} is stored at bytes {start}-{end} "
                f"({len(cut)} of its {len(items)} tensors lie past the end); copy the checkpoint again or "
                "load an earlier one"
            )


def read_metadata(path: str | Path, rank: int | None = None, *, where: str = "") -> Metadata:
    """The checkpoint's DCP metadata, read without running code from it, after checking its data files.
    ``where`` (e.g. ``training.load``) starts the message of an error."""
    folder = Path(path)
    file = folder / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
    try:
        if not file.is_file():
            raise CheckpointError(f"{folder}: is not a complete DCP checkpoint (no {file.name})")
        meta = _unpickle(file)
        _check_files(folder, meta)
    except CheckpointError as exc:
        if not where:
            raise
        raise CheckpointError(f"{where}: {exc}") from None
    return meta


def _describe(exc: BaseException) -> str:
    """A short cause: torch's weights-only unpickling message would suggest an unsafe retry."""
    if isinstance(exc, pickle.UnpicklingError):
        return "not a valid tensor record"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


class SafeReader(FileSystemReader):
    """``FileSystemReader`` reading metadata with :func:`read_metadata`, naming the file and tensor on a
    failed read."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta = read_metadata(Path(self.path), kwargs.get("rank"))
        if meta.storage_meta is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except MMError:
                raise
            except Exception as exc:  # noqa: BLE001 - named below with the file and the tensor
                fqn = self._failing_tensor(plan, items, planner)
                raise CheckpointError(
                    f"{Path(self.path) / rel}: cannot read {fqn} ({_describe(exc)}); the file is corrupt: "
                    "copy the checkpoint again or load an earlier one"
                ) from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _failing_tensor(self, plan: LoadPlan, items: list[ReadItem], planner: LoadPlanner) -> str:
        """Read the items one at a time to find the first that fails (only after a failure)."""
        for item in items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception:  # noqa: BLE001
                return item.storage_index.fqn
        return f"one of {', '.join(sorted({i.storage_index.fqn for i in items})[:3])}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses values stored as pickled bytes instead of unpickling them."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = Path(path)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(
            f"{self.path}: {read_item.dest_index.fqn} is stored as a pickled object; mm reads tensors only "
            "and never unpickles checkpoint values (a checkpoint is data, not code)"
        )


def first_user_error(exc: CheckpointException) -> MMError | None:
    """The user error of the lowest failing rank in DCP's per-rank failure report, if any."""
    for rank in sorted(exc.failures):
        err = exc.failures[rank][0]
        if isinstance(err, MMError):
            return err
    return None


def load_dcp(
    state: dict[str, Any], path: str | Path, *, allow_partial: bool, no_dist: bool = False, where: str = ""
) -> None:
    """``dcp.load`` through :class:`SafeReader` and :class:`SafeLoadPlanner`. A user error on any rank is
    raised on every rank as one line (DCP gathers the failures of all ranks, so none waits for another),
    starting with ``where`` (e.g. ``training.load``) when given."""
    try:
        with warnings.catch_warnings():
            # no_dist: DCP's notice that it loads in one process, which is what was asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                checkpoint_id=str(path),
                storage_reader=SafeReader(str(path)),
                planner=SafeLoadPlanner(path, allow_partial_load=allow_partial),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        err = first_user_error(exc)
        if err is None:
            raise
        raise type(err)(f"{where}: {err}" if where else str(err)) from None


def raise_on_all_ranks(fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank. When it fails on any rank, every rank raises the error of the lowest
    failing rank (same message everywhere: the launcher prints it once), so that no rank goes on to wait in
    a collective for one that stopped. Without a process group it simply runs ``fn``."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below, then re-raised
        error = exc
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return cast(T, result)
    rank = dist.get_rank()
    mine: MMError | None = None
    if isinstance(error, MMError):
        mine = error
    elif error is not None:
        mine = MMError(f"rank {rank} failed: {type(error).__name__}: {error}")
    gathered: list[MMError | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    first = next((e for e in gathered if e is not None), None)
    if error is not None and not isinstance(error, MMError):
        raise error  # a bug keeps its traceback on the rank where it happened
    if first is not None:
        raise type(first)(str(first)) from None
    return cast(T, result)  # fn() returned on every rank
