"""``tts_codes`` dataset and collator: text-to-speech training on precomputed codec codes (Qwen3-TTS).

**Records** (JSONL lines, or a JSON list): ``{"text": "...", "codes": "codes/0001.npy"}`` plus optional
``"language"`` (a name of ``talker_config.codec_language_id``, e.g. ``"english"``; absent or ``"auto"``: no
language slot) and ``"speaker"`` (a name of ``talker_config.spk_id``, or the path of a ``.npy`` float x-vector
[talker hidden size], e.g. from the official speaker encoder of a Base checkpoint). ``codes`` is an integer
``.npy`` [frames, num_code_groups] of the 12 Hz speech tokenizer, every value in [0, codebook size). Paths
are relative to the folder of the dataset file that names them.

**Preprocess parameters.** ``model_name_or_path``: the local model folder, whose tokenizer encodes the text
and whose ``config.json`` gives every special id (the official Qwen3-TTS folder holds both);
``model_config``: another folder (or ``config.json``) to read the ids from instead.

The text is encoded as the official prompt ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>
assistant\\n``; its role prefix and text tokens build the tracks of :mod:`mm_data_audio.tts_layout`.
A record that cannot be used is a ``DataError`` naming ``file:line`` (and the file it points to): bad
structure, an unknown language or speaker, a missing file at build time; codes of the wrong shape, type or
range, a bad x-vector, a text that does not encode, or more than ``cutoff_len`` positions when fetched. With
``data.dataset_param.on_error: skip`` it is replaced by the next good record and counted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from mm_core.data.collate import Padding, meta_fields, pad_tokens
from mm_core.data.params import (
    BASIC,
    COLLATE,
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
from mm_core.data.records import RecordError, iter_records, resolve_files
from mm_core.data.skipping import fetch_skipping, next_usable
from mm_core.errors import ConfigError, DataError
from mm_core.train.loss import IGNORE_INDEX

from .tts_layout import TTSSpecials, build_tracks, sequence_length

logger = logging.getLogger(__name__)

__all__ = ["TTSCodesCollator", "TTSCodesDataset", "TTSRecord", "read_record"]

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "cutoff_len": positive_int(4096),
    "weights": optional_weights(),
}
PREPROCESS_FIELDS = {"model_name_or_path": string(), "model_config": optional_string(None)}
PREFIX = "<|im_start|>assistant\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
#: per-position fields of a sample and their padding in a batch
TRACK_PADS = {"codec_ids": 0, "codec_mask": 0, "frame_mask": 0}


@dataclass(frozen=True, slots=True)
class TTSRecord:
    """One utterance: its text, codes file, language (a name of ``codec_language_id`` or None) and speaker
    (a name of ``spk_id``, an x-vector file, or None)."""

    text: str
    codes: Path
    language: str | None
    speaker: str | Path | None


def read_record(obj: Mapping[str, Any], base: Path, specials: TTSSpecials) -> TTSRecord:
    """A record's fields, checked (RecordError saying what is wrong)."""
    text, codes = obj.get("text"), obj.get("codes")
    if not isinstance(text, str) or not text.strip():
        raise RecordError(f'"text" must be a non-empty string (keys: {", ".join(obj) or "none"})')
    if not isinstance(codes, str) or not codes:
        raise RecordError('"codes" must be the path of a .npy of codec codes [frames, codebooks]')
    codes_path = base / codes
    if not codes_path.is_file():
        raise RecordError(f"no such codes file {codes_path} (paths are relative to the dataset file)")
    language = obj.get("language")
    if language is not None:
        if not isinstance(language, str):
            raise RecordError('"language" must be a string when given')
        language = language.lower()
        if language == "auto":
            language = None
        elif language not in specials.languages:
            known = ", ".join(sorted(specials.languages)) or "none"
            raise RecordError(f'"language" {language!r} is not in codec_language_id (known: auto, {known})')
    speaker: str | Path | None = obj.get("speaker")
    if speaker is not None:
        if not isinstance(speaker, str) or not speaker:
            raise RecordError('"speaker" must be a speaker name or the path of a .npy x-vector')
        if speaker.endswith(".npy"):
            speaker = base / speaker
            if not speaker.is_file():
                raise RecordError(f"no such speaker x-vector file {speaker}")
        elif speaker.lower() in specials.speakers:
            speaker = speaker.lower()
        else:
            known = ", ".join(sorted(specials.speakers)) or "none in this checkpoint"
            raise RecordError(f'"speaker" {speaker!r} is not in spk_id ({known}) and is not a .npy x-vector')
    return TTSRecord(text, codes_path, language, speaker)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        # the folder's config.json is Qwen3-TTS's, which transformers does not know: the tokenizer's class
        # comes from tokenizer_config.json (an empty config stops AutoTokenizer from reading config.json)
        return AutoTokenizer.from_pretrained(path, config=PretrainedConfig(), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing or broken
        raise ConfigError(
            f"{PREPROCESS}.model_name_or_path: cannot load the tokenizer from {path!r}: "
            + " ".join(str(e).split())
        ) from None


def _read_config(path: Path) -> dict[str, Any]:
    where = f"{PREPROCESS}.model_config"
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{where}: no {path} (the Qwen3-TTS model's config.json holds the special ids)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{where}: {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {path}: expected a JSON object")
    return data


class TTSCodesDataset(torch.utils.data.Dataset):
    """Qwen3-TTS samples from text + codec-code records (module docstring)."""

    #: the parameter keys mm reads (run outputs kept out of the sources, tokenizer files in an export)
    mm_data_plan: ClassVar[DataPlan] = DataPlan(
        source_keys=("dataset",), root_key="dataset_dir", processor_key="model_name_or_path"
    )

    NAME: ClassVar[str] = "tts_codes"

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
    ) -> None:
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        params = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.seed = seed
        self.cutoff_len: int = basic["cutoff_len"]
        self.on_error: str = getattr(dataset_param, "on_error", "raise")
        folder = params["model_name_or_path"]
        config_path = Path(params["model_config"] or folder)
        self.specials = TTSSpecials.read(_read_config(config_path), str(config_path))
        self.tokenizer = _load_tokenizer(folder)
        self.pad_token_id = self.specials.tts_pad
        self.prefix = self._encode(PREFIX)
        self.suffix = self._encode(SUFFIX)
        if (
            not self.prefix
            or self.prefix[0] != self.specials.im_start
            or self.suffix[0] != self.specials.im_end
        ):
            raise ConfigError(
                f"{PREPROCESS}.model_name_or_path: the tokenizer at {folder!r} encodes <|im_start|> / "
                f"<|im_end|> as {self.prefix[:1]} / {self.suffix[:1]}, but config.json says "
                f"im_start_token_id {self.specials.im_start}, im_end_token_id {self.specials.im_end}"
            )
        self.files = resolve_files(basic["dataset"], basic["dataset_dir"], f"{BASIC}.dataset")
        self.source_weights = check_weights(basic["weights"], len(self.files), f"{BASIC}.weights")
        self.records: list[TTSRecord | None] = []
        self.wheres: list[str] = []
        self.problems: dict[int, str] = {}
        self.source_sizes: list[int] = []
        for path in self.files:
            before = len(self.records)
            for where, obj in iter_records(path):
                record: TTSRecord | None = None
                try:
                    if isinstance(obj, RecordError):
                        raise obj
                    record = read_record(obj, path.parent, self.specials)
                except RecordError as e:
                    if self.on_error != "skip":
                        raise DataError(f"{where}: {e}") from None
                    self.problems[len(self.records)] = f"{where}: {e}"
                self.records.append(record)
                self.wheres.append(where)
            self.source_sizes.append(len(self.records) - before)
        if not self.records:
            raise DataError(f"{self.NAME}: no record in {', '.join(str(p) for p in self.files)}")
        self.skipped = 0
        self.first_skip: str | None = None
        self._lengths: np.ndarray | None = None

    # ---- encoding -------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def text_ids(self, text: str) -> list[int]:
        """The text tokens of the official prompt (between its role prefix and its suffix); RecordError when
        the text merges with them or holds a special token."""
        ids = self._encode(PREFIX + text + SUFFIX)
        p, s = len(self.prefix), len(self.suffix)
        if ids[:p] != self.prefix or ids[len(ids) - s :] != self.suffix or len(ids) <= p + s:
            raise RecordError("the text does not encode apart from the prompt around it")
        body = ids[p : len(ids) - s]
        if self.specials.text_specials.intersection(body):
            raise RecordError("the text holds a special token (<|im_start|>, <|im_end|>, <|tts_...|>)")
        if max(body) >= self.specials.text_vocab_size:
            raise RecordError(
                f"a text token id exceeds talker_config.text_vocab_size {self.specials.text_vocab_size}"
            )
        return body

    def _codes(self, path: Path, *, header_only: bool = False) -> np.ndarray:
        """The codes of ``path`` checked (dtype, shape; with ``header_only`` the file is memory-mapped and
        its values are left unread, else they must be in range)."""
        try:
            codes = np.load(path, mmap_mode="r" if header_only else None, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise RecordError(f"cannot read {path}: {e}") from None
        groups = self.specials.num_code_groups
        if not np.issubdtype(codes.dtype, np.integer) or codes.ndim != 2 or codes.shape[1] != groups:
            raise RecordError(
                f"{path}: codes of {codes.dtype} {tuple(codes.shape)}; expected integers [frames, {groups}]"
            )
        if codes.shape[0] == 0:
            raise RecordError(f"{path}: no frames")
        if header_only:
            return codes
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high >= self.specials.codebook_size:
            raise RecordError(
                f"{path}: codes in [{low}, {high}]; every code must be in [0, {self.specials.codebook_size})"
            )
        return codes

    def _speaker(self, speaker: str | Path | None, *, header_only: bool = False) -> int | np.ndarray | None:
        if speaker is None or isinstance(speaker, str):
            return None if speaker is None else self.specials.speakers[speaker]
        try:
            vector = np.load(speaker, mmap_mode="r" if header_only else None, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise RecordError(f"cannot read {speaker}: {e}") from None
        size = self.specials.hidden_size
        if vector.shape != (size,) or not np.issubdtype(vector.dtype, np.floating):
            raise RecordError(
                f"{speaker}: x-vector of {vector.dtype} {tuple(vector.shape)}; expected floats [{size}] "
                "(the talker's hidden size)"
            )
        if not header_only and not np.isfinite(vector).all():
            raise RecordError(f"{speaker}: the x-vector holds NaN or inf")
        return vector

    def encode(self, index: int) -> dict[str, Any]:
        """The sample of record ``index``; DataError naming the record when it cannot be built."""
        if index in self.problems:
            raise DataError(self.problems[index])
        record, where = self.records[index], self.wheres[index]
        assert record is not None  # only a refused record has none
        try:
            text = self.text_ids(record.text)
            codes = self._codes(record.codes)
            speaker = self._speaker(record.speaker)
        except RecordError as e:
            raise DataError(f"{where}: {e}") from None
        language = None if record.language is None else self.specials.languages[record.language]
        sample: dict[str, Any] = {**build_tracks(self.prefix, text, codes, self.specials, language, speaker)}
        if len(sample["input_ids"]) > self.cutoff_len:
            raise DataError(
                f"{where}: {len(sample['input_ids'])} positions ({len(text)} text tokens, {len(codes)} "
                f"frames) exceed {BASIC}.cutoff_len = {self.cutoff_len}"
            )
        sample["sample_id"] = index
        return sample

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return fetch_skipping(self.NAME, index, len(self), self.encode, self.on_error, self._skipped, logger)

    def _skipped(self, error: DataError) -> str:
        self.skipped += 1
        self.first_skip = self.first_skip or str(error)
        return self.first_skip

    # ---- lengths --------------------------------------------------------------------------------------
    def lengths(self) -> np.ndarray:
        """Positions of each record from its text and the headers of its files (-1: cannot be used; code
        values out of range are found when the sample is fetched)."""
        if self._lengths is None:
            out = np.full(len(self.records), -1, dtype=np.int64)
            for i, record in enumerate(self.records):
                if record is None:
                    continue
                try:
                    frames = len(self._codes(record.codes, header_only=True))
                    self._speaker(record.speaker, header_only=True)
                    text = len(self.text_ids(record.text))
                except RecordError:
                    continue  # refused when fetched, with why
                n = sequence_length(
                    len(self.prefix), text, frames, record.language is not None, record.speaker is not None
                )
                out[i] = n if n <= self.cutoff_len else -1
            self._lengths = out
        return self._lengths

    def sample_lengths(self) -> np.ndarray:
        """Positions of each sample as the collator sees them; a record that cannot be used counts as the one
        that replaces it under ``on_error: skip``."""
        lengths = self.lengths()
        usable = lengths > 0
        if not usable.any():
            raise DataError(f"{self.NAME}: no usable record in {', '.join(str(p) for p in self.files)}")
        return lengths[next_usable(usable)]


class TTSCodesCollator:
    """Right-pads the tracks of ``tts_codes`` samples to the longest (rounded up to ``pad_to_multiple_of``):
    ``input_ids`` (``tts_pad``), ``labels`` (-100), ``codec_ids`` / ``codec_mask`` / ``frame_mask`` (0) and
    ``codes`` [B, S, G] (0), with ``attention_mask``; when any sample has an x-vector, ``speaker_vectors``
    [B, H] (zeros for the others) and ``speaker_slot`` [B, S]. ``sample_id`` [B] and ``skipped_samples``."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        if not isinstance(dataset, TTSCodesDataset):
            raise ConfigError(
                f"{COLLATE}.collator_id: the tts_codes collator batches samples of the tts_codes dataset; "
                f"got {type(dataset).__name__}"
            )
        self.padding = Padding.read(collate_param, dataset)
        self.hidden_size = dataset.specials.hidden_size

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        pads = {"input_ids": self.padding.pad_token_id, "labels": IGNORE_INDEX, **TRACK_PADS}
        batch: dict[str, Any] = pad_tokens(features, pads, self.padding)
        width = batch["input_ids"].shape[1]
        groups = features[0]["codes"].shape[1]
        codes = torch.zeros(len(features), width, groups, dtype=torch.long)
        for row, f in enumerate(features):
            codes[row, : f["codes"].shape[0]] = f["codes"]
        batch["codes"] = codes
        if any("speaker_vector" in f for f in features):
            vectors = torch.zeros(len(features), self.hidden_size)
            slots = torch.zeros(len(features), width, dtype=torch.long)
            for row, f in enumerate(features):
                if "speaker_vector" in f:
                    vectors[row] = f["speaker_vector"]
                    slots[row, : f["speaker_slot"].shape[0]] = f["speaker_slot"]
            batch["speaker_vectors"] = vectors
            batch["speaker_slot"] = slots
        batch.update(meta_fields(features))
        return batch
