"""Errors of mm-data-vlm's encoding path (the dataset turns them into DataErrors naming the record).

:class:`EncodeError` is mm-core's (:mod:`mm_core.data.chat`), which the shared chat rendering and Qwen-VL
images raise too, so one ``except EncodeError`` catches every refusal of a conversation or its images."""

from __future__ import annotations

from mm_core.data.chat import EncodeError

__all__ = ["EncodeError"]
