"""``text_pretrain``: documents from .txt/.jsonl/.parquet files, tokenised and packed into fixed blocks."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    boolean,
    choice,
    optional_string,
    paths,
    positive_int,
    read_params,
    string,
)
from mm_core.errors import DataError

from .packing import PackedStream, pack_documents
from .sources import TEXT_SUFFIXES, describe_files, first_document, read_documents, resolve_paths
from .tokenizer import eos_id, load_tokenizer, pad_id

logger = logging.getLogger(__name__)

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "seq_len": positive_int(),
    "text_key": string("text"),
    "txt_document": choice(("blank_line", "file"), "blank_line"),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": string(),
    "add_eos": boolean(True),
}
ENCODE_BATCH = 1024


def encode_documents(tokenizer: Any, docs: Sequence[str], eos: int | None) -> list[list[int]]:
    """Batch-encode documents with the tokenizer's own special tokens, then append ``eos`` if missing."""
    out: list[list[int]] = []
    for lo in range(0, len(docs), ENCODE_BATCH):
        batch = tokenizer(
            list(docs[lo : lo + ENCODE_BATCH]),
            add_special_tokens=True,
            verbose=False,
            return_attention_mask=False,
        )["input_ids"]
        for ids in batch:
            if eos is not None and (not ids or ids[-1] != eos):
                ids = [*ids, eos]
            out.append(ids)
    return out


class TextPretrainDataset(torch.utils.data.Dataset):
    """Packed causal-LM pretraining blocks of ``seq_len`` tokens (see ``mm_data_text.packing`` for the rules).

    Every document is tokenised once at construction and the packed stream is kept in memory as int32.
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
        self.seq_len: int = basic["seq_len"]
        self.files = resolve_paths(basic["dataset"], basic["dataset_dir"], TEXT_SUFFIXES)
        tokenizer = load_tokenizer(pre["model_name_or_path"])
        eos = eos_id(tokenizer) if pre["add_eos"] else None
        self.pad_token_id = pad_id(tokenizer)
        token_lists: list[list[int]] = []
        for path in self.files:
            docs = read_documents(path, basic["text_key"], basic["txt_document"])
            token_lists.extend(encode_documents(tokenizer, docs, eos))
        self.num_documents = len(token_lists)
        self.stream: PackedStream = pack_documents(token_lists, self.seq_len, None)
        self.dropped_tokens = self.stream.num_tokens - len(self.stream) * self.seq_len
        if len(self.stream) == 0:
            names = ", ".join(str(p) for p in self.files)
            raise DataError(
                f"{names}: {self.num_documents} documents give {self.stream.num_tokens} tokens, "
                f"fewer than one block ({BASIC}.seq_len = {self.seq_len}); "
                "add data or lower seq_len"
            )
        logger.info(
            "text_pretrain: %d files, %d documents, %d tokens -> %d blocks of %d (last %d tokens dropped)",
            len(self.files),
            self.num_documents,
            self.stream.num_tokens,
            len(self.stream),
            self.seq_len,
            self.dropped_tokens,
        )

    @classmethod
    def preflight(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
    ) -> list[str]:
        """What ``mm check`` verifies without tokenising the corpus: the keys, that every file exists, the
        tokenizer (local files only), and the first document of every file (read and, for the first file,
        tokenised). Raises ConfigError/DataError as building the dataset would."""
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        files = resolve_paths(basic["dataset"], basic["dataset_dir"], TEXT_SUFFIXES)
        tokenizer = load_tokenizer(pre["model_name_or_path"])
        eos = eos_id(tokenizer) if pre["add_eos"] else None
        first: str | None = None
        for path in files:
            doc = first_document(path, basic["text_key"], basic["txt_document"])
            first = doc if first is None else first
        if first is None:
            raise DataError(f"{', '.join(str(p) for p in files)}: no document in any file")
        tokens = len(encode_documents(tokenizer, [first], eos)[0])
        return [
            f"{describe_files(files)}; tokenizer {pre['model_name_or_path']} ({len(tokenizer):,} tokens); "
            f"first document: {tokens:,} tokens (seq_len {basic['seq_len']})"
        ]

    def __len__(self) -> int:
        return len(self.stream)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = self.stream.block(index)
        item["sample_id"] = int(index) % len(self)
        return item
