"""Shared fixtures: a tiny byte-level BPE tokenizer built in a temp folder (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_data_text.tokenizer_build import train_bytelevel_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Packing documents into blocks keeps every token useful.",
    "Assistant replies carry labels; prompts do not.",
    "def add(a, b):\n    return a + b\n",
    "Hello! How can I help you today?",
] * 20


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bytelevel_bpe(CORPUS, 400, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
