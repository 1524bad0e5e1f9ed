"""Training: the loop, its loss normalisation and its outputs. ``python -m mm_core.train CFG`` runs it.

``Trainer`` is imported on first use, so that the CLI's entry (``mm_core.train.entry``) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mm_core.train.trainer import Trainer

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from mm_core.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'mm_core.train' has no attribute {name!r}")
