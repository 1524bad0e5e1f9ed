"""Token shards on disk, memory-mapped for reading: the format of prepared text.

A shard ``<stem>`` is two or three files written by :class:`ShardWriter`:

- ``<stem>.tok``: the token ids of every document, back to back, little-endian ``uint16`` when the vocabulary
  fits (at most 65,536 ids) else ``uint32``;
- ``<stem>.idx``: ``int64`` document offsets into ``.tok``, ``documents + 1`` entries (0 first, the token
  count last), so document ``i`` is ``tok[idx[i]:idx[i + 1]]``;
- ``<stem>.msk`` (optional): one ``uint8`` per token, 1 where the token is trained on (SFT labels), else 0.

:class:`TokenStore` reads a list of shards as one stream of documents without loading it. A sample is read
with ``os.pread`` into an array the sample owns (a block: one read of its tokens plus a binary search over
the document offsets), so nothing of the corpus stays in a rank's memory once the sample is collated: the
resident memory of a dataset does not grow with the corpus, nor with the number of samples read. Caching is
the kernel's page cache, shared by the ranks of a node. (A memory map would do the same reads, but every
page it touches stays counted in the rank's resident memory — with the kernel's fault-around, hundreds of
KB per random sample — until the whole shard set is resident.) Flat files of integers are used rather than
Arrow because the data needs no schema and a sample is one contiguous byte range.
"""

from __future__ import annotations

import bisect
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mm_core.errors import DataError

_FLUSH_TOKENS = 1 << 20
_INT64, _UINT8 = np.dtype("int64"), np.dtype("uint8")


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


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


class _Files:
    """Read-only file descriptors, opened on first use and at most ``limit`` at a time (the least recently
    used is closed): a corpus can have thousands of shards. ``pread`` keeps no file position, so descriptors
    inherited by forked DataLoader workers are safe to share."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._open: OrderedDict[str, int] = OrderedDict()

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        fd = self._open.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            self._open[path] = fd
            if len(self._open) > self.limit:
                os.close(self._open.popitem(last=False)[1])
        else:
            self._open.move_to_end(path)
        data = os.pread(fd, nbytes, offset)
        if len(data) != nbytes:
            raise DataError(
                f"{path}: prepared file is shorter than its manifest says (read {len(data)} of {nbytes} "
                f"bytes at offset {offset}); prepare the data again (`mm data prepare --overwrite`)"
            )
        return data

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])


class TokenStore:
    """Shards read as one sequence of documents (and one stream of tokens).

    ``shards`` are :meth:`ShardWriter.close` descriptions, in stream order. Reads are ``pread`` calls into
    arrays the caller owns (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        shards: Sequence[dict[str, Any]],
        dtype: str,
        *,
        with_mask: bool,
        vocab_size: int | None = None,
    ) -> None:
        self.directory, self.dtype, self.with_mask = Path(directory), np.dtype(dtype), with_mask
        #: ids read at or above it (a shard corrupted in place) stop the read, naming the file
        self.vocab_size = vocab_size
        self.stems = [str(s["stem"]) for s in shards]
        tokens = np.array([int(s["tokens"]) for s in shards], dtype=np.int64)
        docs = np.array([int(s["documents"]) for s in shards], dtype=np.int64)
        # first global token / document of every shard, plus the totals
        self.token_base = np.concatenate([[0], np.cumsum(tokens)])
        self.doc_base = np.concatenate([[0], np.cumsum(docs)])
        self._files = _Files()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = _Files()  # each process opens the files itself
        return state

    def __del__(self) -> None:
        files = getattr(self, "_files", None)
        if files is not None:
            files.close()

    @property
    def num_tokens(self) -> int:
        return int(self.token_base[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_base[-1])

    def _read(self, shard: int, kind: str, lo: int, hi: int) -> np.ndarray:
        """Elements ``[lo, hi)`` of one shard file."""
        dtype = {"tok": self.dtype, "idx": _INT64, "msk": _UINT8}[kind]
        path = f"{self.directory}/{self.stems[shard]}.{kind}"
        if hi <= lo:
            return np.zeros(0, dtype=dtype)
        data = self._files.read(path, lo * dtype.itemsize, (hi - lo) * dtype.itemsize)
        values = np.frombuffer(data, dtype=dtype)
        if kind == "tok" and self.vocab_size is not None and int(values.max()) >= self.vocab_size:
            at = lo + int(np.argmax(values >= self.vocab_size))
            raise DataError(
                f"{path}: token id {int(values[at - lo])} at token {at} is outside the tokenizer's "
                f"vocabulary ({self.vocab_size} ids): the prepared file is corrupt; `mm data verify` names "
                "every such file, then prepare again (`mm data prepare --overwrite`)"
            )
        return values

    def _offset(self, shard: int, i: int) -> int:
        return int(self._read(shard, "idx", i, i + 1)[0])

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document ``index``'s ids (and mask)."""
        shard = int(np.searchsorted(self.doc_base, index, side="right")) - 1
        local = index - int(self.doc_base[shard])
        lo, hi = (int(v) for v in self._read(shard, "idx", local, local + 2))
        mask = self._read(shard, "msk", lo, hi) if self.with_mask else None
        return self._read(shard, "tok", lo, hi), mask

    def document_lengths(self) -> np.ndarray:
        """Tokens per document, in order (``int64``, one entry per document)."""
        parts = [
            np.diff(self._read(s, "idx", 0, int(self.doc_base[s + 1] - self.doc_base[s]) + 1))
            for s in range(len(self.stems))
        ]
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
        parts = [self._read(s, "tok", a, b) for s, a, b in self._shards_over(lo, hi)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_starts(self, lo: int, hi: int) -> np.ndarray:
        """Global positions in ``[lo, hi)`` where a document starts: a binary search over the shard's offsets
        (one 8-byte read per probe), then the offsets from there, read in one go."""
        out = []
        for s, a, b in self._shards_over(lo, hi):
            docs = int(self.doc_base[s + 1] - self.doc_base[s])
            first = bisect.bisect_left(_Offsets(self, s), a, 0, docs)
            count = 16
            while True:
                starts = self._read(s, "idx", first, min(first + count, docs))
                if len(starts) < count or starts[-1] >= b:
                    break
                count *= 4
            out.append(starts[starts < b] + int(self.token_base[s]))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class _Offsets:
    """One shard's document offsets as a sequence for :func:`bisect.bisect_left` (read one at a time)."""

    def __init__(self, store: TokenStore, shard: int) -> None:
        self.store, self.shard = store, shard

    def __getitem__(self, i: int) -> int:
        return self.store._offset(self.shard, i)
