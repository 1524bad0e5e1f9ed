"""``sft``: chat conversations (``messages`` jsonl) rendered with the tokenizer's chat template."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mm_core.data.params import BASIC, PREPROCESS, optional_string, paths, positive_int, read_params, string
from mm_core.errors import ConfigError, DataError

from .chat import ChatEncodeError, encode_conversation, uses_generation_markers
from .packing import IGNORE_INDEX
from .sources import describe_files, iter_jsonl, resolve_paths
from .tokenizer import load_tokenizer, pad_id

logger = logging.getLogger(__name__)

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "cutoff_len": positive_int(2048),
    "messages_key": string("messages"),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": string(),
}
ROLES = ("system", "user", "assistant")


def check_messages(messages: Any, where: str, key: str) -> list[dict[str, str]]:
    """Validate one record's conversation; DataError names ``where`` (``file:line``)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "{key}" must be a non-empty list of {{"role", "content"}} objects')
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {key}[{i}] must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: {key}[{i}].role is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: {key}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing would be trained")
    return out


class SFTDataset(torch.utils.data.Dataset):
    """Supervised fine-tuning samples: labels only on assistant replies and their end-of-turn token.

    Each sample is truncated to ``cutoff_len`` tokens (the tail is cut). A sample left without any
    labelled token after truncation is skipped; ``num_skipped`` counts them and a warning reports them.
    """

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
    ) -> None:
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.seed = seed
        self.cutoff_len: int = basic["cutoff_len"]
        self.files = resolve_paths(basic["dataset"], basic["dataset_dir"], (".jsonl",))
        tokenizer = load_tokenizer(pre["model_name_or_path"])
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ConfigError(
                f"{PREPROCESS}.model_name_or_path: the tokenizer at {pre['model_name_or_path']!r} "
                "has no (single) chat_template; add one to its tokenizer_config.json"
            )
        with_markers = uses_generation_markers(template)
        self.pad_token_id = pad_id(tokenizer)

        ids_parts: list[torch.Tensor] = []
        label_parts: list[torch.Tensor] = []
        self.skipped: list[str] = []
        for path in self.files:
            self._read_file(path, basic["messages_key"], tokenizer, with_markers, ids_parts, label_parts)
        self.num_skipped = len(self.skipped)
        if not ids_parts:
            raise DataError(
                f"{', '.join(str(p) for p in self.files)}: no sample keeps an assistant token "
                f"within {BASIC}.cutoff_len = {self.cutoff_len}"
            )
        lengths = torch.tensor([len(t) for t in ids_parts], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.input_ids = torch.cat(ids_parts)
        self.labels = torch.cat(label_parts)
        if self.skipped:
            logger.warning(
                "sft: skipped %d samples with no assistant token within cutoff_len=%d (first: %s)",
                self.num_skipped,
                self.cutoff_len,
                ", ".join(self.skipped[:5]),
            )

    def _read_file(
        self,
        path: Path,
        key: str,
        tokenizer: Any,
        with_markers: bool,
        ids_parts: list[torch.Tensor],
        label_parts: list[torch.Tensor],
    ) -> None:
        for lineno, obj in iter_jsonl(path):
            where = f"{path}:{lineno}"
            if key not in obj:
                raise DataError(f'{where}: missing key "{key}" (keys present: {", ".join(obj) or "none"})')
            messages = check_messages(obj[key], where, key)
            try:
                ids, labels = encode_conversation(tokenizer, messages, with_markers)
            except ChatEncodeError as e:
                raise DataError(f"{where}: {e}") from None
            ids, labels = ids[: self.cutoff_len], labels[: self.cutoff_len]
            if all(label == IGNORE_INDEX for label in labels):
                self.skipped.append(where)
                continue
            ids_parts.append(torch.tensor(ids, dtype=torch.int32))
            label_parts.append(torch.tensor(labels, dtype=torch.int32))

    @classmethod
    def preflight(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
    ) -> list[str]:
        """What ``mm check`` verifies without encoding every conversation: the keys, that every file exists,
        the tokenizer and its chat template (local files only), and the first record of every file (checked;
        the first one encoded). Raises ConfigError/DataError as building the dataset would."""
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        files = resolve_paths(basic["dataset"], basic["dataset_dir"], (".jsonl",))
        tokenizer = load_tokenizer(pre["model_name_or_path"])
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ConfigError(
                f"{PREPROCESS}.model_name_or_path: the tokenizer at {pre['model_name_or_path']!r} "
                "has no (single) chat_template; add one to its tokenizer_config.json"
            )
        key = basic["messages_key"]
        first: tuple[str, list[dict[str, str]]] | None = None
        for path in files:
            for lineno, obj in iter_jsonl(path):
                where = f"{path}:{lineno}"
                if key not in obj:
                    raise DataError(
                        f'{where}: missing key "{key}" (keys present: {", ".join(obj) or "none"})'
                    )
                messages = check_messages(obj[key], where, key)
                first = (where, messages) if first is None else first
                break
        if first is None:
            raise DataError(f"{', '.join(str(p) for p in files)}: no record in any file")
        try:
            ids, _ = encode_conversation(tokenizer, first[1], uses_generation_markers(template))
        except ChatEncodeError as e:
            raise DataError(f"{first[0]}: {e}") from None
        return [
            f"{describe_files(files)}; tokenizer {pre['model_name_or_path']} ({len(tokenizer):,} tokens, "
            f"chat template); first record: {len(ids):,} tokens (cutoff_len {basic['cutoff_len']})"
        ]

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        index %= n
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        return {
            "input_ids": self.input_ids[lo:hi].long(),
            "labels": self.labels[lo:hi].long(),
            "position_ids": torch.arange(hi - lo),
            "sample_id": index,
        }
