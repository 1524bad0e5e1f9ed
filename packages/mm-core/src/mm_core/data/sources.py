"""Which source (entry of ``basic_parameters.dataset``) each sample of a batch comes from, for losses per
source (``loss/<source>``, ``eval_loss/<source>`` in metrics.jsonl).

A dataset with several sources exposes ``source_sizes`` (samples per source, in index order: source 0 owns
indices ``[0, n0)``, source 1 the next ``n1``, ...; see :mod:`mm_core.data.sampling`). Collators keep each
sample's dataset index as ``sample_id`` (a long tensor ``[B]``), so a sample's source is found from its index
alone, on the host, with no change to the data plugins. A source is named after its entry of
``basic_parameters.dataset`` (the file or folder name without suffix), or ``source<i>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import torch

#: the batch key under which the trainer hands a task each row's source index (a long tensor ``[B]``)
SOURCE_KEY = "mm_source"


def _entry_name(entry: Any) -> str | None:
    if isinstance(entry, str) and entry:
        stem = PurePath(entry.rstrip("/")).name
        for suffix in (".gz", ".zst"):
            stem = stem.removesuffix(suffix)
        return PurePath(stem).stem or None
    return None


@dataclass(frozen=True)
class Sources:
    """The sources of a dataset: their names and the first index of each (plus the end)."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # len(names) + 1 boundaries

    @classmethod
    def of(cls, dataset: Any, basic: Mapping[str, Any]) -> Sources | None:
        """The sources of ``dataset`` when it has more than one (``source_sizes``), else None."""
        sizes = getattr(dataset, "source_sizes", None)
        if sizes is None or len(sizes) < 2:
            return None
        entries = basic.get("dataset")
        entries = list(entries) if isinstance(entries, (list, tuple)) else []
        names = [
            (_entry_name(entries[i]) if len(entries) == len(sizes) else None) or f"source{i}"
            for i in range(len(sizes))
        ]
        for i, name in enumerate(names):  # the same name twice: both get their index
            if names.count(name) > 1:
                names[i] = f"{name}{i}"
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + int(n))
        return cls(tuple(names), tuple(bounds))

    def index(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """The source of every sample id (``-1`` for an id outside the dataset, e.g. a collator's -1)."""
        ends = torch.tensor(self.bounds[1:], dtype=torch.long)
        ids = sample_ids.long().cpu()
        src = torch.bucketize(ids, ends, right=True)
        return torch.where((ids >= 0) & (ids < self.bounds[-1]), src, torch.full_like(src, -1))


def tag_sources(batch: dict[str, Any], sources: Sources | None) -> None:
    """Put each row's source index under :data:`SOURCE_KEY` when the batch's ``sample_id`` has one id per row
    (a packed row holding several samples has none: its per-source losses are not counted)."""
    ids = batch.get("sample_id")
    if sources is None or not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        return
    batch[SOURCE_KEY] = sources.index(ids)


def source_names(sources: Sources | None) -> Sequence[str]:
    return sources.names if sources is not None else ()
