"""Where each token of a sequence lives under context parallelism, and the masks that follow from it.

A sequence of ``S`` tokens (padded so ``S`` is a multiple of ``2 x ring x ulysses``) is cut into ``2 x ring``
equal chunks; ring rank ``r`` holds chunks ``r`` and ``2 x ring - 1 - r`` (the "zigzag" split), so under a
causal mask every ring rank has about the same amount of attention work. Inside one ring rank the
``ulysses`` ranks each hold one contiguous slice of those tokens; Ulysses' all-to-all gathers them back in
order, so after it every member of a ring rank sees exactly :meth:`SequenceLayout.ring_index`.

Which key a query may attend to is decided from global token indices and per-token segment ids (document
ids of packed sequences; ``-1`` for padding, which no query attends to): causal within a segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PAD_SEGMENT = -1


def pad_multiple(ring: int, ulysses: int) -> int:
    """The length multiple a sequence needs for this layout (``2 x ring x ulysses``, or ``ulysses``)."""
    return ulysses if ring == 1 else 2 * ring * ulysses


def pad_sequence(t: torch.Tensor, length: int, value: int | float, dim: int = 1) -> torch.Tensor:
    """Right-pad ``t`` along ``dim`` to ``length`` with ``value`` (returned unchanged when long enough)."""
    extra = length - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment (document) id of every token of packed rows: a new segment starts wherever the position id
    does not grow by exactly one, the rule transformers uses for packed ``position_ids``."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def zigzag_index(seq_len: int, ring: int, ring_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token indices held by ``ring_rank``: chunks ``r`` and ``2 x ring - 1 - r`` of ``2 x ring``."""
    if ring == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * ring)
    lo = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk, device=device)
    hi_start = (2 * ring - 1 - ring_rank) * chunk
    hi = torch.arange(hi_start, hi_start + chunk, device=device)
    return torch.cat([lo, hi])


@dataclass
class SequenceLayout:
    """One micro-batch's context-parallel layout, shared by every attention layer of a forward pass.

    ``segments`` ([batch, padded length], on every rank) holds the segment id of each global token.
    ``ring_group``/``ulysses_group`` are the process groups of this rank's ring and Ulysses dimensions
    (None when that size is 1)."""

    segments: torch.Tensor
    ring_size: int
    ring_rank: int
    ulysses_size: int
    ulysses_rank: int
    ring_group: dist.ProcessGroup | None = None
    ulysses_group: dist.ProcessGroup | None = None
    #: every row one document with padding only at its end (see is_causal_only); None: found on first use
    causal_only: bool | None = None

    def __post_init__(self) -> None:
        multiple = pad_multiple(self.ring_size, self.ulysses_size)
        if self.seq_len % multiple:
            raise ValueError(
                f"sequence length {self.seq_len} is not a multiple of {multiple} "
                f"(ring {self.ring_size} x ulysses {self.ulysses_size}); pad it with pad_sequence first"
            )

    @property
    def seq_len(self) -> int:
        return int(self.segments.shape[1])

    def ring_index(self, ring_rank: int) -> torch.Tensor:
        """Global indices of the tokens a ring rank attends with (after the Ulysses gather)."""
        return zigzag_index(self.seq_len, self.ring_size, ring_rank, self.segments.device)

    def local_index(self) -> torch.Tensor:
        """Global indices of the tokens this rank holds outside attention."""
        index = self.ring_index(self.ring_rank)
        per_rank = index.numel() // self.ulysses_size
        return index[self.ulysses_rank * per_rank : (self.ulysses_rank + 1) * per_rank]

    def is_causal_only(self) -> bool:
        """Whether the mask of every row is plain causal attention over its real tokens: one segment id per
        row and padding only after it (the real queries then never reach a padding key). Attention then runs
        the fused kernels without any mask. Unless given as ``causal_only``, it is found on the device and
        read once per layout: one host sync per micro-batch, shared by every attention layer."""
        if self.causal_only is None:
            seg = self.segments
            real = seg != PAD_SEGMENT
            suffix = (real[:, 1:] <= real[:, :-1]).all()
            one_doc = ((seg == seg[:, :1]) | ~real).all()
            self.causal_only = bool(suffix & one_doc)
        return self.causal_only

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-length tensor (the sequence along ``dim``)."""
        return t.index_select(dim, self.local_index().to(t.device))

    def shard_rows(self, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``rows``, a packed tensor with one row per ``True`` of the full-length
        ``[batch, seq]`` ``mask`` (row-major order, e.g. the features of the image tokens). The result has one
        row per ``True`` of ``self.shard(mask)``, in the same order."""
        number = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        number[mask.bool()] = torch.arange(int(mask.sum()), device=mask.device)
        local = self.shard(number)
        return rows.index_select(0, local[local >= 0].to(rows.device))


def allowed(
    q_index: torch.Tensor, q_seg: torch.Tensor, k_index: torch.Tensor, k_seg: torch.Tensor
) -> torch.Tensor:
    """``[batch, q, k]`` booleans: same segment, key not padding, key not after the query."""
    same = q_seg[:, :, None] == k_seg[:, None, :]
    causal = k_index[None, None, :] <= q_index[None, :, None]
    return same & causal & (k_seg >= 0)[:, None, :]
