"""Errors of mm-data-audio's loading and encoding path (the datasets turn them into DataErrors naming the
record).

:class:`EncodeError` is mm-core's (:mod:`mm_core.data.chat`), which the shared chat rendering and Qwen-VL
images raise too, so one ``except EncodeError`` catches every refusal of a conversation or its media."""

from __future__ import annotations

from mm_core.data.chat import EncodeError

__all__ = ["AudioError", "EncodeError"]


class AudioError(ValueError):
    """An audio file cannot be used: missing, empty, not audio, the wrong rate with resampling off, too
    long."""
