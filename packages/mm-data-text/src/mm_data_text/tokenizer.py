"""Loading the Hugging Face tokenizer named by ``preprocess_parameters.model_name_or_path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_core.data.params import PREPROCESS
from mm_core.errors import ConfigError


def check_local_folder(name_or_path: str, key: str = f"{PREPROCESS}.model_name_or_path") -> Path:
    """The folder ``name_or_path`` names; a ConfigError naming ``key`` when it is not a local folder (a hub
    id such as ``Qwen/Qwen3-0.6B`` included: mm never downloads)."""
    path = Path(name_or_path)
    if not path.is_dir():
        raise ConfigError(
            f"{key}: {name_or_path!r} is not a local folder (relative paths start at the current directory "
            f"{Path.cwd()}); mm never downloads, so download the tokenizer first (e.g. `hf download "
            "<repo> --local-dir <folder>`) and give that folder"
        )
    return path


def load_tokenizer(name_or_path: str, key: str = f"{PREPROCESS}.model_name_or_path") -> Any:
    """Load a tokenizer from a local folder with ``AutoTokenizer.from_pretrained(..., local_files_only=True)``
    (never the network); a failure is a ConfigError naming ``key``."""
    check_local_folder(name_or_path, key)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing
        reason = " ".join(str(e).split())
        raise ConfigError(
            f"{key}: cannot load a tokenizer from the folder {name_or_path!r}: {reason}"
        ) from None


_LOADED: dict[tuple[str, str], Any] = {}


def cached_tokenizer(path: str, fingerprint: str) -> Any:
    """The tokenizer at ``path``, loaded once per process and version of its files (``fingerprint``, from
    :func:`mm_core.data.cache.tokenizer_fingerprint`): preparation processes tokenise many units with it."""
    key = (path, fingerprint)
    if key not in _LOADED:
        _LOADED[key] = load_tokenizer(path)
    return _LOADED[key]


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
