"""Loading a model's processor folder from local files only (mm never downloads): its
``preprocessor_config.json`` and its tokenizer, which must know the media special tokens and have a chat
template.

Shared by the datasets that encode media beside chat text (mm-data-vlm's ``vlm_sft``, mm-data-audio's
``audio_sft`` / ``asr_manifest``), which may not import each other; what the config means (which image or
audio format) stays with each. Every failure is a ConfigError naming ``where`` (the YAML key,
``...preprocess_parameters.model_name_or_path``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from mm_core.errors import ConfigError


def processor_config(path: str, where: str) -> tuple[Path, dict[str, Any]]:
    """The folder's ``preprocessor_config.json`` and the JSON object it holds; a ConfigError when the folder
    has none or it is not a JSON object (the caller names the file the same way when its values are
    refused: ``<where>: <file>: <reason>``)."""
    config_file = Path(path) / "preprocessor_config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"{where}: {path!r} is not a local folder with a preprocessor_config.json (the model's "
            "Hugging Face processor files; mm never downloads, so download it first, e.g. with "
            "`hf download`, and give the folder)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("it must hold a JSON object")
    except ValueError as e:  # json.JSONDecodeError included
        raise ConfigError(f"{where}: {config_file}: {' '.join(str(e).split())}") from None
    return config_file, config


def chat_tokenizer(path: str, where: str, tokens: Sequence[str], what: str) -> tuple[Any, dict[str, int]]:
    """The tokenizer of the folder and the ids of ``tokens``; a ConfigError when it cannot be loaded, lacks
    one of ``tokens`` (``lacks the <what> <tokens>``) or has no chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing or broken
        raise ConfigError(
            f"{where}: cannot load the tokenizer from {path!r}: {' '.join(str(e).split())}"
        ) from None
    names = list(tokens)
    # a list of tokens gives a list of ids (the stub's result is int | list[int])
    ids = cast("list[int | None]", tokenizer.convert_tokens_to_ids(names))
    missing = [t for t, i in zip(names, ids) if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise ConfigError(f"{where}: the tokenizer at {path!r} lacks the {what} {', '.join(missing)}")
    if not isinstance(tokenizer.chat_template, str) or not tokenizer.chat_template:
        raise ConfigError(f"{where}: the tokenizer at {path!r} has no chat_template")
    return tokenizer, {t: int(cast("int", i)) for t, i in zip(names, ids)}
