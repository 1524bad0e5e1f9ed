"""``data.dataset_param.on_error: skip``: a record that cannot be used is replaced by the next good one.

Shared by the datasets that encode a record when it is fetched (mm-data-vlm's ``vlm_sft``, mm-data-audio's
``audio_sft`` / ``asr_manifest``), which may not import each other. Both halves follow one rule, so that
token-budget batching plans with the lengths the loader then delivers:

- :func:`fetch_skipping` fetches sample ``index``, or under ``skip`` the first record after it (wrapping
  around) that encodes, with ``skipped_samples`` saying how many were passed over;
- :func:`next_usable` gives, for ``sample_lengths()``, the record that stands in for each one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from mm_core.errors import DataError


def fetch_skipping(
    name: str,
    index: int,
    size: int,
    encode: Callable[[int], dict[str, Any]],
    on_error: str,
    skipped: Callable[[DataError], str],
    log: logging.Logger,
) -> dict[str, Any]:
    """``encode(index)`` of a dataset of ``size`` records (negative indices count from the end). With
    ``on_error: skip`` a DataError is logged (a warning on ``log``, the dataset's logger) and handed to
    ``skipped``, which records it and returns the dataset's first skip message so far, and the next record
    is tried; the sample gets ``skipped_samples``, the records passed over. Raises the DataError otherwise,
    or ``name``'s DataError quoting the first skip when every record fails; IndexError out of range."""
    if not -size <= index < size:
        raise IndexError(f"sample {index} out of range for {size} samples")
    index %= size
    first = "?"
    for tries in range(size):
        try:
            sample = encode((index + tries) % size)
        except DataError as e:
            if on_error != "skip":
                raise
            first = skipped(e)
            log.warning("%s: skipping a record (on_error: skip): %s", name, e)
            continue
        sample["skipped_samples"] = tries
        return sample
    raise DataError(
        f"{name}: every record failed to load (data.dataset_param.on_error: skip); first: {first}"
    )


def next_usable(usable: np.ndarray) -> np.ndarray:
    """For each record (``usable``: bool per record), the index of the one that stands in for it under
    ``on_error: skip``: itself when usable, else the next usable one, wrapping around to the first (0 when
    none is usable: the caller refuses that case with its own message)."""
    n = len(usable)
    good = np.flatnonzero(usable)
    nxt = np.where(usable, np.arange(n), n)
    nxt = np.minimum.accumulate(nxt[::-1])[::-1]  # the next usable record at or after each one
    nxt[nxt == n] = good[0] if len(good) else 0  # wrapping around to the first
    return nxt
