"""Tiny model configs for the LM / flow tests of mm-models-cosyvoice."""

from __future__ import annotations

from mm_core.models import ModelArguments

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


def lm_args(**overrides: object) -> ModelArguments:
    return ModelArguments(
        model_id="cosyvoice3_lm", from_scratch=True, config_overrides={**TINY_LM, **overrides}
    )


def flow_args(**overrides: object) -> ModelArguments:
    return ModelArguments(
        model_id="cosyvoice3_flow", from_scratch=True, config_overrides={**TINY_FLOW, **overrides}
    )
