"""text_pretrain prepares once into memory-mapped token shards: the same blocks as tokenising in memory, any
number of preparation processes, reuse, staleness detection and crash safety of the cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _mm import mm_here

import mm_data_text.units as units_mod
from mm_core.data.cache import open_cache, verify_cache
from mm_core.errors import ConfigError, DataError
from mm_data_text.packing import pack_documents
from mm_data_text.pretrain import TextPretrainDataset, encode_documents
from mm_data_text.sources import read_documents
from mm_data_text.units import plan_units, unit_documents

REPO = Path(__file__).resolve().parents[3]


def corpus(n: int = 400) -> list[str]:
    """Real text: paragraphs of the Python language reference shipped with the standard library."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for t in sorted(topics) for p in topics[t].split("\n\n") if p.strip()]
    return paragraphs[:n]


def make(tmp_path: Path, tokenizer_dir: Path, **basic) -> TextPretrainDataset:
    basic.setdefault("dataset_dir", str(tmp_path))
    basic.setdefault("cache_dir", str(tmp_path / "cache"))
    workers = basic.pop("workers", 1)
    return TextPretrainDataset(basic, {"model_name_or_path": str(tokenizer_dir)}, None, workers=workers)


def write_all_formats(tmp_path: Path, docs: list[str]) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    # blank-line documents, some with CRLF line ends and runs of whitespace-only lines between them
    txt = "".join(d.replace("\n", "\r\n" if i % 3 == 0 else "\n") + ("\n \n\n" if i % 2 else "\n\n")
                  for i, d in enumerate(docs))  # fmt: skip
    (tmp_path / "b.txt").write_text(txt, encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=37)


def test_units_read_exactly_the_documents_of_the_whole_file(tmp_path):
    docs = corpus()
    write_all_formats(tmp_path, docs)
    for name in ("a.jsonl", "b.txt", "c.parquet"):
        path = tmp_path / name
        for unit_bytes in (1, 700, 5000, 1 << 30):
            units = plan_units(path, unit_bytes=unit_bytes)
            got = [d for u in units for d in unit_documents(u)]
            assert got == read_documents(path), (name, unit_bytes)
            if unit_bytes == 5000:
                assert len(units) > 3, name


def test_units_name_the_true_line_of_a_bad_record(tmp_path):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(500)]
    lines[431] = '{"text": "broken"'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    units = plan_units(path, unit_bytes=1000)
    assert len(units) > 5
    with pytest.raises(DataError, match=r"bad\.jsonl:432: invalid JSON"):
        for u in units:
            unit_documents(u)
    path.write_bytes(
        b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(300)) + b"\xff\n"
    )
    with pytest.raises(DataError, match=r"bad\.jsonl:301: not valid UTF-8"):
        for u in plan_units(path, unit_bytes=1000):
            unit_documents(u)


def test_blocks_equal_tokenising_in_memory(tmp_path, tokenizer_dir, tokenizer):
    docs = corpus()
    write_all_formats(tmp_path, docs)
    for name in ("a.jsonl", "b.txt"):
        ds = make(tmp_path, tokenizer_dir, dataset=name, seq_len=64)
        eos = tokenizer.eos_token_id
        ref = pack_documents(encode_documents(tokenizer, read_documents(tmp_path / name), eos),
                             64, None)  # fmt: skip
        assert len(ds) == len(ref) > 10
        for i in range(len(ds)):
            got, want = ds[i], ref.block(i)
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(got[key], want[key]), (name, i, key)
        assert ds.sample_lengths().tolist() == [64] * len(ds)


def test_parallel_preparation_gives_the_same_shards(tmp_path, tokenizer_dir, monkeypatch):
    write_all_formats(tmp_path, corpus())
    monkeypatch.setattr(units_mod, "UNIT_BYTES", 20_000)
    one = make(
        tmp_path, tokenizer_dir, dataset=["a.jsonl", "c.parquet"], seq_len=32, cache_dir=str(tmp_path / "c1")
    )
    two = make(tmp_path, tokenizer_dir, dataset=["a.jsonl", "c.parquet"], seq_len=32,
               cache_dir=str(tmp_path / "c2"), workers=2)  # fmt: skip
    assert len(one.store.stems) > 4  # several units, so the two processes really split the work
    assert one.store.stems == two.store.stems and one.source_sizes == two.source_sizes
    assert (one.store.tokens(0, one.num_tokens) == two.store.tokens(0, two.num_tokens)).all()
    assert [one[i]["input_ids"].tolist() for i in (0, 7, len(one) - 1)] == [
        two[i]["input_ids"].tolist() for i in (0, 7, len(two) - 1)
    ]


def test_prepared_once_then_only_mapped(tmp_path, tokenizer_dir):
    write_all_formats(tmp_path, corpus())
    first = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32)
    again = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=16)  # seq_len is applied when reading
    assert first.built and not again.built and first.prepared.path == again.prepared.path
    assert len(again) == again.num_tokens // 16
    # a setting that changes the tokens is another cache
    no_eos = TextPretrainDataset(
        {"dataset": str(tmp_path / "a.jsonl"), "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
        {"model_name_or_path": str(tokenizer_dir), "add_eos": False},
        None,
    )
    assert no_eos.built and no_eos.prepared.path != first.prepared.path
    assert verify_cache(again.prepared) == []
    basic = {"dataset": str(tmp_path / "a.jsonl"), "seq_len": 32, "cache_dir": str(tmp_path / "cache")}
    status = TextPretrainDataset.preflight(basic, {"model_name_or_path": str(tokenizer_dir)})[1]
    assert status == f"tokens prepared and current in {first.prepared.path}"


def test_stale_sources_and_shards_are_named_rebuilt_or_refused(tmp_path, tokenizer_dir, caplog):
    write_all_formats(tmp_path, corpus())
    ds = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32)
    src = tmp_path / "a.jsonl"
    with open(src, "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more document at the end"}) + "\n")
    with pytest.raises(
        DataError, match=r"a\.jsonl: size changed from [\d,]+ to [\d,]+ bytes.*mm data prepare"
    ):
        make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32, cache_stale="error")
    with caplog.at_level(logging.WARNING):
        rebuilt = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32)
    assert rebuilt.built and "a.jsonl: size changed" in caplog.text
    assert rebuilt.num_documents == ds.num_documents + 1
    # a truncated shard is found by its size
    shard = next(rebuilt.prepared.path.glob("*.tok"))
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"\.tok: prepared file has [\d,]+ bytes, expected"):
        make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32, cache_stale="error")
    healed = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32)
    assert healed.built and verify_cache(healed.prepared) == []
    # corruption that keeps size and mtime: only the hashes find it (mm data verify)
    st = src.stat()
    data = bytearray(src.read_bytes())
    data[10] = ord("Q") if data[10] != ord("Q") else ord("R")
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32).built
    assert any("sha256 differs" in p for p in verify_cache(healed.prepared))


def test_a_failed_build_leaves_the_last_good_cache(tmp_path):
    src = tmp_path / "s.txt"
    src.write_text("data", encoding="utf-8")

    def good(folder: Path) -> dict:
        (folder / "x.bin").write_bytes(b"12345")
        return {"n": 5}

    def crash(folder: Path) -> dict:
        (folder / "x.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    prepared, built = open_cache(root=tmp_path / "c", name="t", spec={}, sources=[src], build=good)
    assert built and prepared.payload == {"n": 5}
    with pytest.raises(KeyboardInterrupt):
        open_cache(root=tmp_path / "c", name="t", spec={}, sources=[src], build=crash, overwrite=True)
    again, built = open_cache(root=tmp_path / "c", name="t", spec={}, sources=[src], build=crash)
    assert not built and (again.path / "x.bin").read_bytes() == b"12345"
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name.startswith(".")] == []


def test_an_id_outside_the_vocabulary_names_the_shard(tmp_path, tokenizer_dir):
    """A shard corrupted in place (same size and mtime) with an id past the vocabulary: reading the block
    names the file and ``mm data verify`` (before: ``IndexError`` in the model's embedding)."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus(40)), "utf-8")
    ds = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32)
    assert int(ds[1]["input_ids"].max()) < ds.store.vocab_size
    shard = next(ds.prepared.path.glob("*.tok"))
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[32 * ds.store.dtype.itemsize : 33 * ds.store.dtype.itemsize] = b"\xff" * ds.store.dtype.itemsize
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=32)
    assert not again.built  # size and mtime unchanged: only the hashes would see it
    with pytest.raises(
        DataError, match=rf"{shard.name}: token id \d+ at token 32 is outside .*mm data verify"
    ):
        again[1]
    assert int(again[0]["input_ids"].max()) < again.store.vocab_size  # other blocks still read


def test_a_source_that_disappears_while_preparing_is_named(tmp_path):
    src = tmp_path / "s.txt"
    src.write_text("data", encoding="utf-8")

    def read_then_lose(folder: Path) -> dict:
        (folder / "x.bin").write_bytes(src.read_bytes())
        src.unlink()  # another process removes the source mid-preparation
        return {"n": 4}

    with pytest.raises(DataError, match=r"s\.txt: disappeared while it was being prepared"):
        open_cache(root=tmp_path / "c", name="t", spec={}, sources=[src], build=read_then_lose)
    left = [p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")]
    assert left == []  # no published cache, no temporary folder


def test_a_cache_dir_that_is_a_file_is_named(tmp_path, tokenizer_dir):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n", encoding="utf-8")
    (tmp_path / "not_a_folder").write_text("", encoding="utf-8")
    for where, said in (("not_a_folder", "is a file"), ("not_a_folder/sub", "lies under")):
        with pytest.raises(ConfigError, match=f"basic_parameters.cache_dir: .*{said}"):
            make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=8, cache_dir=str(tmp_path / where))


def test_mm_data_prepare_and_verify(tmp_path):
    """``mm data prepare`` (2 preparation processes) as a subprocess, then the later commands in this
    process through the same entry (``_mm.mm_here``): exit status and output."""
    cfg = REPO / "examples" / "quickstart" / "config.yaml"
    cache = f"data.dataset_param.basic_parameters.cache_dir={tmp_path}"
    # nothing prepared yet: verify refuses in one line and prepares nothing
    empty = mm_here("data", "verify", str(cfg), cache)
    assert empty.returncode == 2 and "no prepared text_pretrain data in" in empty.stderr, empty.stderr
    assert "mm data prepare" in empty.stderr and "verified" not in empty.stdout
    assert not list(tmp_path.glob("text_pretrain-*"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mm_core.cli", "data", "prepare", str(cfg), cache, "--workers", "2"]
    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "text_pretrain: prepared:" in first.stdout and "blocks of 256" in first.stdout

    def mm(*args: str) -> subprocess.CompletedProcess:
        return mm_here("data", *args)  # cwd: the repository root (the quickstart's paths are relative to it)

    second = mm("prepare", str(cfg), cache)
    assert "already prepared (current)" in second.stdout
    ok = mm("verify", str(cfg), cache)
    assert ok.returncode == 0 and "verified" in ok.stdout
    shard = next(tmp_path.glob("text_pretrain-*/*.tok"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    bad = mm("verify", str(cfg), cache)
    assert bad.returncode == 1 and "prepared file is corrupt" in bad.stdout
