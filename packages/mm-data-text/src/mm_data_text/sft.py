"""``sft``: chat conversations (``messages`` jsonl) rendered with the tokenizer's chat template.

Prepared once, like ``text_pretrain``: the jsonl files are cut into work units (``mm_data_text.units``) that
local processes tokenise in parallel into token shards with a per-token mask (1 = labelled: the assistant
replies), kept in a cache folder (``mm_core.data.cache``); every later start, on every rank, only maps them.
A conversation longer than the budget of ``mm_data_text.chat`` is cut before it is tokenised.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
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
    check_weights,
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
from mm_core.errors import ConfigError, DataError

from .chat import (
    MARGIN,
    ChatEncodeError,
    encode_within,
    max_token_bytes,
    uses_generation_markers,
)
from .packing import IGNORE_INDEX
from .sources import dataset_entries, describe_files, iter_jsonl, resolve_paths
from .tokenizer import cached_tokenizer, load_tokenizer, pad_id
from .units import Unit, prepare_units, unit_records

logger = logging.getLogger(__name__)

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "cutoff_len": positive_int(2048),
    "messages_key": string("messages"),
    "weights": optional_weights(),
    **cache_fields(),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": string(),
}
ROLES = ("system", "user", "assistant")
#: bumped whenever what preparation writes for the same inputs changes (encoding, truncation, layout)
PREPARE_VERSION = 1
#: skipped records named in the manifest (the count covers all of them)
SKIPPED_NAMED = 10


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


def record_messages(obj: Mapping[str, Any], where: str, key: str) -> list[dict[str, str]]:
    """The checked conversation under ``key`` of one jsonl record."""
    if key not in obj:
        raise DataError(f'{where}: missing key "{key}" (keys present: {", ".join(obj) or "none"})')
    return check_messages(obj[key], where, key)


def _chat_template(tokenizer: Any, name: str) -> str:
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"{PREPROCESS}.model_name_or_path: the tokenizer at {name!r} "
            "has no (single) chat_template; add one to its tokenizer_config.json"
        )
    return template


def _prepare_unit(task: tuple[Unit, dict[str, Any], str, str]) -> dict[str, Any]:
    """Tokenise the conversations of one unit into one masked token shard (runs in a preparation process)."""
    unit, settings, out_dir, stem = task
    tokenizer = cached_tokenizer(settings["tokenizer"], settings["fingerprint"])
    writer = ShardWriter(Path(out_dir), stem, settings["dtype"], with_mask=True)
    skipped = 0
    named: list[str] = []  # the first SKIPPED_NAMED skipped records
    for lineno, obj in unit_records(unit):
        where = f"{unit.path}:{lineno}"
        messages = record_messages(obj, where, settings["messages_key"])
        try:
            ids, labels, _ = encode_within(
                tokenizer, messages, settings["with_markers"], settings["cutoff_len"], settings["token_bytes"]
            )
        except ChatEncodeError as e:
            raise DataError(f"{where}: {e}") from None
        mask = [int(label != IGNORE_INDEX) for label in labels]
        if not any(mask):
            skipped += 1
            if len(named) < SKIPPED_NAMED:
                named.append(where)
            continue
        writer.add(ids, mask)
    return {"shard": writer.close(), "skipped": skipped, "skipped_at": named}


def _cache_request(
    basic: Mapping[str, Any],
    pre: Mapping[str, Any],
    tokenizer: Any,
    template: str,
    fingerprint: str,
    entry_files: list[list[Path]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings the preparation processes need (``token_bytes`` is added when building), and the cache
    spec: what the samples depend on besides the sources' contents (``weights`` applies when reading)."""
    settings = {
        "tokenizer": pre["model_name_or_path"],
        "fingerprint": fingerprint,
        "cutoff_len": basic["cutoff_len"],
        "messages_key": basic["messages_key"],
        "with_markers": uses_generation_markers(template),
        "dtype": token_dtype(len(tokenizer)),
    }
    spec = {
        **{k: v for k, v in settings.items() if k not in ("tokenizer", "fingerprint")},
        "version": PREPARE_VERSION,
        "margin": MARGIN,
        "labels": "generation_markers" if settings["with_markers"] else "template_spans",
        "chat_template": hashlib.sha256(template.encode("utf-8")).hexdigest()[:20],
        "tokenizer": fingerprint,
        "entries": [[str(f.resolve()) for f in files] for files in entry_files],
    }
    return settings, spec


class SFTDataset(PreparedDataset, torch.utils.data.Dataset):
    """Supervised fine-tuning samples: labels only on assistant replies and their end-of-turn token.

    Each sample is truncated to ``cutoff_len`` tokens (the tail is cut). A sample left without any
    labelled token after truncation is skipped; ``num_skipped`` counts them, ``skipped`` names the first
    ones (``file:line``) and a warning reports them when the data is prepared. Each entry of
    ``basic_parameters.dataset`` is one source (its files in order); ``weights`` mixes the sources.
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
        self.cutoff_len: int = basic["cutoff_len"]
        entries = dataset_entries(basic["dataset"])
        self.source_weights = check_weights(basic["weights"], len(entries), f"{BASIC}.weights")
        self.entry_files = [resolve_paths(e, basic["dataset_dir"], (".jsonl",)) for e in entries]
        self.files = [f for files in self.entry_files for f in files]
        fingerprint = tokenizer_fingerprint(pre["model_name_or_path"])
        tokenizer = cached_tokenizer(
            pre["model_name_or_path"], fingerprint
        )  # reused by in-process preparation
        template = _chat_template(tokenizer, pre["model_name_or_path"])
        self.pad_token_id = pad_id(tokenizer)
        options = CacheOptions.read(basic, workers=workers, overwrite=overwrite)
        settings, spec = _cache_request(basic, pre, tokenizer, template, fingerprint, self.entry_files)

        def build(folder: Path) -> dict[str, Any]:
            token_bytes = max_token_bytes(tokenizer)
            by_source = prepare_units(
                "sft",
                _prepare_unit,
                self.entry_files,
                {**settings, "token_bytes": token_bytes},
                folder,
                options.workers,
            )
            done = [d for source in by_source for d in source]
            skipped_at = [where for d in done for where in d["skipped_at"]][:SKIPPED_NAMED]
            return {
                "dtype": settings["dtype"],
                "token_bytes": token_bytes,
                "sources": [[d["shard"] for d in source] for source in by_source],
                "skipped": sum(int(d["skipped"]) for d in done),
                "skipped_at": skipped_at,
            }

        self.prepared, self.built = options.open("sft", spec, self.files, build)
        payload = self.prepared.payload
        shards = [shard for source in payload["sources"] for shard in source]
        self.store = TokenStore(
            self.prepared.path, shards, payload["dtype"], with_mask=True, vocab_size=len(tokenizer)
        )
        self.source_sizes = [sum(int(sh["documents"]) for sh in source) for source in payload["sources"]]
        self.num_tokens = self.store.num_tokens
        self.num_skipped: int = payload["skipped"]
        self.skipped: list[str] = list(payload["skipped_at"])
        if self.num_skipped:
            logger.log(
                logging.WARNING if self.built else logging.INFO,  # warned once: when prepared
                "sft: skipped %d samples with no assistant token within cutoff_len=%d (first: %s)",
                self.num_skipped,
                self.cutoff_len,
                ", ".join(self.skipped[:5]),
            )
        if len(self) == 0:
            raise DataError(
                f"{', '.join(str(p) for p in self.files)}: no sample keeps an assistant token "
                f"within {BASIC}.cutoff_len = {self.cutoff_len}"
            )
        logger.info(
            "sft: %d files, %d samples (%d skipped), %d tokens; %s %s",
            len(self.files),
            len(self),
            self.num_skipped,
            self.num_tokens,
            "prepared into" if self.built else "mapped from",
            self.prepared.path,
        )

    def prepared_summary(self) -> list[str]:
        skipped = f", {self.num_skipped:,} skipped (first: {self.skipped[0]})" if self.num_skipped else ""
        return [
            f"{len(self.files)} file(s) -> {len(self):,} samples{skipped}, {self.num_tokens:,} tokens "
            f"({self.store.dtype}, cutoff_len {self.cutoff_len})"
        ]

    @classmethod
    def preflight(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
    ) -> list[str]:
        """What ``mm check`` verifies without encoding every conversation: the keys, that every file exists,
        the tokenizer and its chat template (local files only), and the first record of every file (checked;
        the first one encoded, cut as preparation cuts it). Raises ConfigError/DataError as building the
        dataset would."""
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        entries = dataset_entries(basic["dataset"])
        check_weights(basic["weights"], len(entries), f"{BASIC}.weights")
        entry_files = [resolve_paths(e, basic["dataset_dir"], (".jsonl",)) for e in entries]
        files = [f for group in entry_files for f in group]
        tokenizer = load_tokenizer(pre["model_name_or_path"])
        template = _chat_template(tokenizer, pre["model_name_or_path"])
        key, cutoff_len = basic["messages_key"], basic["cutoff_len"]
        first: tuple[str, list[dict[str, str]]] | None = None
        for path in files:
            for lineno, obj in iter_jsonl(path):
                where = f"{path}:{lineno}"
                messages = record_messages(obj, where, key)
                first = (where, messages) if first is None else first
                break
        if first is None:
            raise DataError(f"{', '.join(str(p) for p in files)}: no record in any file")
        fingerprint = tokenizer_fingerprint(pre["model_name_or_path"])
        _, spec = _cache_request(basic, pre, tokenizer, template, fingerprint, entry_files)
        token_bytes = max_token_bytes(tokenizer)
        try:
            ids, _, cut = encode_within(
                tokenizer, first[1], uses_generation_markers(template), cutoff_len, token_bytes
            )
        except ChatEncodeError as e:
            raise DataError(f"{first[0]}: {e}") from None
        tokens = f"more than {cutoff_len + MARGIN:,}" if cut else f"{len(ids):,}"
        return [
            f"{describe_files(files)}; tokenizer {pre['model_name_or_path']} ({len(tokenizer):,} tokens, "
            f"chat template); first record: {tokens} tokens (cutoff_len {cutoff_len})",
            "samples " + cache_status(CacheOptions.read(basic).root, "sft", spec, files),
        ]

    def __len__(self) -> int:
        return self.store.num_documents

    def sample_lengths(self) -> np.ndarray:
        """Tokens per sample, for token-budget batching."""
        return self.store.document_lengths()

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        index %= n
        ids, mask = self.store.document(index)
        assert mask is not None  # the store has a mask
        input_ids = torch.from_numpy(ids.astype(np.int64))
        labels = torch.where(torch.from_numpy(mask.astype(np.bool_)), input_ids, IGNORE_INDEX)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": torch.arange(len(input_ids)),
            "sample_id": index,
        }
