"""Loading the Hugging Face tokenizer named by ``preprocess_parameters.model_name_or_path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_core.data.params import PREPROCESS
from mm_core.errors import ConfigError


def load_tokenizer(name_or_path: str, key: str = f"{PREPROCESS}.model_name_or_path") -> Any:
    """Load a tokenizer with ``AutoTokenizer.from_pretrained``; a failure is a ConfigError naming ``key``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing
        where = "" if Path(name_or_path).is_dir() else " (no such local folder)"
        raise ConfigError(f"{key}: cannot load a tokenizer from {name_or_path!r}{where}: {e}") from None


def eos_id(tokenizer: Any, key: str = f"{PREPROCESS}.model_name_or_path") -> int:
    """The tokenizer's end-of-sequence token id; a ConfigError when it has none."""
    token_id = tokenizer.eos_token_id
    if token_id is None:
        raise ConfigError(
            f"{key}: the tokenizer defines no eos_token; set one in its tokenizer_config.json "
            "or set add_eos: false"
        )
    return int(token_id)


def pad_id(tokenizer: Any) -> int:
    """The padding id: the tokenizer's pad token, else its eos token, else 0."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0
