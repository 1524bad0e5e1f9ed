"""Tiny inputs for the LM / flow / data tests of mm-models-cosyvoice: synthetic utterances (sines, random
speech tokens), a byte-level BPE tokenizer trained locally, and tiny model configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mm_core.data.bpe import write_bytelevel_bpe
from mm_core.models import ModelArguments
from mm_models_cosyvoice.store import Utterance, write_store

VOCAB = 40
TINY_LM = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "speech_vocab": VOCAB,
}
TINY_FLOW = {
    "vocab_size": VOCAB,
    "pre_lookahead_channels": 16,
    "dim": 32,
    "depth": 2,
    "heads": 2,
    "dim_head": 16,
    "conv_pos_groups": 4,
    "dropout": 0.0,
    "static_chunk_size": 4,
}


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


def lm_args(**overrides: object) -> ModelArguments:
    return ModelArguments(
        model_id="cosyvoice3_lm", from_scratch=True, config_overrides={**TINY_LM, **overrides}
    )


def flow_args(**overrides: object) -> ModelArguments:
    return ModelArguments(
        model_id="cosyvoice3_flow", from_scratch=True, config_overrides={**TINY_FLOW, **overrides}
    )
