"""Cutting a long conversation before tokenising it (mm_data_text.chat) gives the first cutoff_len ids and
labels that encoding the whole conversation and then cutting gives, on real text (the Python reference
manual's paragraphs as multi-turn conversations), for byte-level BPE and sentencepiece-style tokenizers,
templates with and without {% generation %} markers, and a template that looks at the conversation's
structure."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from mm_data_text.chat import (
    MARGIN,
    content_budget,
    cut_contents,
    encode_conversation,
    encode_within,
    max_token_bytes,
    uses_generation_markers,
)
from mm_data_text.tokenizer_build import CHATML_TEMPLATE

QUICKSTART_TOKENIZER = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "tokenizer"
MARKERS = ("{%- generation -%}", "{%- endgeneration -%}")
# ChatML whose rendering depends on the conversation's structure: the number of messages up front and a
# different header for the last message (works only with {% generation %} markers)
STRUCTURE_TEMPLATE = (
    "{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' -}}"
    + CHATML_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}",
        "{{- '<|im_start|>assistant' + (' (last)' if loop.last else '') + '\\n' -}}{%- generation -%}",
    )
)


def paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    return [p for _, text in sorted(topics.items()) for p in text.split("\n\n") if p.strip()]


PARAGRAPHS = paragraphs()


def conversation(rng: random.Random, min_bytes: int) -> list[dict[str, str]]:
    """Alternating user/assistant turns of 1-5 consecutive paragraphs, sometimes after a system message,
    ending with an assistant turn, with at least ``min_bytes`` bytes of contents."""
    at = rng.randrange(len(PARAGRAPHS))
    messages = (
        [{"role": "system", "content": "Answer from the Python reference."}] if rng.random() < 0.5 else []
    )
    size = 0
    while size < min_bytes or messages[-1]["role"] != "assistant":
        n = rng.randint(1, 5)
        content = "\n\n".join(PARAGRAPHS[(at + i) % len(PARAGRAPHS)] for i in range(n))
        at += n
        role = "assistant" if messages and messages[-1]["role"] == "user" else "user"
        messages.append({"role": role, "content": content})
        size += len(content.encode("utf-8"))
    return messages


def with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def sentencepiece_style(out: Path) -> Path:
    """A Llama-2-style tokenizer: BPE over "▁"-joined words with byte fallback (<0xE2> ...), trained on the
    manual, with a ChatML template without markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["</s>", "<|im_start|>", "<|im_end|>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(PARAGRAPHS[:600], trainer=trainer)
    out.mkdir(parents=True)
    tokenizer.save(str(out / "tokenizer.json"))
    template = CHATML_TEMPLATE.replace(MARKERS[0], "").replace(MARKERS[1], "")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


VARIANTS = ["quickstart", "chatml_spans", "chatml_markers", "structure", "sentencepiece"]


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("truncation_tok")
    plain = CHATML_TEMPLATE.replace(MARKERS[0], "").replace(MARKERS[1], "")
    folders = {
        "chatml_spans": with_template(tokenizer_dir, root / "spans", plain),
        "chatml_markers": tokenizer_dir,
        "structure": with_template(tokenizer_dir, root / "structure", STRUCTURE_TEMPLATE),
        "sentencepiece": sentencepiece_style(root / "sp"),
    }
    if (QUICKSTART_TOKENIZER / "tokenizer.json").is_file():
        folders["quickstart"] = QUICKSTART_TOKENIZER
    return {name: AutoTokenizer.from_pretrained(str(folder)) for name, folder in folders.items()}


def get(tokenizers: dict[str, Any], name: str) -> Any:
    if name not in tokenizers:
        pytest.skip("quickstart assets not present")
    return tokenizers[name]


@pytest.mark.parametrize("name", VARIANTS)
def test_no_token_covers_more_than_the_bound(tokenizers, name):
    tokenizer = get(tokenizers, name)
    bound = max_token_bytes(tokenizer)
    text = "\n\n".join(PARAGRAPHS[::3]) + " naïve café — 日本語のテキスト 🙂 <|im_end|>"
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    covered = [len(text[a:b].encode("utf-8")) for a, b in enc["offset_mapping"]]
    assert max(covered) <= bound
    strings = [
        tokenizer.convert_tokens_to_string([t])
        for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    ]
    # within one byte (the decoder's stripped leading space) of the longest token's text
    assert bound <= max(len(s.encode("utf-8")) for s in strings) + 1


def test_cut_contents_keeps_every_message_and_cuts_at_a_character():
    messages = [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "cd日本"},  # 日 and 本 are 3 bytes each
        {"role": "assistant", "content": "ef"},
    ]
    assert cut_contents(messages, 12) is None and cut_contents(messages, 13) is None
    short, at = cut_contents(messages, 10)
    assert at == 2 and [m["content"] for m in short] == ["ab", "cd日本", ""]
    short, at = cut_contents(messages, 6)
    assert at == 1 and short == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "cd"},
        {"role": "assistant", "content": ""},
    ]
    short, at = cut_contents(messages, 7)
    assert at == 1 and [m["content"] for m in short] == ["ab", "cd日", ""]
    short, at = cut_contents(messages, 2)
    assert at == 1 and [m["content"] for m in short] == ["ab", "", ""]


@pytest.mark.parametrize("name", VARIANTS)
def test_cut_then_encode_equals_encode_then_cut(tokenizers, name):
    tokenizer = get(tokenizers, name)
    markers = uses_generation_markers(tokenizer.chat_template)
    assert markers == (name not in ("chatml_spans", "sentencepiece"))
    bound = max_token_bytes(tokenizer)
    rng = random.Random(name)
    roles_cut, cut_first = set(), 0
    max_cutoff = 600
    for _ in range(3):
        messages = conversation(rng, (max_cutoff + MARGIN) * bound * 3 // 2)
        full_ids, full_labels = encode_conversation(tokenizer, messages, markers)
        for _ in range(10):
            cutoff_len = rng.randint(1, max_cutoff)
            # the rule itself: cut the contents to B = (cutoff_len + MARGIN) * L bytes, encode, cut
            cut = cut_contents(messages, content_budget(cutoff_len, bound))
            assert cut is not None
            short, at = cut
            roles_cut.add(messages[at]["role"])
            ids, labels = encode_conversation(tokenizer, short, markers)
            assert ids[:cutoff_len] == full_ids[:cutoff_len], (cutoff_len, at)
            assert labels[:cutoff_len] == full_labels[:cutoff_len], (cutoff_len, at)
            # what preparation calls (a tighter first try, checked)
            ids, labels, was_cut = encode_within(tokenizer, messages, markers, cutoff_len, bound)
            assert (ids, labels) == (full_ids[:cutoff_len], full_labels[:cutoff_len])
            cut_first += was_cut
    assert roles_cut == {"user", "assistant"}
    assert cut_first == 30  # never fell back to encoding the whole conversation
    short = messages[:2] if messages[0]["role"] == "user" else messages[1:3]
    ids, labels, was_cut = encode_within(tokenizer, short, markers, 10**6, bound)
    assert not was_cut and (ids, labels) == encode_conversation(tokenizer, short, markers)


def test_a_wrong_bound_falls_back_to_the_whole_conversation(tokenizers):
    tokenizer = tokenizers["chatml_markers"]
    messages = conversation(random.Random(7), 20_000)
    full_ids, full_labels = encode_conversation(tokenizer, messages, True)
    for cutoff_len in (100, 700, 1500):
        # with L = 1 the cut keeps too few tokens before it: the check sees it and encodes everything
        ids, labels, was_cut = encode_within(tokenizer, messages, True, cutoff_len, 1)
        assert not was_cut and (ids, labels) == (full_ids[:cutoff_len], full_labels[:cutoff_len])
