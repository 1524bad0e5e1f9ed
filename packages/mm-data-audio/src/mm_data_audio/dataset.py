"""The dataset both ``audio_sft`` and ``asr_manifest`` are: records turned into (turns, audios, images,
videos), encoded when a sample is fetched.

No prepared cache: construction reads the dataset files once (JSON parsing and a ``stat`` of every audio,
image and video path: about a second for 10k records) and keeps the parsed records in memory. Token counts,
needed only for ``sample_lengths()`` (token-budget batching) and ``prepared_summary()``, are computed on first
use from the media headers (``soundfile.info``, ``PIL.Image.open``, the video container's: nothing decoded,
:mod:`.media`) through the same encoder a sample goes through, so they are exactly the sample's lengths. A
sample's media are decoded when it is fetched (in DataLoader workers); the refusals its headers decide (too
long, wrong rate, over ``cutoff_len``) come before any decoding.

A record that cannot be used is a ``DataError`` naming it (``file:line`` or ``file[index]``) and, for bad
audio, the audio path; with ``data.dataset_param.on_error: skip`` it is replaced by the next good record and
counted in the sample's ``skipped_samples`` (the trainer logs the running total):

- invalid structure (not JSON, no conversation, ``<audio>`` count differing from ``audios``, images without
  an image processor, videos without Qwen3-Omni's) or a missing audio/image/video file: raised when the
  dataset is built, else skipped;
- an unreadable, empty or too long audio, the wrong rate with ``resample: false``, a video refused from its
  header (or without a sound track under ``use_audio_in_video``), a conversation that does not encode, or
  more than ``cutoff_len`` tokens: raised or skipped when the sample is fetched.
"""

from __future__ import annotations

import contextlib
import logging
import math
from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    Field,
    boolean,
    check_weights,
    optional_positive_int,
    optional_string,
    optional_weights,
    paths,
    positive_int,
    read_params,
    string,
)
from mm_core.data.plan import DataPlan
from mm_core.data.skipping import fetch_skipping, next_usable
from mm_core.errors import DataError

from .encode import AudioProcessor
from .errors import AudioError, EncodeError
from .formats import AudioFormat
from .media import USE_AUDIO_FIELD, Headers, MediaReader, describe_videos
from .omni_videos import OmniVideoOptions
from .records import Record, RecordError, iter_records, resolve_files

logger = logging.getLogger(__name__)


def _seconds(v: Any) -> bool:
    return v is None or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    )


BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "cutoff_len": positive_int(2048),
    "weights": optional_weights(),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": string(),
    # the rate clips are resampled to and the feature extractor runs at; null: preprocessor_config.json's
    "sampling_rate": optional_positive_int(None),
    "resample": boolean(True),
    # a longer clip (from its header) is refused before decoding; null: no limit of mm's own
    "max_audio_seconds": Field("a positive number of seconds or null", _seconds, 30.0),
    "image_max_pixels": optional_positive_int(None),
    "image_min_pixels": optional_positive_int(None),
}


class AudioDataset(torch.utils.data.Dataset):
    """Audio (+ image) SFT samples: ``input_ids``, ``labels``, the format's audio inputs, image inputs when
    the sample has images, ``sample_id`` and ``skipped_samples``. Subclasses say how a record reads
    (:meth:`read_record`) and may add preprocess parameters (:attr:`EXTRA_FIELDS`)."""

    #: the parameter keys mm reads (run outputs kept out of the sources, tokenizer files in an export)
    mm_data_plan: ClassVar[DataPlan] = DataPlan(
        source_keys=("dataset",), root_key="dataset_dir", processor_key="model_name_or_path"
    )

    #: the ``dataset_type`` name messages use
    NAME: ClassVar[str] = ""
    #: preprocess parameters of the subclass, besides :data:`PREPROCESS_FIELDS`
    EXTRA_FIELDS: ClassVar[dict[str, Field]] = {}

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
    ) -> None:
        basic = self._configure(basic_param, preprocess_param, dataset_param, seed)
        self.source_weights = check_weights(basic["weights"], len(self.files), f"{BASIC}.weights")
        self.records: list[Record | None] = []
        self.wheres: list[str] = []
        self.problems: dict[int, str] = {}
        self.source_sizes: list[int] = []
        for path in self.files:
            before = len(self.records)
            for where, obj in iter_records(path):
                record, problem = self._check(where, obj)
                if problem is not None:
                    if self.on_error != "skip":
                        raise DataError(problem)
                    self.problems[len(self.records)] = problem
                self.records.append(record)
                self.wheres.append(where)
            self.source_sizes.append(len(self.records) - before)
        if not self.records:
            raise DataError(f"{self.NAME}: no record in {', '.join(str(p) for p in self.files)}")
        self._tokens: np.ndarray | None = None
        logger.info(
            "%s: %d records in %d file(s)%s",
            self.NAME,
            len(self.records),
            len(self.files),
            f", {len(self.problems)} refused (on_error: skip)" if self.problems else "",
        )

    def _configure(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any,
        seed: int,
    ) -> dict[str, Any]:
        """Everything but the records: parameters, dataset files and the processor (local files only)."""
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        self.params = read_params(preprocess_param, {**PREPROCESS_FIELDS, **self.EXTRA_FIELDS}, PREPROCESS)
        pre = self.params
        self.seed = seed
        self.cutoff_len: int = basic["cutoff_len"]
        self.dataset_dir: str | None = basic["dataset_dir"]
        self.on_error: str = getattr(dataset_param, "on_error", "raise")
        self.resample: bool = pre["resample"]
        self.max_seconds: float | None = pre["max_audio_seconds"]
        self.processor = AudioProcessor.load(
            pre["model_name_or_path"],
            PREPROCESS,
            sampling_rate=pre["sampling_rate"],
            min_pixels=pre["image_min_pixels"],
            max_pixels=pre["image_max_pixels"],
            video=OmniVideoOptions.from_params(pre),
        )
        self.media = MediaReader.from_params(self.processor, pre)
        tok = self.processor.tokenizer
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
        self.audio_token_id = self.processor.audio_token_id
        self.image_token_id = self.processor.image_token_id
        self.files = resolve_files(basic["dataset"], basic["dataset_dir"], f"{BASIC}.dataset")
        self.skipped = 0
        self.first_skip: str | None = None
        return basic

    @property
    def format(self) -> AudioFormat:
        """The family's audio format (the collator batches audio inputs through it)."""
        return self.processor.format

    @abstractmethod
    def read_record(self, record: dict[str, Any]) -> Record:
        """The record's turns, audios and images; RecordError saying what is wrong with its structure."""

    def _check(self, where: str, obj: dict[str, Any] | RecordError) -> tuple[Record | None, str | None]:
        """The record and, when it cannot be used, why (naming ``where``): bad structure, images without an
        image processor, a missing audio or image file."""
        try:
            if isinstance(obj, RecordError):
                raise obj
            record = self.read_record(obj)
        except RecordError as e:
            return None, f"{where}: {e}"
        if record.images and self.processor.images is None:
            return record, (
                f"{where}: the record has images but the processor at "
                f"{self.params['model_name_or_path']!r} has no image processor (its preprocessor_config.json "
                "has no image_processor_type)"
            )
        if record.videos and self.processor.videos is None:
            return record, (
                f"{where}: the record has videos but the processor at {self.params['model_name_or_path']!r} "
                "reads none (videos are read for Qwen3-Omni, whose folder also has an image processor)"
            )
        for kind, files in (("audio", record.audios), ("image", record.images), ("video", record.videos)):
            for path in files:
                if not path.is_file():
                    return (
                        record,
                        f"{where}: no such {kind} file {path} (relative paths start at dataset_dir)",
                    )
        return record, None

    # ---- encoding -------------------------------------------------------------------------------------
    def _header_tokens(self, record: Record) -> tuple[list[int], list[int], Headers]:
        """Ids and labels from the media headers (nothing decoded), and the headers; AudioError / OSError /
        EncodeError when a header or the conversation is refused."""
        media = self.media.headers(record)
        ids, labels = self.processor.encode(
            record.messages, media.samples, media.sizes, self.media.video_texts(media)
        )
        return ids, labels, media

    def _too_long(self, where: str, tokens: int) -> str:
        return (
            f"{where}: {tokens} tokens (with audio and image tokens) exceed {BASIC}.cutoff_len = "
            f"{self.cutoff_len}; raise cutoff_len or lower {PREPROCESS}.max_audio_seconds"
        )

    def _sample(self, where: str, record: Record) -> dict[str, Any]:
        """The encoded sample; DataError naming ``where`` (and the file) when it cannot be built."""
        fmt = self.processor.format
        try:
            ids, labels, media = self._header_tokens(record)
            if len(ids) > self.cutoff_len:
                raise DataError(self._too_long(where, len(ids)))
            waves, pixels = self.media.load(record, media)
            audio = fmt.features(waves) if waves else {}
        except (AudioError, OSError, EncodeError) as e:
            raise DataError(f"{where}: {e}") from None
        # defects of a family's format, never of the data
        rows = fmt.feature_rows(audio) if waves else 0
        found = self.processor.audio_token_count(ids)
        if found != rows:
            raise DataError(
                f"{where}: {found} audio tokens but the audio tower gets {rows} rows for clips of "
                f"{[len(w) for w in waves]} samples (the {fmt.name} format of mm-data-audio)"
            )
        if self.processor.images is not None:
            rows = self.processor.images.feature_rows(pixels)
            found = self.processor.image_token_count(ids)
            if found != rows:
                raise DataError(
                    f"{where}: {found} image tokens but the vision tower gets {rows} rows for images of "
                    f"sizes {media.sizes} (the Qwen-VL images of mm-data-audio)"
                )
        found, rows = self.processor.video_token_count(ids), self.media.video_rows(pixels)
        if found != rows:
            raise DataError(f"{where}: {found} video tokens but the vision tower gets {rows} rows")
        sample: dict[str, Any] = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }
        sample.update(audio)
        sample.update(pixels)
        if any(track is not None for track in media.tracks):
            sample[USE_AUDIO_FIELD] = True
        return sample

    def encode(self, index: int) -> dict[str, Any]:
        """The sample of record ``index``; DataError naming the record when it cannot be built."""
        if index in self.problems:
            raise DataError(self.problems[index])
        record = self.records[index]
        assert record is not None  # only a refused record has none
        sample = self._sample(self.wheres[index], record)
        sample["sample_id"] = index
        return sample

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return fetch_skipping(self.NAME, index, len(self), self.encode, self.on_error, self._skipped, logger)

    def _skipped(self, error: DataError) -> str:
        """Count a skipped record (``on_error: skip``); the first skip's message."""
        self.skipped += 1
        self.first_skip = self.first_skip or str(error)
        return self.first_skip

    # ---- lengths --------------------------------------------------------------------------------------
    def tokens(self) -> np.ndarray:
        """Tokens of each record from the media headers (-1: the record cannot be used), computed once."""
        if self._tokens is None:
            counts = np.full(len(self.records), -1, dtype=np.int64)
            for i, record in enumerate(self.records):
                if record is None or i in self.problems:
                    continue
                with contextlib.suppress(AudioError, OSError, EncodeError):  # refused when fetched, with why
                    counts[i] = len(self._header_tokens(record)[0])
            self._tokens = counts
        return self._tokens

    def _usable(self) -> np.ndarray:
        tokens = self.tokens()
        return (tokens > 0) & (tokens <= self.cutoff_len)

    def sample_lengths(self) -> np.ndarray:
        """Tokens of each sample as the collator sees it (text, audio and image tokens), from the headers: no
        audio is decoded. A record that cannot be used counts as the one that replaces it under
        ``on_error: skip`` (the next usable one)."""
        usable = self._usable()
        if not usable.any():
            raise DataError(
                f"{self.NAME}: no usable record in {', '.join(str(p) for p in self.files)}; first: "
                + self._problem(0)
            )
        return self.tokens()[next_usable(usable)]

    def _problem(self, index: int) -> str:
        """Why record ``index`` cannot be used, naming it."""
        if index in self.problems:
            return self.problems[index]
        record = self.records[index]
        assert record is not None  # only a refused record has none
        try:
            self._sample(self.wheres[index], record)
        except DataError as e:
            return str(e)
        return f"{self.wheres[index]}: usable"

    def prepared_summary(self) -> list[str]:
        """What the dataset holds (there is no prepared cache: records are read at construction)."""
        lengths = self.tokens()[self._usable()]
        tokens = (
            f"{int(lengths.sum()):,} tokens, longest {int(lengths.max()):,}" if len(lengths) else "no tokens"
        )
        return [
            f"{len(self.files)} file(s), {len(self):,} records ({len(self.problems):,} refused when read); "
            f"{len(lengths):,} usable within cutoff_len {self.cutoff_len}: {tokens}"
        ]

    # ---- mm check -------------------------------------------------------------------------------------
    @classmethod
    def preflight(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
    ) -> list[str]:
        """What ``mm check`` verifies without reading every record: the keys, that every file exists, the
        processor (local files only), the first record of every file (its audio and images exist), and the
        first sample encoded (its audio decoded). Raises ConfigError/DataError as building the dataset and
        reading that sample would (with ``on_error: skip`` a bad first sample is reported)."""
        self = cls.__new__(cls)
        self._configure(basic_param, preprocess_param, dataset_param, 0)
        first: tuple[str, Record] | None = None
        for path in self.files:
            for where, obj in iter_records(path):
                record, problem = self._check(where, obj)
                if problem is not None and self.on_error != "skip":
                    raise DataError(problem)
                if record is not None and problem is None:
                    first = first or (where, record)
                break
        if first is None:
            raise DataError(f"{', '.join(str(p) for p in self.files)}: no usable first record in any file")
        try:
            sample = self._sample(*first)
            record = first[1]
            line = (
                f"first record: {len(sample['input_ids']):,} tokens, "
                f"{self.processor.audio_token_count(sample['input_ids'].tolist()):,} audio tokens for "
                f"{len(record.audios)} clip(s), {len(record.images)} image(s) (cutoff_len {self.cutoff_len})"
            )
        except DataError as e:
            if self.on_error != "skip":
                raise
            line = f"first record would be skipped (on_error: skip): {e}"
        size = sum(p.stat().st_size for p in self.files)
        more = ", ..." if len(self.files) > 1 else ""
        limit = f"{self.max_seconds:g} s" if self.max_seconds else "no limit"
        images = ", Qwen-VL images" if self.processor.images is not None else ""
        images += describe_videos(self.media)
        return [
            f"{len(self.files)} file(s), {size / 2**20:.1f} MiB ({self.files[0]}{more}); processor "
            f"{Path(self.params['model_name_or_path'])}: {self.format.describe()}{images}; clips over "
            f"{limit} refused, resample {'on' if self.resample else 'off'}",
            line,
        ]
