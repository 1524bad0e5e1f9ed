"""Errors of mm-data-vlm's encoding path (the dataset turns them into DataErrors naming the record)."""

from __future__ import annotations


class EncodeError(ValueError):
    """A conversation cannot be encoded (placeholders and images disagree, template problems, ...)."""
