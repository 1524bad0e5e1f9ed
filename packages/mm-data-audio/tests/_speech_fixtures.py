"""Tiny inputs for the CosyVoice3 speech-data tests: synthetic utterances (sines, random speech tokens) and a
byte-level BPE tokenizer trained locally."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mm_core.data.bpe import write_bytelevel_bpe
from mm_data_audio.cosyvoice.store import Utterance, write_store

VOCAB = 40


def sine(tokens: int, freq: float = 220.0) -> np.ndarray:
    t = np.arange(960 * tokens) / 24000
    return 0.3 * np.sin(2 * np.pi * freq * t)


def utterances(n: int = 4, seed: int = 0) -> list[Utterance]:
    rng = np.random.default_rng(seed)
    return [
        Utterance(
            f"u{i}",
            f"hello world {i}",
            sine(6 + 3 * i, 200.0 + 40 * i),
            rng.integers(0, VOCAB, 6 + 3 * i),
            speaker=rng.standard_normal(192) if i % 2 else None,
        )
        for i in range(n)
    ]


def store(root: Path, n: int = 4) -> Path:
    return write_store(root, utterances(n), VOCAB)


def tokenizer(folder: Path) -> Path:
    return write_bytelevel_bpe(
        ["hello world one two three", "You are a helpful assistant."] * 10,
        280,
        folder,
        special_tokens=["<|endoftext|>", "<|endofprompt|>"],
        chat_template="",
    )
