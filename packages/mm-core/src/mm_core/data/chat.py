"""Rendering a conversation with the tokenizer's chat template and labelling only its assistant turns.

Shared by the data plugins that train on chat conversations (mm-data-text's ``sft``, mm-data-vlm's
``vlm_sft``, mm-data-audio's ``audio_sft`` / ``asr_manifest``), which may not import each other.

Each assistant turn's text span is found by rendering the conversation up to the turn (with the generation
prompt) and up to and including the turn; the span runs from the end of the first rendering to the end of the
second with trailing whitespace removed (so ChatML labels ``reply<|im_end|>`` and not the newline after it).
This needs a template that renders a conversation's prefix as a prefix of the full text; one that does not is
an :class:`EncodeError`. The rendered text is then tokenised with offsets, and a token is labelled when it
starts inside a span and is not one of the ``unlabelled`` ids (image or audio tokens: their rows take
features, they are never predicted).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from mm_core.train.loss import IGNORE_INDEX

#: ids, labels (``IGNORE_INDEX`` outside assistant turns), and each token's first character in the text
Encoded = tuple[list[int], list[int], list[int]]


class EncodeError(ValueError):
    """A conversation cannot be encoded (template problems, placeholders and media disagree, a refused image,
    ...); the dataset turns it into a DataError naming the record."""


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The conversation as the tokenizer's chat template writes it; EncodeError when the template fails."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - jinja2 errors and raise_exception() in templates
        raise EncodeError(f"chat template failed: {e}") from None
    return str(text)


def assistant_spans(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    last: int | None = None,
    *,
    advice: str = "",
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character span of every assistant turn in it (of those up
    to turn ``last`` when given). ``advice`` ends the error for a template whose prefixes are not prefixes."""
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages[: None if last is None else last + 1]):
        if message["role"] != "assistant":
            continue
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        upto = full if i + 1 == len(messages) else render_chat(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise EncodeError(
                f"the chat template does not render turn {i} as a continuation of the turns before it, "
                f"so the assistant tokens cannot be located{advice}"
            )
        spans.append((len(prefix), len(upto.rstrip())))
    return full, spans


def encode_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    unlabelled: Collection[int] = (),
    last: int | None = None,
    advice: str = "",
) -> Encoded:
    """Token ids, labels (``IGNORE_INDEX`` outside the assistant turns, up to turn ``last`` when given, and
    at ``unlabelled`` ids) and each token's first character in the rendered text (see the module docstring);
    ``advice`` as in :func:`assistant_spans`."""
    text, spans = assistant_spans(tokenizer, messages, last, advice=advice)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = [int(t) for t in enc["input_ids"]]
    starts = [int(start) for start, _end in enc["offset_mapping"]]
    labels = [
        t if t not in unlabelled and any(lo <= start < hi for lo, hi in spans) else IGNORE_INDEX
        for t, start in zip(ids, starts)
    ]
    return ids, labels, starts
