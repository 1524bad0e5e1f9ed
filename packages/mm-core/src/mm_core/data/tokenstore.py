"""Token shards on disk, memory-mapped for reading: the format of prepared text.

A shard ``<stem>`` is two or three files written by :class:`ShardWriter`:

- ``<stem>.tok``: the token ids of every document, back to back, little-endian ``uint16`` when the vocabulary
  fits (at most 65,536 ids) else ``uint32``;
- ``<stem>.idx``: ``int64`` document offsets into ``.tok``, ``documents + 1`` entries (0 first, the token
  count last), so document ``i`` is ``tok[idx[i]:idx[i + 1]]``;
- ``<stem>.msk`` (optional): one ``uint8`` per token, 1 where the token is trained on (SFT labels), else 0.

:class:`TokenStore` reads a list of shards as one stream of documents without loading it: the arrays are
``numpy.memmap`` views opened on first use in each process (never pickled to DataLoader workers), so the
resident memory of a dataset is the pages actually read, shared with every other rank of the node through
the page cache, whatever the corpus size. numpy's memmap is used rather than Arrow because the data is
flat integers that need no schema, and a slice is a zero-copy view: one ``searchsorted`` and one slice per
sample.
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_FLUSH_TOKENS = 1 << 20


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _map_file(path: Path, dtype: np.dtype[Any]) -> np.ndarray:
    """A read-only array over the file, mapped for random access: samples are read in a random order, so the
    kernel's read-ahead around each fault would only fill the rank's resident memory (and the page cache)
    with pages nobody asked for."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)  # an empty file cannot be mapped
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):  # Linux and macOS
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)


class ShardWriter:
    """Appends documents to one shard; :meth:`close` returns its description for the manifest."""

    def __init__(self, directory: Path, stem: str, dtype: str, *, with_mask: bool = False) -> None:
        self.stem, self.dtype = stem, dtype
        # open for the writer's lifetime: documents are appended across many add() calls until close()
        self._tok = open(directory / f"{stem}.tok", "wb")  # noqa: SIM115
        self._msk = open(directory / f"{stem}.msk", "wb") if with_mask else None  # noqa: SIM115
        self._idx_path = directory / f"{stem}.idx"
        self._ids = array("I")
        self._mask = array("B")
        self._offsets = array("q", [0])
        self.tokens = 0

    def add(self, ids: Sequence[int], mask: Sequence[int] | None = None) -> None:
        """One document; ``mask`` (1 = trained on) is required exactly when the shard has a mask."""
        if (mask is None) != (self._msk is None):
            raise ValueError(f"shard {self.stem}: mask {'missing' if mask is None else 'unexpected'}")
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"shard {self.stem}: {len(ids)} ids but {len(mask)} mask values")
        self._ids.extend(ids)
        if mask is not None:
            self._mask.extend(mask)
        self.tokens += len(ids)
        self._offsets.append(self.tokens)
        if len(self._ids) >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        self._tok.write(np.frombuffer(self._ids, dtype=np.uint32).astype(self.dtype).tobytes())
        self._ids = array("I")
        if self._msk is not None:
            self._msk.write(self._mask.tobytes())
            self._mask = array("B")

    def close(self) -> dict[str, Any]:
        self._flush()
        self._tok.close()
        if self._msk is not None:
            self._msk.close()
        self._idx_path.write_bytes(self._offsets.tobytes())
        return {"stem": self.stem, "tokens": self.tokens, "documents": len(self._offsets) - 1}


class TokenStore:
    """Shards read as one sequence of documents (and one stream of tokens), memory-mapped.

    ``shards`` are :meth:`ShardWriter.close` descriptions, in stream order."""

    def __init__(
        self, directory: Path, shards: Sequence[dict[str, Any]], dtype: str, *, with_mask: bool
    ) -> None:
        self.directory, self.dtype, self.with_mask = Path(directory), dtype, with_mask
        self.stems = [str(s["stem"]) for s in shards]
        tokens = np.array([int(s["tokens"]) for s in shards], dtype=np.int64)
        docs = np.array([int(s["documents"]) for s in shards], dtype=np.int64)
        # first global token / document of every shard, plus the totals
        self.token_base = np.concatenate([[0], np.cumsum(tokens)])
        self.doc_base = np.concatenate([[0], np.cumsum(docs)])
        self._maps: dict[tuple[int, str], np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}  # each process maps the files itself
        return state

    @property
    def num_tokens(self) -> int:
        return int(self.token_base[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_base[-1])

    def _map(self, shard: int, kind: str) -> np.ndarray:
        key = (shard, kind)
        arr = self._maps.get(key)
        if arr is None:
            dtype = np.dtype({"tok": self.dtype, "idx": "int64", "msk": "uint8"}[kind])
            path = self.directory / f"{self.stems[shard]}.{kind}"
            arr = _map_file(path, dtype)
            self._maps[key] = arr
        return arr

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document ``index``'s ids (and mask), as views of the mapped files."""
        shard = int(np.searchsorted(self.doc_base, index, side="right")) - 1
        local = index - int(self.doc_base[shard])
        idx = self._map(shard, "idx")
        lo, hi = int(idx[local]), int(idx[local + 1])
        mask = self._map(shard, "msk")[lo:hi] if self.with_mask else None
        return self._map(shard, "tok")[lo:hi], mask

    def document_lengths(self) -> np.ndarray:
        """Tokens per document, in order (``int64``, one entry per document)."""
        parts = [np.diff(self._map(s, "idx")) for s in range(len(self.stems))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _shards_over(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(shard, local lo, local hi)`` covering the global token range ``[lo, hi)``."""
        first = int(np.searchsorted(self.token_base, lo, side="right")) - 1
        out = []
        shard = first
        while lo < hi:
            base, end = int(self.token_base[shard]), int(self.token_base[shard + 1])
            take = min(hi, end)
            if take > lo:
                out.append((shard, lo - base, take - base))
            lo = max(lo, take)
            shard += 1
        return out

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        """The global token range ``[lo, hi)`` (it may span shards)."""
        parts = [self._map(s, "tok")[a:b] for s, a, b in self._shards_over(lo, hi)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_starts(self, lo: int, hi: int) -> np.ndarray:
        """Global positions in ``[lo, hi)`` where a document starts."""
        out = []
        for s, a, b in self._shards_over(lo, hi):
            idx = self._map(s, "idx")
            i, j = np.searchsorted(idx[:-1], [a, b], side="left")
            out.append(idx[i:j] + int(self.token_base[s]))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
