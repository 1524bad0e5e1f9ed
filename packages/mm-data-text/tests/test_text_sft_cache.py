"""The sft dataset prepares its data once into the cache (mm_core.data.cache): reused, prepared in parallel
with the same result, rebuilt or refused when a source changed, skipped records counted and named."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

import mm_data_text.units
from mm_core.errors import ConfigError, DataError
from mm_data_text.packing import IGNORE_INDEX
from mm_data_text.sft import SFTDataset

REPLY = {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."}


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: what does the fox do?"}, REPLY]}


LONG_PROMPT = {"messages": [{"role": "user", "content": "lazy dog " * 40}, REPLY]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make(tmp_path: Path, tokenizer_dir: Path, **basic) -> SFTDataset:
    basic = {"dataset_dir": str(tmp_path), "dataset": "chat.jsonl", "cutoff_len": 48, **basic}
    workers = basic.pop("workers", 1)
    return SFTDataset(basic, {"model_name_or_path": str(tokenizer_dir)}, None, workers=workers)


def items(ds: SFTDataset) -> list[tuple[list[int], list[int]]]:
    return [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))]


def test_prepared_once_then_mapped(tmp_path, tokenizer_dir, caplog):
    rows = [chat(i) for i in range(5)] + [LONG_PROMPT] + [chat(i) for i in range(5, 8)]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="mm_data_text.sft"):
        first = make(tmp_path, tokenizer_dir)
    assert first.built and len(first) == 8 and first.num_skipped == 1
    assert first.skipped == [f"{tmp_path / 'chat.jsonl'}:6"]
    assert first.prepared.payload["skipped_at"] == first.skipped
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "skipped 1 samples" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mm_data_text.sft"):
        again = make(tmp_path, tokenizer_dir)
    assert not again.built and again.prepared.path == first.prepared.path
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # warned once, when prepared
    assert items(again) == items(first) and again.num_skipped == 1 and again.skipped == first.skipped
    item = again[3]
    assert set(item) == {"input_ids", "labels", "position_ids", "sample_id"} and item["sample_id"] == 3
    assert item["position_ids"].tolist() == list(range(len(item["input_ids"])))
    labelled = item["labels"] != IGNORE_INDEX
    assert labelled.any() and (item["labels"][labelled] == item["input_ids"][labelled]).all()
    assert again.sample_lengths().tolist() == [len(ids) for ids, _ in items(again)]
    # a different cutoff_len is another preparation
    assert make(tmp_path, tokenizer_dir, cutoff_len=40).built


@pytest.mark.slow
def test_parallel_preparation_gives_the_same_samples(tmp_path, tokenizer_dir, monkeypatch):
    rows = [chat(i) if i % 7 else LONG_PROMPT for i in range(60)]
    write_jsonl(tmp_path / "a.jsonl", rows[:40])
    write_jsonl(tmp_path / "b.jsonl", rows[40:])
    monkeypatch.setattr(mm_data_text.units, "UNIT_BYTES", 1500)
    common = {"dataset": ["a.jsonl", "b.jsonl"], "weights": [1, 2]}
    serial = make(tmp_path, tokenizer_dir, cache_dir=str(tmp_path / "c1"), workers=1, **common)
    parallel = make(tmp_path, tokenizer_dir, cache_dir=str(tmp_path / "c2"), workers=2, **common)
    assert parallel.built and serial.built
    shards = [len(source) for source in parallel.prepared.payload["sources"]]
    assert shards[0] > 2 and shards[1] > 1  # several units per file
    assert items(parallel) == items(serial)
    assert parallel.num_skipped == serial.num_skipped == 9 and parallel.skipped == serial.skipped
    assert parallel.skipped[:2] == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'a.jsonl'}:8"]
    assert parallel.source_sizes == serial.source_sizes == [34, 17] and parallel.source_weights == [1.0, 2.0]


def test_record_errors_name_the_file_and_line_in_any_unit(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(mm_data_text.units, "UNIT_BYTES", 1000)
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(chat(i)) for i in range(30)]
    path.write_text("\n".join([*lines[:25], "not json", *lines[25:]]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"chat\.jsonl:26: invalid JSON"):
        make(tmp_path, tokenizer_dir)
    write_jsonl(path, [*[chat(i) for i in range(20)], {"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"chat\.jsonl:21: messages\[0\]\.role is 'bot'"):
        make(tmp_path, tokenizer_dir)
    with pytest.raises(ConfigError, match=r"basic_parameters\.weights: got 2 weights for 1 dataset entries"):
        make(tmp_path, tokenizer_dir, weights=[1, 2])


def test_a_changed_source_is_named_then_rebuilt_or_refused(tmp_path, tokenizer_dir, caplog):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(4)])
    assert make(tmp_path, tokenizer_dir).built
    write_jsonl(path, [chat(i) for i in range(6)])
    with pytest.raises(
        DataError, match=rf"is stale: {re.escape(str(path.resolve()))}: size changed .*cache_stale: rebuild"
    ):
        make(tmp_path, tokenizer_dir, cache_stale="error")
    with caplog.at_level(logging.WARNING):
        rebuilt = make(tmp_path, tokenizer_dir)
    assert rebuilt.built and len(rebuilt) == 6
    assert any("stale" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_prepare_and_verify(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(3)] + [LONG_PROMPT])
    basic = {"dataset_dir": str(tmp_path), "dataset": "chat.jsonl", "cutoff_len": 48}
    pre = {"model_name_or_path": str(tokenizer_dir)}
    state, summary = SFTDataset.prepare(basic, pre, workers=1)
    assert state.startswith("prepared: ") and "3 samples, 1 skipped (first: " in summary, summary
    assert SFTDataset.prepare(basic, pre)[0].startswith("already prepared (current): ")
    assert SFTDataset.verify(basic, pre) == []
    ds = SFTDataset(basic, pre)
    tok = next(ds.prepared.path.glob("*.tok"))
    data = bytearray(tok.read_bytes())
    data[0] ^= 1
    tok.write_bytes(bytes(data))  # same size: only the hash finds it
    (problem,) = SFTDataset.verify(basic, pre)
    assert problem == f"{tok}: prepared file is corrupt (sha256 differs)"
