"""``text_pretrain``: documents from .txt/.jsonl/.parquet files, tokenised and packed into fixed blocks."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from mm_core.data.cache import (
    CacheOptions,
    cache_fields,
    cache_status,
    tokenizer_fingerprint,
)
from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    boolean,
    check_weights,
    choice,
    optional_string,
    optional_weights,
    paths,
    positive_int,
    read_params,
    string,
)
from mm_core.data.plan import DataPlan
from mm_core.data.prepare import PreparedDataset
from mm_core.data.tokenstore import ShardWriter, TokenStore, token_dtype
from mm_core.errors import DataError

from .packing import block_fields
from .sources import TEXT_SUFFIXES, dataset_entries, describe_files, first_document, resolve_paths
from .tokenizer import cached_tokenizer, eos_id, load_tokenizer, pad_id
from .units import Unit, prepare_units, unit_documents

logger = logging.getLogger(__name__)

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "seq_len": positive_int(),
    "text_key": string("text"),
    "txt_document": choice(("blank_line", "file"), "blank_line"),
    "weights": optional_weights(),
    **cache_fields(),
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


def _prepare_unit(task: tuple[Unit, dict[str, Any], str, str]) -> dict[str, Any]:
    """Tokenise one unit into one token shard (runs in a preparation process)."""
    unit, settings, out_dir, stem = task
    tokenizer = cached_tokenizer(settings["tokenizer"], settings["fingerprint"])
    eos = eos_id(tokenizer) if settings["add_eos"] else None
    docs = unit_documents(unit, settings["text_key"], settings["txt_document"])
    writer = ShardWriter(Path(out_dir), stem, settings["dtype"])
    for lo in range(0, len(docs), ENCODE_BATCH):
        for ids in encode_documents(tokenizer, docs[lo : lo + ENCODE_BATCH], eos):
            if ids:  # an empty document (no eos) adds nothing to the stream
                writer.add(ids)
    return writer.close()


def _cache_request(
    basic: Mapping[str, Any],
    pre: Mapping[str, Any],
    tokenizer: Any,
    fingerprint: str,
    entry_files: list[list[Path]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings the preparation processes need, and the cache spec (what the tokens depend on besides
    the sources' contents; ``seq_len`` and ``weights`` are applied when reading, so they are not in it)."""
    settings = {
        "tokenizer": pre["model_name_or_path"],
        "fingerprint": fingerprint,
        "add_eos": pre["add_eos"],
        "text_key": basic["text_key"],
        "txt_document": basic["txt_document"],
        "dtype": token_dtype(len(tokenizer)),
    }
    if settings["add_eos"]:
        eos_id(tokenizer)  # a tokenizer without eos is a config error before any work
    spec = {
        **{k: v for k, v in settings.items() if k not in ("tokenizer", "fingerprint")},
        "tokenizer": fingerprint,
        "entries": [[str(f.resolve()) for f in files] for files in entry_files],
    }
    return settings, spec


class TextPretrainDataset(PreparedDataset, torch.utils.data.Dataset):
    """Packed causal-LM pretraining blocks of ``seq_len`` tokens (see ``mm_data_text.packing`` for the rules).

    The corpus is tokenised once into memory-mapped token shards (``mm_core.data.tokenstore``) in a cache
    folder (``mm_core.data.cache``), in parallel across local processes; every later start, on every rank,
    only maps them. Each entry of ``basic_parameters.dataset`` is one source with its own token stream (its
    files in order), cut into blocks that never cross sources; ``weights`` mixes the sources.
    """

    #: the parameter keys mm reads (run outputs kept out of the sources, tokenizer files in an export)
    mm_data_plan: ClassVar[DataPlan] = DataPlan(
        source_keys=("dataset",), root_key="dataset_dir", processor_key="model_name_or_path"
    )

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
        workers: int | None = None,
        overwrite: bool = False,
    ) -> None:
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.seed = seed
        self.seq_len: int = basic["seq_len"]
        entries = dataset_entries(basic["dataset"])
        self.source_weights = check_weights(basic["weights"], len(entries), f"{BASIC}.weights")
        self.entry_files = [resolve_paths(e, basic["dataset_dir"], TEXT_SUFFIXES) for e in entries]
        self.files = [f for files in self.entry_files for f in files]
        fingerprint = tokenizer_fingerprint(pre["model_name_or_path"])
        tokenizer = cached_tokenizer(
            pre["model_name_or_path"], fingerprint
        )  # reused by in-process preparation
        self.pad_token_id = pad_id(tokenizer)
        options = CacheOptions.read(basic, workers=workers, overwrite=overwrite)
        settings, spec = _cache_request(basic, pre, tokenizer, fingerprint, self.entry_files)

        def build(folder: Path) -> dict[str, Any]:
            shards = prepare_units(
                "text_pretrain",
                _prepare_unit,
                self.entry_files,
                settings,
                folder,
                options.workers,
                basic["txt_document"],
            )
            return {"dtype": settings["dtype"], "sources": shards}

        self.prepared, self.built = options.open("text_pretrain", spec, self.files, build)
        payload = self.prepared.payload
        shards = [shard for source in payload["sources"] for shard in source]
        self.store = TokenStore(
            self.prepared.path, shards, payload["dtype"], with_mask=False, vocab_size=len(tokenizer)
        )
        # first token of every source in the store, blocks per source, first block of every source
        source_tokens = [sum(int(sh["tokens"]) for sh in source) for source in payload["sources"]]
        self.source_token_base = np.concatenate([[0], np.cumsum(source_tokens)]).astype(np.int64)
        self.source_sizes = [n // self.seq_len for n in source_tokens]
        self.block_base = np.concatenate([[0], np.cumsum(self.source_sizes)]).astype(np.int64)
        self.num_documents = self.store.num_documents
        self.num_tokens = self.store.num_tokens
        self.dropped_tokens = self.num_tokens - int(self.block_base[-1]) * self.seq_len
        for entry, files, n, blocks in zip(entries, self.entry_files, source_tokens, self.source_sizes):
            if blocks == 0:
                raise DataError(
                    f"{BASIC}.dataset entry {entry!r} ({', '.join(str(p) for p in files)}): {n} tokens, "
                    f"fewer than one block ({BASIC}.seq_len = {self.seq_len}); add data or lower seq_len"
                )
        logger.info(
            "text_pretrain: %d files, %d documents, %d tokens -> %d blocks of %d (%d tokens dropped); %s %s",
            len(self.files),
            self.num_documents,
            self.num_tokens,
            len(self),
            self.seq_len,
            self.dropped_tokens,
            "prepared into" if self.built else "mapped from",
            self.prepared.path,
        )

    def prepared_summary(self) -> list[str]:
        return [
            f"{len(self.files)} file(s), {self.num_documents:,} documents, {self.num_tokens:,} tokens "
            f"({self.store.dtype}) -> {len(self):,} blocks of {self.seq_len}"
        ]

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
        entry_files = [
            resolve_paths(e, basic["dataset_dir"], TEXT_SUFFIXES) for e in dataset_entries(basic["dataset"])
        ]
        check_weights(basic["weights"], len(entry_files), f"{BASIC}.weights")
        _, spec = _cache_request(
            basic, pre, tokenizer, tokenizer_fingerprint(pre["model_name_or_path"]), entry_files
        )
        root = CacheOptions.read(basic).root
        return [
            f"{describe_files(files)}; tokenizer {pre['model_name_or_path']} ({len(tokenizer):,} tokens); "
            f"first document: {tokens:,} tokens (seq_len {basic['seq_len']})",
            "tokens " + cache_status(root, "text_pretrain", spec, files),
        ]

    def __len__(self) -> int:
        return int(self.block_base[-1])

    def sample_lengths(self) -> np.ndarray:
        """Tokens per sample (every block has ``seq_len``), for token-budget batching."""
        return np.full(len(self), self.seq_len, dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block {index} out of range for {n} blocks")
        index %= n
        source = int(np.searchsorted(self.block_base, index, side="right")) - 1
        lo = int(self.source_token_base[source]) + (index - int(self.block_base[source])) * self.seq_len
        hi = lo + self.seq_len
        ids = torch.from_numpy(self.store.tokens(lo, hi).astype(np.int64))
        starts = torch.zeros(self.seq_len, dtype=torch.bool)
        starts[torch.from_numpy(self.store.document_starts(lo, hi) - lo)] = True
        item: dict[str, Any] = block_fields(ids, starts)
        item["sample_id"] = index
        return item
