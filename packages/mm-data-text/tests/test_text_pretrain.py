import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mm_core.errors import ConfigError, DataError
from mm_data_text.packing import IGNORE_INDEX
from mm_data_text.pretrain import TextPretrainDataset
from mm_data_text.sources import read_documents, resolve_paths


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


DOCS = ["The quick brown fox jumps over the lazy dog.", "Hello! How can I help you today?", "def add(a, b):"]


def make(tmp_path, tokenizer_dir, **basic):
    basic.setdefault("dataset_dir", str(tmp_path))
    return TextPretrainDataset(basic, {"model_name_or_path": str(tokenizer_dir)}, None, seed=0)


def test_jsonl_txt_parquet_read_the_same_documents(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    (tmp_path / "b.txt").write_text("\n\n".join(DOCS) + "\n\n\n", encoding="utf-8")
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "c.parquet")
    assert read_documents(tmp_path / "a.jsonl") == DOCS
    assert read_documents(tmp_path / "b.txt") == DOCS
    assert read_documents(tmp_path / "c.parquet", text_key="body") == DOCS
    (tmp_path / "d.txt").write_text("line one\nline two\n\n  \nnext doc\n", encoding="utf-8")
    assert read_documents(tmp_path / "d.txt") == ["line one\nline two", "next doc"]
    assert read_documents(tmp_path / "d.txt", txt_document="file") == ["line one\nline two\n\n  \nnext doc\n"]


def test_dataset_stream_is_documents_plus_eos(tmp_path, tokenizer_dir, tokenizer):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS * 4])
    ds = make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=8)
    expected = []
    for d in DOCS * 4:
        expected += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(ds) == len(expected) // 8 and ds.dropped_tokens == len(expected) % 8
    got = torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist()
    assert got == expected[: len(ds) * 8]
    item = ds[1]
    assert set(item) == {"input_ids", "labels", "position_ids", "sample_id"} and item["sample_id"] == 1
    starts = (item["position_ids"] == 0).nonzero().flatten().tolist()
    assert starts[0] == 0
    for s in starts[1:]:
        assert item["labels"][s] == IGNORE_INDEX
        assert item["input_ids"][s - 1] == tokenizer.eos_token_id
    assert (item["labels"] != IGNORE_INDEX).sum() == 8 - len(starts[1:])


def test_paths_lists_dirs_and_parquet(tmp_path, tokenizer_dir):
    sub = tmp_path / "corpus"
    sub.mkdir()
    write_jsonl(sub / "x.jsonl", [{"text": d} for d in DOCS])
    pq.write_table(pa.table({"text": DOCS}), sub / "y.parquet")
    (sub / "notes.md").write_text("ignored")
    assert [p.name for p in resolve_paths("corpus", str(tmp_path), (".jsonl", ".parquet"))] == [
        "x.jsonl",
        "y.parquet",
    ]
    by_dir = make(tmp_path, tokenizer_dir, dataset="corpus", seq_len=4)
    by_list = make(tmp_path, tokenizer_dir, dataset=["corpus/x.jsonl", "corpus/y.parquet"], seq_len=4)
    by_glob = make(tmp_path, tokenizer_dir, dataset="corpus/*.jsonl", seq_len=4)
    assert by_dir.num_documents == 6
    whole = by_dir.store.tokens(0, by_dir.num_tokens)
    assert (whole == by_list.store.tokens(0, by_list.num_tokens)).all() and by_glob.num_documents == 3
    # a directory is one source; a list of two files is two sources whose blocks never cross between them
    assert by_dir.source_sizes == [by_dir.num_tokens // 4] and len(by_list.source_sizes) == 2


def test_malformed_jsonl_names_file_and_line(tmp_path, tokenizer_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken"\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON: "):
        make(tmp_path, tokenizer_dir, dataset="bad.jsonl", seq_len=4)
    write_jsonl(path, [{"text": "ok"}, {"txt": "no key"}])
    with pytest.raises(DataError, match=r'bad\.jsonl:2: missing key "text"'):
        make(tmp_path, tokenizer_dir, dataset="bad.jsonl", seq_len=4)
    write_jsonl(path, [{"text": 3}])
    with pytest.raises(DataError, match=r'bad\.jsonl:1: "text" must be a string, got int'):
        make(tmp_path, tokenizer_dir, dataset="bad.jsonl", seq_len=4)
    write_jsonl(path, [[1, 2]])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: expected a JSON object, got list"):
        make(tmp_path, tokenizer_dir, dataset="bad.jsonl", seq_len=4)


def test_bad_parquet(tmp_path, tokenizer_dir):
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r'c\.parquet: missing column "text" \(columns: content\)'):
        make(tmp_path, tokenizer_dir, dataset="c.parquet", seq_len=4)
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r'n\.parquet: row 1: "text" is null'):
        make(tmp_path, tokenizer_dir, dataset="n.parquet", seq_len=4)


def test_config_errors(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    with pytest.raises(ConfigError, match=r"basic_parameters\.seqlen: unknown key; did you mean 'seq_len'\?"):
        make(tmp_path, tokenizer_dir, dataset="a.jsonl", seqlen=4)
    with pytest.raises(
        ConfigError, match=r"^data\.dataset_param\.basic_parameters\.seq_len: missing; expected a"
    ):
        make(tmp_path, tokenizer_dir, dataset="a.jsonl")
    with pytest.raises(ConfigError, match=r"basic_parameters\.dataset: 'nope\.jsonl' does not exist"):
        make(tmp_path, tokenizer_dir, dataset="nope.jsonl", seq_len=4)
    with pytest.raises(
        ConfigError, match=r"preprocess_parameters\.add_eso: unknown key; did you mean 'add_eos'"
    ):
        TextPretrainDataset(
            {"dataset": str(tmp_path / "a.jsonl"), "seq_len": 4},
            {"model_name_or_path": str(tokenizer_dir), "add_eso": True},
            None,
            seed=0,
        )
    with pytest.raises(
        ConfigError, match=r"preprocess_parameters\.model_name_or_path: '.*missing_tok' is not a local folder"
    ):
        TextPretrainDataset(
            {"dataset": str(tmp_path / "a.jsonl"), "seq_len": 4},
            {"model_name_or_path": str(tmp_path / "missing_tok")},
            None,
            seed=0,
        )
    with pytest.raises(DataError, match=r"fewer than one block"):
        make(tmp_path, tokenizer_dir, dataset="a.jsonl", seq_len=10_000)
