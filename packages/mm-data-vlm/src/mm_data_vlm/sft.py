"""``vlm_sft``: conversations with images (LLaMA-Factory / ShareGPT style JSON or JSONL), Qwen-VL style."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    optional_positive_int,
    optional_string,
    paths,
    positive_int,
    read_params,
    string,
)
from mm_core.errors import DataError

from .encode import EncodeError, VisionProcessor
from .images import DEFAULT_MAX_SOURCE_PIXELS, load_image
from .records import conversation, image_paths, iter_records, resolve_files

logger = logging.getLogger(__name__)

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "cutoff_len": positive_int(2048),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": string(),
    "image_max_pixels": optional_positive_int(None),
    "image_min_pixels": optional_positive_int(None),
    # an image with more pixels (read from its header) is refused before decoding; null: no limit of mm's own
    "image_max_source_pixels": optional_positive_int(DEFAULT_MAX_SOURCE_PIXELS),
}


class VLMSFTDataset(torch.utils.data.Dataset):
    """Image–text SFT samples for Qwen-VL models; images are read and processed when a sample is fetched.

    A record whose image is missing or corrupt (or whose conversation cannot be encoded within
    ``cutoff_len``) is an error naming the file and the record, or with ``data.dataset_param.on_error: skip``
    it is replaced by the next good record and counted in the sample's ``skipped_samples`` (the trainer
    logs the running total as ``skipped_samples`` in metrics.jsonl).
    """

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
    ) -> None:
        self._configure(basic_param, preprocess_param, dataset_param, seed)
        for path in self.files:
            for where, obj in iter_records(path):
                self.records.append(self._record(where, obj))

    def _configure(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any,
        seed: int,
    ) -> None:
        """Everything but the records: parameters, dataset files and the processor (local files only)."""
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.seed = seed
        self.cutoff_len: int = basic["cutoff_len"]
        self.dataset_dir: str | None = basic["dataset_dir"]
        self.on_error: str = getattr(dataset_param, "on_error", "raise")
        self.max_source_pixels: int | None = pre["image_max_source_pixels"]
        self.processor = VisionProcessor.load(
            pre["model_name_or_path"], pre["image_min_pixels"], pre["image_max_pixels"], PREPROCESS
        )
        tok = self.processor.tokenizer
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
        self.image_token_id = self.processor.image_token_id
        self.files = resolve_files(basic["dataset"], basic["dataset_dir"], f"{BASIC}.dataset")
        self.records: list[tuple[str, list[dict[str, str]], list[Path]]] = []
        self.skipped: list[str] = []

    def _record(self, where: str, obj: dict[str, Any]) -> tuple[str, list[dict[str, str]], list[Path]]:
        images = image_paths(obj, where, self.dataset_dir)
        if self.on_error == "raise":
            for image in images:
                if not image.is_file():
                    raise DataError(
                        f"{where}: image {image} does not exist (paths are relative to "
                        f"{BASIC}.dataset_dir; data.dataset_param.on_error: skip skips such records)"
                    )
        return where, conversation(obj, where), images

    @classmethod
    def preflight(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
    ) -> list[str]:
        """What ``mm check`` verifies without reading every record: the keys, that every file exists, the
        processor (local files only), the first record of every file (with its images), and the first
        sample encoded (its images decoded under the pixel limit). Raises ConfigError/DataError as building
        the dataset and reading that sample would (with ``on_error: skip`` a bad first sample is reported)."""
        self = cls.__new__(cls)
        self._configure(basic_param, preprocess_param, dataset_param, 0)
        for path in self.files:
            for where, obj in iter_records(path):
                self.records.append(self._record(where, obj))
                break
        if not self.records:
            raise DataError(f"{', '.join(str(p) for p in self.files)}: no record in any file")
        try:
            sample = self.encode(0)
            first = (
                f"first record: {len(sample['input_ids']):,} tokens, "
                f"{len(sample.get('image_grid_thw', ())):,} image(s) (cutoff_len {self.cutoff_len})"
            )
        except DataError as e:
            if self.on_error != "skip":
                raise
            first = f"first record would be skipped (on_error: skip): {e}"
        size = sum(p.stat().st_size for p in self.files)
        more = ", ..." if len(self.files) > 1 else ""
        limit = f"{self.max_source_pixels:,}" if self.max_source_pixels else "no limit"
        return [
            f"{len(self.files)} file(s), {size / 2**20:.1f} MiB ({self.files[0]}{more}); processor "
            f"{self.processor.tokenizer.name_or_path} (images resized to at most "
            f"{self.processor.target_pixels or '?'} pixels, sources over {limit} refused)",
            first,
        ]

    def __len__(self) -> int:
        return len(self.records)

    def encode(self, index: int) -> dict[str, Any]:
        """The sample for record ``index``; raises DataError naming the record when it cannot be built."""
        where, messages, images = self.records[index]
        try:
            target = self.processor.target_pixels
            loaded = [
                load_image(p, max_source_pixels=self.max_source_pixels, target_pixels=target) for p in images
            ]
            pixels = self.processor.images(loaded) if images else {}
            ids, labels = self.processor.encode(messages, pixels.get("image_grid_thw"))
        except (OSError, EncodeError) as e:
            raise DataError(f"{where}: {e}") from None
        if len(ids) > self.cutoff_len:
            raise DataError(
                f"{where}: {len(ids)} tokens (with image tokens) exceed {BASIC}.cutoff_len = "
                f"{self.cutoff_len}; "
                f"raise cutoff_len or lower {PREPROCESS}.image_max_pixels"
            )
        input_ids = torch.tensor(ids, dtype=torch.long)
        sample: dict[str, Any] = {
            "input_ids": input_ids,
            "labels": torch.tensor(labels, dtype=torch.long),
            "mm_token_type_ids": (input_ids == self.image_token_id).long(),
            "sample_id": index,
        }
        sample.update(pixels)
        return sample

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        index %= n
        for tries in range(n):
            try:
                sample = self.encode((index + tries) % n)
            except DataError as e:
                if self.on_error != "skip":
                    raise
                self.skipped.append(str(e))
                logger.warning("vlm_sft: skipping a record (on_error: skip): %s", e)
                continue
            sample["skipped_samples"] = tries
            return sample
        raise DataError(
            "vlm_sft: every record failed to load (data.dataset_param.on_error: skip); first: "
            + (self.skipped[0] if self.skipped else "?")
        )
