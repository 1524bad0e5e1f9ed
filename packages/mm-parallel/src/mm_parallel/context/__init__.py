"""Context parallelism: Ulysses (all-to-all over heads), ring attention (key/value blocks around a ring with
log-sum-exp merging) and both together, plus the sequence layout (load-balanced zigzag split, padding)."""

from mm_parallel.context.attention import context_parallel_attention
from mm_parallel.context.layout import (
    PAD_SEGMENT,
    SequenceLayout,
    pad_multiple,
    pad_sequence,
    segments_from_positions,
    zigzag_index,
)
from mm_parallel.context.ring import ring_attention
from mm_parallel.context.ulysses import heads_to_seq, seq_to_heads

__all__ = [
    "PAD_SEGMENT",
    "SequenceLayout",
    "context_parallel_attention",
    "heads_to_seq",
    "pad_multiple",
    "pad_sequence",
    "ring_attention",
    "segments_from_positions",
    "seq_to_heads",
    "zigzag_index",
]
