"""``vlm_sft``: conversations with images and videos (LLaMA-Factory / ShareGPT style JSON or JSONL)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import transformers

from mm_core.data.cache import CacheOptions, cache_fields, tokenizer_fingerprint
from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    Field,
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
from mm_core.data.prepare import PreparedDataset
from mm_core.data.skipping import fetch_skipping, next_usable
from mm_core.errors import DataError

from . import __version__
from .encode import EncodeError, VideoOptions, VisionProcessor
from .images import DEFAULT_MAX_SOURCE_PIXELS, load_image
from .index import (
    INDEX_FORMAT,
    INVALID,
    MISSING_IMAGE,
    OK,
    IndexSettings,
    RecordIndex,
    build_index,
    missing_image,
)
from .records import RecordError, iter_records, parse_record, read_media, resolve_files
from .videos import DEFAULT_MAX_SOURCE_FRAMES, load_frames, probe_video
from .videos import DEFAULT_MAX_SOURCE_PIXELS as DEFAULT_VIDEO_SOURCE_PIXELS

logger = logging.getLogger(__name__)

BASIC_FIELDS = {
    "dataset_dir": optional_string(None),
    "dataset": paths(),
    "cutoff_len": positive_int(2048),
    "weights": optional_weights(),
    **cache_fields(),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": string(),
    "image_max_pixels": optional_positive_int(None),
    "image_min_pixels": optional_positive_int(None),
    # an image with more pixels (read from its header) is refused before decoding; null: no limit of mm's own
    "image_max_source_pixels": optional_positive_int(DEFAULT_MAX_SOURCE_PIXELS),
    # videos (Qwen3-VL / Qwen3.5, from the folder's video_preprocessor_config.json); null: the folder's own
    "video_fps": Field(
        "a positive number or null",
        lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
        None,
    ),
    "video_max_frames": optional_positive_int(None),
    "video_min_pixels": optional_positive_int(None),  # pixels of a whole clip, all sampled frames together
    "video_max_pixels": optional_positive_int(None),
    # a video whose header says more frames, or more pixels a frame, is refused before decoding
    "video_max_source_frames": optional_positive_int(DEFAULT_MAX_SOURCE_FRAMES),
    "video_max_source_pixels": optional_positive_int(DEFAULT_VIDEO_SOURCE_PIXELS),
}
PREPARE_AGAIN = f"prepare again (`mm data prepare CONFIG --overwrite`, or {BASIC}.overwrite_cache: true)"


class VLMSFTDataset(PreparedDataset, torch.utils.data.Dataset):
    """Image/video–text SFT samples for vision-language models, from a record index prepared once
    (``mm_data_vlm.index``).

    Construction maps the index (every rank of a node shares one preparation, done under a lock the first
    time); a sample is read, parsed and encoded when it is fetched, its images decoded then (in DataLoader
    workers). The index also gives every sample's token count (``sample_lengths()``, for token-budget
    batching), counted at preparation without decoding images and checked against the encoded sample.

    A record that cannot be used is an error naming the file and the record, or with
    ``data.dataset_param.on_error: skip`` it is replaced by the next good record and counted in the sample's
    ``skipped_samples`` (the trainer logs the running total as ``skipped_samples`` in metrics.jsonl):

    - invalid structure (not JSON, no conversation, ...) or a missing image or video: raised when the dataset
      is built (``on_error: raise``), else skipped;
    - an image refused from its header (unreadable, over ``image_max_source_pixels``), a video refused from
      its container header (unreadable, no video stream, over ``video_max_source_frames`` frames or
      ``video_max_source_pixels`` pixels a frame), a conversation that does not encode, or more than
      ``cutoff_len`` tokens (decided from the prepared count, so nothing is decoded for it): raised or skipped
      when the sample is fetched;
    - an image or video that fails to decode (a video whose stream ends before its header's frame count), or
      a sample whose tokens differ from the prepared count (a file changed since preparation): likewise, when
      the sample is fetched.

    Videos (``<video>`` placeholders, ``videos`` paths) are read for the Qwen3-VL family (Qwen3-VL,
    Qwen3-VL-MoE, Qwen3.5) when the processor folder has a ``video_preprocessor_config.json``: frames sampled
    at ``video_fps`` (default: the folder's ``fps``), at most ``video_max_frames``, resized within
    ``video_min_pixels`` .. ``video_max_pixels`` pixels for the whole clip
    (:mod:`mm_data_vlm.qwen_vl_videos`).
    A sample with videos carries ``pixel_values_videos`` and ``video_grid_thw``.
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
        basic, pre = self._configure(basic_param, preprocess_param, dataset_param, seed)
        self.source_weights = check_weights(basic["weights"], len(self.files), f"{BASIC}.weights")
        options = CacheOptions.read(basic, workers=workers, overwrite=overwrite)
        settings = IndexSettings(
            processor=pre["model_name_or_path"],
            min_pixels=pre["image_min_pixels"],
            max_pixels=pre["image_max_pixels"],
            max_source_pixels=self.max_source_pixels,
            dataset_dir=self.dataset_dir,
            video=self.video_options,
            video_max_source_frames=self.video_limits[0],
            video_max_source_pixels=self.video_limits[1],
        )
        spec = {
            "index_format": INDEX_FORMAT,
            "mm_data_vlm": __version__,
            "transformers": transformers.__version__,  # its resize rule and chat-template rendering
            "processor": tokenizer_fingerprint(pre["model_name_or_path"]),
            "image_min_pixels": settings.min_pixels,
            "image_max_pixels": settings.max_pixels,
            "image_max_source_pixels": settings.max_source_pixels,
            "video": [
                settings.video.fps,
                settings.video.max_frames,
                settings.video.min_pixels,
                settings.video.max_pixels,
                settings.video_max_source_frames,
                settings.video_max_source_pixels,
            ],
            "dataset_dir": str(Path(self.dataset_dir or ".").resolve()),
        }

        def build(folder: Path) -> dict[str, Any]:
            logger.info(
                "vlm_sft: indexing %d file(s) with up to %d process(es) into %s",
                len(self.files),
                options.workers,
                folder.parent,
            )
            return build_index(folder, self.files, settings, options.workers, self.processor)

        self.prepared, self.built = options.open("vlm_sft", spec, self.files, build)
        self.index = RecordIndex(self.prepared.path, self.prepared.payload, self.files)
        self.source_sizes = self.index.source_sizes
        status = self.index.column("status")
        if self.on_error == "raise":
            fatal = np.flatnonzero((status == INVALID) | (status == MISSING_IMAGE))
            if len(fatal):
                raise DataError(self._problem(int(fatal[0])))
        counts = self.prepared.payload["status"]
        logger.info(
            "vlm_sft: %d records in %d file(s) (%s); %s %s",
            len(self),
            len(self.files),
            ", ".join(f"{n:,} {name}" for name, n in counts.items()) or "none",
            "indexed into" if self.built else "mapped from",
            self.prepared.path,
        )

    def _configure(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any,
        seed: int,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Everything but the index: parameters, dataset files and the processor (local files only)."""
        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.seed = seed
        self.cutoff_len: int = basic["cutoff_len"]
        self.dataset_dir: str | None = basic["dataset_dir"]
        self.on_error: str = getattr(dataset_param, "on_error", "raise")
        self.max_source_pixels: int | None = pre["image_max_source_pixels"]
        self.video_options = VideoOptions(
            fps=None if pre["video_fps"] is None else float(pre["video_fps"]),
            max_frames=pre["video_max_frames"],
            min_pixels=pre["video_min_pixels"],
            max_pixels=pre["video_max_pixels"],
        )
        self.video_limits: tuple[int | None, int | None] = (
            pre["video_max_source_frames"],
            pre["video_max_source_pixels"],
        )
        self.processor = VisionProcessor.load(
            pre["model_name_or_path"],
            pre["image_min_pixels"],
            pre["image_max_pixels"],
            PREPROCESS,
            self.video_options,
        )
        tok = self.processor.tokenizer
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
        self.image_token_id = self.processor.image_token_id
        self.files = resolve_files(basic["dataset"], basic["dataset_dir"], f"{BASIC}.dataset")
        self.skipped: list[str] = []
        return basic, pre

    def prepared_summary(self) -> list[str]:
        statuses = ", ".join(f"{n:,} {name}" for name, n in self.prepared.payload["status"].items())
        lengths = self.index.column("tokens")[self._usable()]
        tokens = (
            f"{int(lengths.sum()):,} tokens, longest {int(lengths.max()):,}" if len(lengths) else "no tokens"
        )
        return [
            f"{len(self.files)} file(s), {len(self):,} records ({statuses or 'none'}); "
            f"{len(lengths):,} usable within cutoff_len {self.cutoff_len}: {tokens}"
        ]

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
        first: tuple[str, list[dict[str, str]], list[Path], list[Path]] | None = None
        for path in self.files:
            for where, obj in iter_records(path):
                try:
                    messages, images, videos = read_media(obj, self.dataset_dir)
                except RecordError as e:
                    raise DataError(f"{where}: {e}") from None
                if self.on_error == "raise":
                    for kind, media in (("image", images), ("video", videos)):
                        for item in media:
                            if not item.is_file():
                                raise DataError(f"{where}: {missing_image(item, kind)}")
                first = first or (where, messages, images, videos)
                break
        if first is None:
            raise DataError(f"{', '.join(str(p) for p in self.files)}: no record in any file")
        try:
            sample = self._sample(first[0], first[1], first[2], None, first[3])
            line = (
                f"first record: {len(sample['input_ids']):,} tokens, "
                f"{len(first[2]):,} image(s){f', {len(first[3]):,} video(s)' if first[3] else ''} "
                f"(cutoff_len {self.cutoff_len})"
            )
        except DataError as e:
            if self.on_error != "skip":
                raise
            line = f"first record would be skipped (on_error: skip): {e}"
        size = sum(p.stat().st_size for p in self.files)
        more = ", ..." if len(self.files) > 1 else ""
        limit = f"{self.max_source_pixels:,}" if self.max_source_pixels else "no limit"
        return [
            f"{len(self.files)} file(s), {size / 2**20:.1f} MiB ({self.files[0]}{more}); processor "
            f"{self.processor.tokenizer.name_or_path}: {self.processor.format.describe()}, "
            f"sources over {limit} refused; "
            + (self.processor.videos.describe() if self.processor.videos else self.processor.no_videos),
            line,
        ]

    def __len__(self) -> int:
        return len(self.index)

    def _usable(self) -> np.ndarray:
        """Per record: prepared fine and within ``cutoff_len`` (bool)."""
        return (self.index.column("status") == OK) & (self.index.column("tokens") <= self.cutoff_len)

    def sample_lengths(self) -> np.ndarray:
        """Tokens of each sample as the collator sees it (text and image placeholder tokens), from the
        index: no image is read. A record that cannot be used counts as the record that replaces it under
        ``on_error: skip`` (the next usable one)."""
        usable = self._usable()
        if len(usable) and not usable.any():
            files = ", ".join(str(p) for p in self.files)
            raise DataError(f"vlm_sft: no usable record in {files}; first: {self._problem(0)}")
        return self.index.column("tokens")[next_usable(usable)].astype(np.int64)

    def _problem(self, index: int) -> str:
        """Why record ``index`` cannot be used, naming it (``file:line``)."""
        where = self.index.where(index)
        tokens = int(self.index.column("tokens")[index])
        if self.index.column("status")[index] == OK and tokens > self.cutoff_len:
            return self._too_long(where, tokens)
        return f"{where}: {self.index.problem(index)}"

    def _too_long(self, where: str, tokens: int) -> str:
        return (
            f"{where}: {tokens} tokens (with image and video tokens) exceed {BASIC}.cutoff_len = "
            f"{self.cutoff_len}; raise cutoff_len or lower {PREPROCESS}.image_max_pixels (video_max_pixels, "
            "video_max_frames for videos)"
        )

    def _sample(
        self,
        where: str,
        messages: Sequence[dict[str, str]],
        images: Sequence[Path],
        prepared: int | None,
        videos: Sequence[Path] = (),
    ) -> dict[str, Any]:
        """Decode the images and videos and encode the conversation; the tokens must be ``prepared`` when
        given, else within ``cutoff_len``. Raises DataError naming ``where``."""
        frames, video_rows = 0, 0
        try:
            target = self.processor.target_pixels
            loaded = [
                load_image(p, max_source_pixels=self.max_source_pixels, target_pixels=target) for p in images
            ]
            sizes = [im.size for im in loaded]
            pixels = self.processor.images(loaded) if images else {}
            max_frames, max_pixels = self.video_limits
            headers = [
                probe_video(p, max_source_frames=max_frames, max_source_pixels=max_pixels) for p in videos
            ]
            plans = self.processor.video_plans(headers)
            if videos and self.processor.videos is not None:
                clips = [
                    (load_frames(p, h, plan.indices), plan) for p, h, plan in zip(videos, headers, plans)
                ]
                frames = sum(len(plan.indices) for plan in plans)
                video_pixels = self.processor.videos.pixels(clips)
                video_rows = self.processor.videos.feature_rows(video_pixels)
                pixels = {**pixels, **video_pixels}
            ids, labels = self.processor.encode_sizes(messages, sizes, plans)
        except (OSError, EncodeError) as e:
            raise DataError(f"{where}: {e}") from None
        rows = self.processor.format.feature_rows(pixels) if images else 0
        if self.processor.image_token_count(ids) != rows:  # a defect of the family's image format, never data
            raise DataError(
                f"{where}: {self.processor.image_token_count(ids)} image tokens but the vision tower gets "
                f"{rows} rows for images of sizes {sizes} (the {self.processor.format.name} format of "
                "mm-data-vlm)"
            )
        if self.processor.video_token_count(ids) != video_rows:  # a defect of mm's video path, never data
            raise DataError(
                f"{where}: {self.processor.video_token_count(ids)} video tokens but the vision tower gets "
                f"{video_rows} rows for {len(videos)} video(s) of {frames} sampled frames"
            )
        if prepared is not None and len(ids) != prepared:
            media = f", its videos {', '.join(str(p) for p in videos)}" if videos else ""
            raise DataError(
                f"{where}: {len(ids)} tokens now but {prepared} when it was prepared (into "
                f"{self.prepared.path}): an image{' or video' if videos else ''} changed since preparation "
                f"(its images {', '.join(str(p) for p in images) or 'none'} now reach the processor at sizes "
                f"{sizes}{media}; images and videos are read at training time and only checked against the "
                "prepared length); " + PREPARE_AGAIN
            )
        if prepared is None and len(ids) > self.cutoff_len:
            raise DataError(self._too_long(where, len(ids)))
        input_ids = torch.tensor(ids, dtype=torch.long)
        sample: dict[str, Any] = {"input_ids": input_ids, "labels": torch.tensor(labels, dtype=torch.long)}
        if self.processor.format.token_type_ids:  # 1 at image tokens, 2 at video tokens (transformers' rule)
            types = (input_ids == self.image_token_id).long()
            if self.processor.video_token_id is not None:
                types = types + 2 * (input_ids == self.processor.video_token_id).long()
            sample["mm_token_type_ids"] = types
        sample.update(pixels)
        return sample

    def encode(self, index: int) -> dict[str, Any]:
        """The sample for record ``index``; raises DataError naming the record when it cannot be built. A
        record refused at preparation (or over ``cutoff_len``) is refused here without opening its images."""
        if not self._usable_one(index):
            raise DataError(self._problem(index))
        where = self.index.where(index)
        try:
            messages, images, videos = read_media(parse_record(self.index.text(index)), self.dataset_dir)
        except RecordError as e:  # the file changed under a running job
            raise DataError(f"{where}: {e} (the file changed since preparation?)") from None
        prepared = int(self.index.column("tokens")[index])
        sample = self._sample(where, messages, images, prepared, videos)
        sample["sample_id"] = index
        return sample

    def _usable_one(self, index: int) -> bool:
        return bool(
            self.index.column("status")[index] == OK and self.index.column("tokens")[index] <= self.cutoff_len
        )

    def __getitem__(self, index: int) -> dict[str, Any]:
        return fetch_skipping("vlm_sft", index, len(self), self.encode, self.on_error, self._skipped, logger)

    def _skipped(self, error: DataError) -> str:
        """Record a skipped record (``on_error: skip``); the first skip's message."""
        self.skipped.append(str(error))
        return self.skipped[0]
