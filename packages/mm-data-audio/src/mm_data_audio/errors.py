"""Errors of mm-data-audio's loading and encoding path (the datasets turn them into DataErrors naming the
record)."""

from __future__ import annotations


class AudioError(ValueError):
    """An audio file cannot be used: missing, empty, not audio, the wrong rate with resampling off, too
    long."""


class EncodeError(ValueError):
    """A conversation cannot be encoded (placeholders and audios disagree, template problems, ...)."""
