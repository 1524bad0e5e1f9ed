"""Prepared-data caches: prepare once (tokenise a corpus, index records), then only map the result.

A dataset plugin that prepares its data keeps the result in one folder under the cache root::

    <cache root>/<name>-<key>/
        manifest.json      what was prepared from what: sources (size, mtime, sha256), payload files
        <payload files>    the plugin's own (token shards, record indexes, ...)

``key`` hashes what the result depends on besides the sources' contents: the format version, the dataset
type, the source paths, the tokenizer/processor files and the preprocessing settings. The sources' contents
are pinned by the manifest instead, so a changed file is *named* rather than silently missed under a new key.

:func:`open_cache` is the one way in:

- no cache yet: it is built under an exclusive lock (so the ranks of a node build it once while the others
  wait) into a temporary folder that is renamed into place only when complete, manifest last: a crash
  mid-build never leaves a cache that looks usable;
- a source whose size or mtime changed since preparation, a source that changed *during* preparation, or a
  payload file of the wrong size: named, then the cache is rebuilt (``on_stale="rebuild"``, the default) or
  refused with :class:`~mm_core.errors.DataError` (``"error"``) — never silently used;
- :func:`verify_cache` also re-hashes every source and payload file (``mm data verify``), which finds
  corruption that kept a file's size and mtime.

The cache root is ``basic_parameters.cache_dir`` when set, else ``$MM_CACHE_DIR``, else
``$XDG_CACHE_HOME/mm/data`` (``~/.cache/mm/data``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Literal, TypeVar

from mm_core.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

#: bumped whenever the layout of a prepared folder changes, so old caches are never misread
CACHE_FORMAT = 1
MANIFEST = "manifest.json"
CACHE_ENV = "MM_CACHE_DIR"
OnStale = Literal["rebuild", "error"]
OnMissing = Literal["prepare", "error"]
_HASH_CHUNK = 1 << 22
#: files of a tokenizer/processor folder whose contents a prepared result depends on (never model weights)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)

T = TypeVar("T")
R = TypeVar("R")


def cache_root(cache_dir: str | None) -> Path:
    """Where prepared data lives: ``cache_dir``, else ``$MM_CACHE_DIR``, else the user's cache folder. A path
    that is (or lies under) a regular file is refused, naming where it came from."""
    if cache_dir:
        return _folder(Path(cache_dir), "data.dataset_param.basic_parameters.cache_dir")
    if os.environ.get(CACHE_ENV):
        return _folder(Path(os.environ[CACHE_ENV]), f"${CACHE_ENV}")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return _folder(
        Path(base) / "mm" / "data", "$XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "~/.cache"
    )


def _folder(path: Path, source: str) -> Path:
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"lies under {str(part)!r}, a file"
                raise ConfigError(f"{source}: {str(path)!r} {what}; prepared data needs a folder there")
            break
    return path


def digest(spec: Any) -> str:
    """A short stable hash of a JSON-able value (the cache key)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_fingerprint(folder: str | Path) -> str:
    """A hash of the tokenizer/processor files in ``folder`` (names and contents; never weights)."""
    folder = Path(folder)
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            h.update(name.encode() + b"\0" + file_sha256(path).encode() + b"\0")
    return h.hexdigest()[:20]


@dataclass(frozen=True)
class SourceStamp:
    """A source file as it was prepared: its size, modification time and content hash."""

    path: str
    size: int
    mtime_ns: int
    sha256: str = ""

    @classmethod
    def of(cls, path: Path, *, with_hash: bool = False) -> SourceStamp:
        st = path.stat()
        return cls(str(path), st.st_size, st.st_mtime_ns, file_sha256(path) if with_hash else "")

    def change(self) -> str | None:
        """How the file differs now from when it was prepared (size/mtime only), or None."""
        path = Path(self.path)
        if not path.is_file():
            return f"{self.path}: no longer exists"
        st = path.stat()
        if st.st_size != self.size:
            return f"{self.path}: size changed from {self.size:,} to {st.st_size:,} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return f"{self.path}: modified since preparation (same size, new mtime)"
        return None


@dataclass
class Prepared:
    """An opened, consistent prepared folder: ``path`` and the plugin's ``payload`` metadata."""

    path: Path
    manifest: dict[str, Any]

    @property
    def payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = self.manifest["payload"]
        return payload

    @property
    def sources(self) -> list[SourceStamp]:
        return [SourceStamp(**s) for s in self.manifest["sources"]]


def _problems(path: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Cheap staleness checks: sources' size/mtime and payload files' sizes."""
    out = [c for s in manifest["sources"] if (c := SourceStamp(**s).change())]
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            out.append(f"{f}: prepared file missing")
        elif f.stat().st_size != info["size"]:
            out.append(f"{f}: prepared file has {f.stat().st_size:,} bytes, expected {info['size']:,}")
    return out


def verify_cache(prepared: Prepared) -> list[str]:
    """Every problem with ``prepared``: the cheap checks plus the sha256 of every source and payload file."""
    out = _problems(prepared.path, prepared.manifest)
    if out:
        return out
    for s in prepared.sources:
        if s.sha256 and file_sha256(Path(s.path)) != s.sha256:
            out.append(f"{s.path}: contents changed since preparation (sha256 differs, same size and mtime)")
    for name, info in prepared.manifest["files"].items():
        if file_sha256(prepared.path / name) != info["sha256"]:
            out.append(f"{prepared.path / name}: prepared file is corrupt (sha256 differs)")
    return out


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("format") == CACHE_FORMAT else None


@contextlib.contextmanager
def _locked(lock_path: Path, what: str) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process that is preparing %s", what)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_dead_temporaries(root: Path, stem: str) -> None:
    """Temporary build folders of this host whose process is gone (a crashed build)."""
    host = socket.gethostname()
    for tmp in root.glob(f".{stem}.tmp-*"):
        try:
            tmp_host, pid = tmp.name.rsplit("-", 2)[-2:]
            if tmp_host != host:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def _finish(tmp: Path, sources: Sequence[Path], stamps: list[SourceStamp], payload: dict[str, Any]) -> None:
    """Check the sources did not change while being prepared; write the manifest (last)."""
    for before, path in zip(stamps, sources):
        after = SourceStamp.of(path)
        if (after.size, after.mtime_ns) != (before.size, before.mtime_ns):
            raise DataError(f"{path}: changed while it was being prepared; prepare again once it is final")
    files = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    manifest = {
        "format": CACHE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sources": [asdict(s) for s in stamps],
        "files": files,
        "payload": payload,
    }
    with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def cache_path(root: Path, name: str, spec: Mapping[str, Any], sources: Sequence[Path]) -> Path:
    """The folder :func:`open_cache` uses for ``spec`` over ``sources``."""
    paths = [str(Path(s).resolve()) for s in sources]
    key = digest({"format": CACHE_FORMAT, "name": name, "spec": dict(spec), "sources": paths})
    return root / f"{name}-{key}"


def cache_status(root: Path, name: str, spec: Mapping[str, Any], sources: Sequence[Path]) -> str:
    """One line for ``mm check``: whether the prepared data is current, stale (and why) or not there yet."""
    path = cache_path(root, name, spec, sources)
    manifest = _read_manifest(path)
    if manifest is None:
        return f"not prepared yet: the first start (or `mm data prepare`) prepares it into {path}"
    problems = _problems(path, manifest)
    if problems:
        return f"prepared in {path} but stale ({problems[0]}{'; ...' if len(problems) > 1 else ''})"
    return f"prepared and current in {path}"


def open_cache(
    *,
    root: Path,
    name: str,
    spec: Mapping[str, Any],
    sources: Sequence[Path],
    build: Callable[[Path], dict[str, Any]],
    on_stale: OnStale = "rebuild",
    on_missing: OnMissing = "prepare",
    overwrite: bool = False,
    stale_hint: str = "",
) -> tuple[Prepared, bool]:
    """The prepared folder for ``spec`` over ``sources``, built with ``build(folder) -> payload`` when
    missing (unless ``on_missing`` is ``error``), stale (unless ``on_stale`` is ``error``) or ``overwrite``.
    Returns it and whether it was built now (rules: the module docstring)."""
    sources = [Path(s).resolve() for s in sources]
    final = cache_path(root, name, spec, sources)
    stem = final.name

    def current() -> tuple[dict[str, Any] | None, list[str]]:
        manifest = _read_manifest(final)
        return manifest, (_problems(final, manifest) if manifest is not None else [])

    manifest, problems = current()
    if manifest is not None and not problems and not overwrite:
        return Prepared(final, manifest), False
    if manifest is None and on_missing == "error" and not overwrite:
        raise DataError(
            f"no prepared {name} data in {final}: prepare it first (`mm data prepare`), or set "
            "data.dataset_param.basic_parameters.cache_missing: prepare"
        )
    with _locked(root / f"{stem}.lock", f"{name} data in {final}"):
        manifest, problems = current()  # another process may have built it while this one waited
        if manifest is not None and not problems and not overwrite:
            return Prepared(final, manifest), False
        if problems:
            listed = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
            if on_stale == "error":
                raise DataError(
                    f"prepared {name} data in {final} is stale: {listed}. Prepare it again (`mm data prepare`"
                    f"){stale_hint}"
                )
            logger.warning("prepared %s data in %s is stale (%s); preparing it again", name, final, listed)
        _remove_dead_temporaries(root, stem)
        tmp = root / f".{stem}.tmp-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            stamps = [SourceStamp.of(p, with_hash=True) for p in sources]
            payload = build(tmp)
            _finish(tmp, sources, stamps, payload)
            if final.exists():
                trash = root / f".{stem}.old-{os.getpid()}"
                final.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(final)
        except FileNotFoundError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            gone = Path(exc.filename).resolve() if exc.filename else None
            if gone in sources:
                raise DataError(
                    f"{gone}: disappeared while it was being prepared; nothing was published (the last "
                    "good cache, if any, is untouched): restore it or remove it from the dataset, then "
                    "prepare again"
                ) from None
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        manifest = _read_manifest(final)
        assert manifest is not None
        return Prepared(final, manifest), True


# ------------------------------------------------------------------------------------- parallel preparation
def _quiet_worker() -> None:
    # each worker is one process: the tokenizer's own thread pool would only oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def parallel_map(fn: Callable[[T], R], tasks: Iterable[T], workers: int) -> list[R]:
    """``[fn(t) for t in tasks]``, in order, across ``workers`` local processes (spawned: safe in a process
    that already runs threads, such as a torch.distributed worker). ``fn`` must be a module-level function."""
    tasks = list(tasks)
    workers = max(1, min(workers, len(tasks)))
    if workers == 1:
        return [fn(t) for t in tasks]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_quiet_worker) as pool:
        return list(pool.map(fn, tasks))


def default_workers() -> int:
    """Local processes for preparation: the CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------ plugin options
def cache_fields() -> dict[str, Any]:
    """The ``basic_parameters`` keys of every dataset that prepares its data (field specs for
    :func:`mm_core.data.params.read_params`)."""
    from mm_core.data.params import boolean, choice, optional_positive_int, optional_string

    return {
        "cache_dir": optional_string(None),
        "preprocessing_num_workers": optional_positive_int(None),
        "overwrite_cache": boolean(False),
        "cache_stale": choice(("rebuild", "error"), "rebuild"),
        "cache_missing": choice(("prepare", "error"), "prepare"),
    }


@dataclass(frozen=True)
class CacheOptions:
    """How a dataset prepares: where (``root``), with how many local processes, and what to do with a stale
    cache; read from ``basic_parameters`` (see :func:`cache_fields`)."""

    root: Path
    workers: int
    overwrite: bool = False
    on_stale: OnStale = "rebuild"
    on_missing: OnMissing = "prepare"

    def open(
        self,
        name: str,
        spec: Mapping[str, Any],
        sources: Sequence[Path],
        build: Callable[[Path], dict[str, Any]],
    ) -> tuple[Prepared, bool]:
        """:func:`open_cache` under these options (a stale cache names ``basic_parameters.cache_stale``)."""
        from mm_core.data.params import BASIC

        return open_cache(
            root=self.root,
            name=name,
            spec=spec,
            sources=sources,
            build=build,
            on_stale=self.on_stale,
            on_missing=self.on_missing,
            overwrite=self.overwrite,
            stale_hint=f", or set {BASIC}.cache_stale: rebuild",
        )

    @classmethod
    def read(
        cls, basic: Mapping[str, Any], *, workers: int | None = None, overwrite: bool = False
    ) -> CacheOptions:
        return cls(
            root=cache_root(basic["cache_dir"]),
            workers=workers or basic["preprocessing_num_workers"] or default_workers(),
            overwrite=overwrite or basic["overwrite_cache"],
            on_stale=basic["cache_stale"],
            on_missing=basic["cache_missing"],
        )
