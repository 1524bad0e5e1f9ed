"""What ``mm check`` verifies for text data without tokenising the corpus (the datasets' ``preflight``
hooks), tokenizers that load from local folders only, and files that are not UTF-8 (line and byte offset)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mm_core.errors import ConfigError, DataError
from mm_data_text.pretrain import TextPretrainDataset
from mm_data_text.sft import SFTDataset
from mm_data_text.sources import first_document, read_documents
from mm_data_text.tokenizer import load_tokenizer

CHAT = {"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."}]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ first_document
def test_first_document_of_each_format_matches_the_full_read(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"text": ""}, {"text": "first doc"}, {"text": "second"}])
    (tmp_path / "b.txt").write_text("\n\nline one\nline two\n\nnext doc\n", encoding="utf-8")
    pq.write_table(pa.table({"text": ["", "parquet doc", "more"]}), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.txt", "c.parquet"):
        path = tmp_path / name
        assert first_document(path) == read_documents(path)[0], name
    assert first_document(tmp_path / "b.txt", txt_document="file") == (tmp_path / "b.txt").read_text()


def test_first_document_of_an_empty_file_is_none(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])
    (tmp_path / "e.txt").write_text("\n \n", encoding="utf-8")
    assert first_document(tmp_path / "e.jsonl") is None and first_document(tmp_path / "e.txt") is None


def test_first_document_reads_no_further_than_it_needs(tmp_path: Path) -> None:
    # a broken line after the first document is the full build's business, not the preflight's
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "good"}\n{broken\n')
    assert first_document(path) == "good"
    with pytest.raises(DataError, match=r"a\.jsonl:2: invalid JSON"):
        read_documents(path)


def test_first_document_errors_name_file_and_line(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"body": "x"}])
    with pytest.raises(DataError, match=r'a\.jsonl:1: missing key "text" \(keys present: body\)'):
        first_document(tmp_path / "a.jsonl")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r'c\.parquet: missing column "text"'):
        first_document(tmp_path / "c.parquet")


# ------------------------------------------------------------------------------------------ not UTF-8
@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_non_utf8_names_file_line_and_byte_offset(tmp_path: Path, suffix: str) -> None:
    good = b'{"text": "fine"}\n' if suffix == ".jsonl" else b"fine\n\n"
    bad = '{"text": "caf\u00e9"}\n' if suffix == ".jsonl" else "caf\u00e9\n"
    data = good + good + bad.encode("latin-1")
    path = tmp_path / f"d{suffix}"
    path.write_bytes(data)
    offset, line = data.index(b"\xe9"), data[: data.index(b"\xe9")].count(b"\n") + 1
    with pytest.raises(DataError) as info:
        read_documents(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:{line}: not valid UTF-8 at byte offset {offset} "), msg
    path.write_bytes(bad.encode("latin-1"))  # the preflight reads the first document: the same message
    at = bad.encode("latin-1").index(b"\xe9")
    with pytest.raises(DataError, match=rf"d\{suffix}:1: not valid UTF-8 at byte offset {at} "):
        first_document(path)


# ------------------------------------------------------------------------------------------ local tokenizers
def test_a_hub_id_fails_at_once_with_one_line() -> None:
    env_before = os.environ.pop("HF_HUB_OFFLINE", None)  # the check must not rely on it
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError) as info:
            load_tokenizer("Qwen/Qwen3-0.6B")
        elapsed = time.monotonic() - start
    finally:
        if env_before is not None:
            os.environ["HF_HUB_OFFLINE"] = env_before
    assert elapsed < 5, elapsed
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(
        "data.dataset_param.preprocess_parameters.model_name_or_path: 'Qwen/Qwen3-0.6B' is not a local folder"
    ), msg


def test_a_folder_without_tokenizer_files_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(
        "data.dataset_param.preprocess_parameters.model_name_or_path: cannot load a tokenizer from the "
        f"folder {str(tmp_path)!r}: "
    ), msg


def test_tokenizers_never_reach_the_network(tokenizer_dir: Path, tmp_path: Path) -> None:
    # a fresh interpreter where opening a connection leaves a marker (HF_HUB_OFFLINE etc. unset): a local
    # folder loads, a hub id is refused, and neither tries the network
    marker = tmp_path / "network_used"
    code = (
        "import socket\n"
        "def refuse(*a, **k):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    raise OSError('network used')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "socket.getaddrinfo = refuse\n"
        "from mm_core.errors import ConfigError\n"
        "from mm_data_text.tokenizer import load_tokenizer\n"
        f"print(len(load_tokenizer({str(tokenizer_dir)!r})))\n"
        "try:\n"
        "    load_tokenizer('Qwen/Qwen3-0.6B')\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    size, error = proc.stdout.strip().splitlines()[-2:]
    assert int(size) > 0
    assert "'Qwen/Qwen3-0.6B' is not a local folder" in error, error
    assert not marker.exists(), "loading a tokenizer tried the network"


# ------------------------------------------------------------------------------------------ preflight hooks
def test_pretrain_preflight_checks_every_file_and_the_tokenizer(tokenizer_dir: Path, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."}])
    write_jsonl(tmp_path / "b.jsonl", [{"body": "wrong key"}])
    basic = {"dataset_dir": str(tmp_path), "dataset": "a.jsonl", "seq_len": 8}
    pre = {"model_name_or_path": str(tokenizer_dir)}
    line, cache = TextPretrainDataset.preflight(basic, pre)
    assert cache.startswith("tokens not prepared yet: the first start (or `mm data prepare`) prepares it")
    assert line.startswith(f"1 file(s), 0.0 MiB ({tmp_path / 'a.jsonl'}); tokenizer {tokenizer_dir} (")
    assert "first document: " in line and "(seq_len 8)" in line, line
    with pytest.raises(DataError, match=r'b\.jsonl:1: missing key "text"'):
        TextPretrainDataset.preflight({**basic, "dataset": ["a.jsonl", "b.jsonl"]}, pre)
    with pytest.raises(ConfigError, match=r"basic_parameters\.dataset: 'c\.jsonl' does not exist"):
        TextPretrainDataset.preflight({**basic, "dataset": ["a.jsonl", "c.jsonl"]}, pre)
    with pytest.raises(ConfigError, match=r"basic_parameters\.seqlen: unknown key; did you mean 'seq_len'"):
        TextPretrainDataset.preflight({"dataset": "a.jsonl", "seqlen": 8}, pre)
    write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])
    with pytest.raises(DataError, match="no document in any file"):
        TextPretrainDataset.preflight({**basic, "dataset": "e.jsonl"}, pre)


def test_sft_preflight_encodes_the_first_record(tokenizer_dir: Path, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "chat.jsonl", [CHAT, {"messages": "not a list"}])
    basic = {"dataset_dir": str(tmp_path), "dataset": "chat.jsonl"}
    pre = {"model_name_or_path": str(tokenizer_dir)}
    line, cache = SFTDataset.preflight(basic, pre)
    assert cache.startswith("samples not prepared yet"), cache
    full = SFTDataset(basic | {"dataset": str(write_jsonl(tmp_path / "one.jsonl", [CHAT]))}, pre)
    assert f"first record: {len(full[0]['input_ids']):,} tokens (cutoff_len 2048)" in line, line
    write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: the conversation has no assistant message"):
        SFTDataset.preflight({**basic, "dataset": ["chat.jsonl", "bad.jsonl"]}, pre)
