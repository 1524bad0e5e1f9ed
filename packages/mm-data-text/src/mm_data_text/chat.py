"""Rendering a chat conversation with the tokenizer's template and labelling only the assistant turns.

Two ways to find the assistant tokens, chosen by the template:
- a template with ``{% generation %}`` blocks (like the quickstart tokenizer's): transformers'
  ``return_assistant_tokens_mask`` marks exactly the tokens rendered inside those blocks;
- any other template: each assistant turn's text span is found by rendering the conversation up to
  the turn (with the generation prompt) and up to and including the turn; the span runs from the end of
  the first rendering to the end of the second with trailing whitespace removed (so ChatML labels
  ``reply<|im_end|>`` and not the newline after it). This needs a template that renders a
  conversation's prefix as a prefix of the full text; one that does not is reported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .packing import IGNORE_INDEX

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatEncodeError(ValueError):
    """A conversation cannot be rendered or its assistant turns cannot be located."""


def uses_generation_markers(chat_template: str) -> bool:
    """True when the template marks assistant tokens with ``{% generation %}`` blocks."""
    return bool(_GENERATION_TAG.search(chat_template))


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - jinja2 errors and raise_exception() in templates
        raise ChatEncodeError(f"chat template failed: {e}") from None


def _encode_with_markers(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    try:
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as e:  # noqa: BLE001 - same as in _render
        raise ChatEncodeError(f"chat template failed: {e}") from None
    ids = [int(t) for t in out["input_ids"]]
    mask = out["assistant_masks"]
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character span of every assistant turn in it."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise ChatEncodeError(
                f"the chat template does not render message {i} as a continuation of the messages before it, "
                "so the assistant tokens cannot be located; use a template with {% generation %} blocks"
            )
        spans.append((len(prefix), len(upto.rstrip())))
    return full, spans


def _encode_with_spans(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = [int(t) for t in enc["input_ids"]]
    labels = []
    for token, (start, _end) in zip(ids, enc["offset_mapping"]):
        inside = any(lo <= start < hi for lo, hi in spans)
        labels.append(token if inside else IGNORE_INDEX)
    return ids, labels


def encode_conversation(
    tokenizer: Any, messages: Sequence[dict[str, Any]], with_markers: bool
) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside assistant turns) for one conversation, not truncated."""
    if with_markers:
        return _encode_with_markers(tokenizer, messages)
    return _encode_with_spans(tokenizer, messages)
