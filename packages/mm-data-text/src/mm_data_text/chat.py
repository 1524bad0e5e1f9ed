"""Rendering a chat conversation with the tokenizer's template and labelling only the assistant turns.

Two ways to find the assistant tokens, chosen by the template:
- a template with ``{% generation %}`` blocks (like the quickstart tokenizer's): transformers'
  ``return_assistant_tokens_mask`` marks exactly the tokens rendered inside those blocks;
- any other template: each assistant turn's text span is found by rendering the conversation up to
  the turn (with the generation prompt) and up to and including the turn; the span runs from the end of
  the first rendering to the end of the second with trailing whitespace removed (so ChatML labels
  ``reply<|im_end|>`` and not the newline after it). This needs a template that renders a
  conversation's prefix as a prefix of the full text; one that does not is reported
  (:mod:`mm_core.data.chat`, shared with the image and audio datasets).

Truncation before tokenisation (:func:`encode_within`): a sample keeps only its first ``cutoff_len`` tokens,
so the text far beyond them is neither rendered nor tokenised. The rule:

1. ``L`` (:func:`max_token_bytes`) is the most UTF-8 bytes one token of the vocabulary (added tokens
   included) stands for, so no token of an encoding covers more than ``L`` bytes of the text.
2. Hence the first ``B = (cutoff_len + MARGIN) * L`` bytes of the message contents (in message order)
   always yield more than ``cutoff_len + MARGIN`` tokens.
3. A conversation whose contents exceed ``B`` bytes keeps every message and its role (so a template that
   looks at the conversation's structure, such as "the last message" or "the turns after the last user
   message", renders the earlier turns exactly as in the whole conversation); the content of the message
   where the budget runs out is cut to the bytes left, at a character boundary, and the contents of all
   later messages are emptied. The result is encoded and cut to ``cutoff_len`` as a whole conversation is.
4. At least ``MARGIN`` tokens lie between token ``cutoff_len`` and the cut. They absorb what differs from
   encoding the whole conversation, all of it next to the cut or after it: the word the cut splits, the
   template's tokens after the cut. So the first ``cutoff_len`` ids and labels are those of the whole
   conversation.

Step 3 assumes a template renders a message from its own content and the other messages' roles, not their
contents: ChatML and Llama templates do; Qwen3's also asks whether a later user message starts with
``<tool_response>``, which matters only for tool conversations.

Step 2 needs a template that renders each message's content verbatim and a tokenizer whose normalizer does
not shrink the text (NFC or NFKC can, for text that is not already normalised). So step 4 is checked, not
assumed: the cut's position in the rendered text is found (by rendering once more with a marker after the
kept content), and when fewer than ``cutoff_len + MARGIN`` tokens start before it, or it cannot be found,
the whole conversation is encoded instead.

``L`` is a worst case (the longest token; a typical token stands for 3 to 5 bytes), so ``B`` yields far more
tokens than needed. The cut is therefore first tried with ``TYPICAL_TOKEN_BYTES`` in place of ``L``: when
the check of step 4 passes, the result is the same; otherwise the cut with ``L`` follows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from mm_core.data.chat import EncodeError, encode_chat, render_chat

from .packing import IGNORE_INDEX

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

#: tokens kept between ``cutoff_len`` and the cut of a long conversation (see the module docstring)
MARGIN = 64
#: bytes one token of typical text stands for, at most (3 to 5 for the usual vocabularies): the first try
TYPICAL_TOKEN_BYTES = 8
#: appended to the kept content to find the cut in the rendered text (private-use characters)
_CUT_MARK = "\ue000mm-cut\ue001"

#: ids, labels and, when asked for and known, the first character of each token in the rendered text
Encoded = tuple[list[int], list[int], list[int] | None]


#: a conversation cannot be rendered or its assistant turns cannot be located (mm-core's, shared with the
#: other chat datasets)
ChatEncodeError = EncodeError
#: how a template whose prefixes are not prefixes can still be used: mark the assistant tokens
_ADVICE = "; use a template with {% generation %} blocks"


def uses_generation_markers(chat_template: str) -> bool:
    """True when the template marks assistant tokens with ``{% generation %}`` blocks."""
    return bool(_GENERATION_TAG.search(chat_template))


def _encode_with_markers(tokenizer: Any, messages: Sequence[dict[str, Any]], with_starts: bool) -> Encoded:
    try:
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as e:  # noqa: BLE001 - as in mm_core.data.chat.render_chat
        raise ChatEncodeError(f"chat template failed: {e}") from None
    ids = [int(t) for t in out["input_ids"]]
    mask = out["assistant_masks"]
    encodings = getattr(out, "encodings", None) if with_starts else None
    starts = [start for start, _ in encodings[0].offsets] if encodings else None
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)], starts


def _encode_with_spans(
    tokenizer: Any, messages: Sequence[dict[str, Any]], last: int | None, with_starts: bool
) -> Encoded:
    ids, labels, starts = encode_chat(tokenizer, messages, last=last, advice=_ADVICE)
    return ids, labels, starts if with_starts else None


def _encode(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    with_markers: bool,
    last: int | None = None,
    with_starts: bool = False,
) -> Encoded:
    if with_markers:
        return _encode_with_markers(tokenizer, messages, with_starts)
    return _encode_with_spans(tokenizer, messages, last, with_starts)


def encode_conversation(
    tokenizer: Any, messages: Sequence[dict[str, Any]], with_markers: bool
) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside assistant turns) for one conversation, not truncated."""
    ids, labels, _ = _encode(tokenizer, messages, with_markers)
    return ids, labels


# ----------------------------------------------------------------------------------------------- truncation
def max_token_bytes(tokenizer: Any) -> int:
    """``L``: the most UTF-8 bytes of text one token of the vocabulary covers (see the module docstring).

    A token's bytes are bounded two ways and the smaller bound is taken: the UTF-8 length of its vocabulary
    string (a byte-level BPE character stands for one byte and is one or two bytes long; sentencepiece's
    "▁" stands for a space and is three bytes long, "<0xE4>" stands for one byte), and the UTF-8 length of
    ``convert_tokens_to_string([token])`` plus one (a decoder may strip the leading space of a first token;
    a byte that is only part of a character decodes to "�", three bytes). Only the tokens whose string is
    longer than the bound so far are decoded, so this takes milliseconds for a 150,000-token vocabulary."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    by_length = sorted(((len(t.encode("utf-8")), t) for t in tokens if t), reverse=True)
    longest = 1
    for raw, token in by_length:
        if raw <= longest:
            break  # no later token can raise the bound
        try:
            decoded = len(tokenizer.convert_tokens_to_string([token]).encode("utf-8")) + 1
        except Exception:  # noqa: BLE001 - a decoder that rejects a lone token: its string bounds it
            decoded = raw
        longest = max(longest, min(raw, decoded))
    return longest


def content_budget(cutoff_len: int, token_bytes: int) -> int:
    """``B``: the bytes of message contents that yield more than ``cutoff_len + MARGIN`` tokens."""
    return (cutoff_len + MARGIN) * token_bytes


def _utf8_head(text: str, nbytes: int, index: int) -> tuple[str, int, bool]:
    """The longest prefix of ``text`` (message ``index``'s content) of at most ``nbytes`` UTF-8 bytes, its
    size in bytes, and whether it is the whole text."""
    head = text[:nbytes]  # every character is at least one byte, so this holds the prefix
    try:
        raw = head.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChatEncodeError(
            f"message {index} content is not valid Unicode ({e.reason} at character {e.start})"
        ) from None
    if len(head) == len(text) and len(raw) <= nbytes:
        return text, len(raw), True
    head = raw[:nbytes].decode("utf-8", errors="ignore")  # drops a character cut in two
    return head, nbytes, False


def cut_contents(messages: Sequence[dict[str, str]], budget: int) -> tuple[list[dict[str, str]], int] | None:
    """The conversation with its contents cut to ``budget`` bytes, and the index of the message cut; None
    when the contents fit. Every message is kept with its role; the message where the budget runs out
    keeps the bytes left (at a character boundary), the later ones are emptied."""
    left = budget
    out: list[dict[str, str]] = []
    cut: int | None = None
    for i, message in enumerate(messages):
        content = message["content"]
        if cut is not None:
            content = ""
        else:
            content, used, whole = _utf8_head(content, left, i)
            left -= used
            if not whole:
                cut = i
        out.append({**message, "content": content})
    return None if cut is None else (out, cut)


def _cut_position(tokenizer: Any, messages: Sequence[dict[str, str]], cut: int) -> int | None:
    """Where the kept content of message ``cut`` ends in the rendered text; None when not found."""
    marked = list(messages)
    marked[cut] = {**marked[cut], "content": marked[cut]["content"] + _CUT_MARK}
    try:
        text = render_chat(tokenizer, marked, add_generation_prompt=False)
    except ChatEncodeError:
        return None
    at = text.find(_CUT_MARK)
    return None if at < 0 else at


def encode_within(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    with_markers: bool,
    cutoff_len: int,
    token_bytes: int,
) -> tuple[list[int], list[int], bool]:
    """The first ``cutoff_len`` ids and labels of the conversation, those :func:`encode_conversation` then a
    cut give, tokenising no more than the rule in the module docstring needs (``token_bytes`` is ``L``);
    and whether the conversation was cut before it was tokenised."""
    for per_token in sorted({min(TYPICAL_TOKEN_BYTES, token_bytes), token_bytes}):
        cut = cut_contents(messages, content_budget(cutoff_len, per_token))
        if cut is None:
            break  # the contents fit: nothing to cut
        short, last = cut
        try:  # assistant turns after the cut message lie beyond cutoff_len: their spans are not needed
            ids, labels, starts = _encode(tokenizer, short, with_markers, last, with_starts=True)
        except ChatEncodeError:
            break  # a template that rejects the emptied messages: the whole conversation says what is wrong
        at = _cut_position(tokenizer, short, last)
        if at is not None and starts is not None and sum(s < at for s in starts) >= cutoff_len + MARGIN:
            return ids[:cutoff_len], labels[:cutoff_len], True
    # the contents fit, or the rule's premise fails for this tokenizer, template or text: encode it whole
    ids, labels = encode_conversation(tokenizer, messages, with_markers)
    return ids[:cutoff_len], labels[:cutoff_len], False
