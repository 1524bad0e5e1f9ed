"""The data helpers the chat datasets of several plugins share: ShareGPT records (mm_core.data.records),
template rendering with assistant-only labels (mm_core.data.chat), padding token fields
(mm_core.data.collate), ``on_error: skip`` (mm_core.data.skipping) and processor folders
(mm_core.data.processor)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mm_core.data.bpe import write_bytelevel_bpe
from mm_core.data.chat import EncodeError, encode_chat
from mm_core.data.collate import Padding, meta_fields, pad_tokens
from mm_core.data.processor import chat_tokenizer, processor_config
from mm_core.data.records import RecordError, iter_records, record_paths, record_turns, resolve_files
from mm_core.data.skipping import fetch_skipping, next_usable
from mm_core.errors import ConfigError, DataError
from mm_core.train.loss import IGNORE_INDEX

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# renders the last message differently from the same message followed by another: no prefix property
NOT_A_PREFIX = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = ["hello there, how are you?", "fine thanks, and you", "a picture of a cat"] * 20
    folder = tmp_path_factory.mktemp("tok")
    return write_bytelevel_bpe(texts, 300, folder, special_tokens=SPECIAL, chat_template=CHATML)


# ---- records ---------------------------------------------------------------------------------------------
def test_records_name_their_place_and_read_both_layouts(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    jsonl.write_text(json.dumps(good) + "\n\n[1]\n{bad\n", encoding="utf-8")
    got = list(iter_records(jsonl))
    assert [where for where, _ in got] == [f"{jsonl}:1", f"{jsonl}:3", f"{jsonl}:4"]
    assert record_turns(got[0][1]) == [  # type: ignore[arg-type]
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    assert str(got[1][1]) == "a record must be a JSON object"
    assert isinstance(got[2][1], RecordError) and str(got[2][1]).startswith("not valid JSON")

    listed = tmp_path / "b.json"
    listed.write_text(json.dumps([good, 3]), encoding="utf-8")
    assert [(w, isinstance(o, RecordError)) for w, o in iter_records(listed)] == [
        (f"{listed}[0]", False),
        (f"{listed}[1]", True),
    ]
    listed.write_text("{}", encoding="utf-8")
    with pytest.raises(DataError, match=r"b\.json: a \.json dataset must hold a list of records"):
        list(iter_records(listed))

    assert resolve_files(["a.jsonl"], str(tmp_path), "k") == [jsonl]
    with pytest.raises(ConfigError, match=r"^k: .*c\.jsonl' is not a file"):
        resolve_files("c.jsonl", str(tmp_path), "k")


def test_record_checks_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match=r'no "messages" or "conversations" key \(keys: text\)'):
        record_turns({"text": "x"})
    with pytest.raises(RecordError, match=r"turn 0 has from='bot'"):
        record_turns({"conversations": [{"from": "bot", "value": "x"}]})
    with pytest.raises(RecordError, match="no assistant turn"):
        record_turns({"messages": [{"role": "user", "content": "x"}]})
    assert record_paths("x.png", "images", str(tmp_path), "image") == [tmp_path / "x.png"]
    assert record_paths(["/abs.wav"], "audios", None) == [Path("/abs.wav")]
    with pytest.raises(RecordError, match=r'^"images" must be a list of image paths$'):
        record_paths([""], "images", None, "image")


# ---- chat ------------------------------------------------------------------------------------------------
def test_only_assistant_turns_are_labelled(tokenizer_dir: Path) -> None:
    tokenizer, ids = chat_tokenizer(
        str(tokenizer_dir), "k", ["<|im_end|>", "<|image_pad|>"], "special tokens"
    )
    messages = [
        {"role": "user", "content": "hello <|image_pad|> there"},
        {"role": "assistant", "content": "fine <|image_pad|> thanks"},
        {"role": "user", "content": "and you"},
        {"role": "assistant", "content": "how are you"},
    ]
    image = ids["<|image_pad|>"]
    tokens, labels, starts = encode_chat(tokenizer, messages, unlabelled={image})
    assert len(tokens) == len(labels) == len(starts)
    text = tokenizer.decode([t for t, label in zip(tokens, labels) if label != IGNORE_INDEX])
    assert text == "fine  thanks<|im_end|>how are you<|im_end|>"  # the image token never labelled
    assert image in tokens
    # up to turn 1 only: the last reply is not labelled
    _, first, _ = encode_chat(tokenizer, messages, unlabelled={image}, last=1)
    kept = tokenizer.decode([t for t, label in zip(tokens, first) if label != IGNORE_INDEX])
    assert kept == "fine  thanks<|im_end|>"


def test_templates_that_do_not_extend_their_prefixes_are_refused(tokenizer_dir: Path) -> None:
    tokenizer, _ = chat_tokenizer(str(tokenizer_dir), "k", [], "tokens")
    tokenizer.chat_template = NOT_A_PREFIX
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(EncodeError, match=r"render turn 1 as a continuation .* located; try X$"):
        encode_chat(tokenizer, messages, advice="; try X")
    tokenizer.chat_template = "{{ raise_exception('nope') }}"
    with pytest.raises(EncodeError, match="chat template failed: nope"):
        encode_chat(tokenizer, messages)


# ---- processor folders -----------------------------------------------------------------------------------
def test_processor_folders_are_local_and_complete(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^w: .* is not a local folder with a preprocessor_config\.json"):
        processor_config(str(tmp_path), "w")
    (tmp_path / "preprocessor_config.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"preprocessor_config\.json: it must hold a JSON object$"):
        processor_config(str(tmp_path), "w")
    with pytest.raises(
        ConfigError, match=r"^w: the tokenizer at .* lacks the qwen image tokens <\|vision\|>$"
    ):
        chat_tokenizer(str(tokenizer_dir), "w", ["<|im_end|>", "<|vision|>"], "qwen image tokens")
    with pytest.raises(ConfigError, match=r"^w: cannot load the tokenizer from"):
        chat_tokenizer(str(tmp_path), "w", [], "tokens")


# ---- collate ---------------------------------------------------------------------------------------------
def test_token_fields_are_right_padded_with_a_mask() -> None:
    class Data:
        pad_token_id = 7

    features: list[dict[str, Any]] = [
        {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([-100, 2, 3]), "sample_id": 4},
        {"input_ids": torch.tensor([5]), "labels": torch.tensor([5]), "skipped_samples": 2},
    ]
    padding = Padding.read({"pad_to_multiple_of": 4}, Data())
    batch = pad_tokens(features, {"input_ids": padding.pad_token_id, "labels": padding.label_pad_id}, padding)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7], [5, 7, 7, 7]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100], [5, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    meta = meta_fields(features)
    assert meta["sample_id"].tolist() == [4, -1] and meta["skipped_samples"] == 2
    assert Padding.read({"ignore_pad_token_for_loss": False}, None) == Padding(0, 0, None)
    with pytest.raises(DataError, match="empty list of samples"):
        pad_tokens([], {}, padding)
    with pytest.raises(ConfigError, match=r"collate_param\.pad_to_multiple_of: got 0"):
        Padding.read({"pad_to_multiple_of": 0}, None)


# ---- on_error: skip --------------------------------------------------------------------------------------
def test_skipping_takes_the_next_good_record_and_lengths_agree() -> None:
    bad = {1, 2}
    skips: list[str] = []

    def encode(i: int) -> dict[str, Any]:
        if i in bad:
            raise DataError(f"record {i} is bad")
        return {"sample_id": i}

    def skipped(e: DataError) -> str:
        skips.append(str(e))
        return skips[0]

    log = logging.getLogger("test")
    sample = fetch_skipping("ds", 1, 4, encode, "skip", skipped, log)
    assert sample == {"sample_id": 3, "skipped_samples": 2} and skips == [
        "record 1 is bad",
        "record 2 is bad",
    ]
    assert fetch_skipping("ds", -1, 4, encode, "skip", skipped, log)["sample_id"] == 3
    with pytest.raises(DataError, match="record 2 is bad"):
        fetch_skipping("ds", 2, 4, encode, "raise", skipped, log)
    with pytest.raises(IndexError, match="sample 4 out of range for 4 samples"):
        fetch_skipping("ds", 4, 4, encode, "skip", skipped, log)
    bad.update({0, 3})
    with pytest.raises(DataError, match=r"^ds: every record failed .*; first: record 1 is bad$"):
        fetch_skipping("ds", 0, 4, encode, "skip", skipped, log)
    # the record that stands in for each one: itself, else the next usable, wrapping around
    assert next_usable(np.array([False, True, False, True, False])).tolist() == [1, 1, 3, 3, 1]
    assert next_usable(np.array([], dtype=bool)).tolist() == []
