"""Training: the loop, its loss normalisation and its outputs. ``python -m mm_core.train CFG`` runs it."""

from mm_core.train.trainer import Trainer

__all__ = ["Trainer"]
