"""``video_latents``: training samples from latent stores (precomputed video latents + text embeddings).

``data.dataset_param.basic_parameters``:

- ``dataset``: a store folder or a list of them (written by :func:`mm_data_video.encode_clips`);
- ``weights``: optional mixing weights, one per store (see :mod:`mm_core.data.sampling`);
- ``text_length``: the text embeddings are zero-padded to this many tokens (Wan's pipeline: 512); a longer
  embedding is a DataError;
- ``patch_size``: the transformer's ``[t, h, w]`` patch, to count each sample's video tokens for
  ``max_tokens_per_batch`` (Wan: ``[1, 2, 2]``).

A sample is ``latents`` [C, F, H, W], ``encoder_hidden_states`` [text_length, D], ``encoder_attention_mask``
[text_length] (1 for the text's real tokens, 0 for the padding: LTX-2 masks the padding, Wan's pipeline
attends to the zeros and its model ignores the mask), ``noise_seed`` and ``sample_id``; a record with audio
(see :mod:`mm_data_video.store`) adds ``audio_latents`` [C_a, L_a, M] and, when stored,
``audio_encoder_hidden_states`` [text_length, D_a] (padded like the text).

**Noise seeds**: the model draws each sample's noise level and noise from ``noise_seed``, which is derived
from the training seed, the epoch and the sample's index (:func:`noise_seed`). mm calls
:meth:`VideoLatentsDataset.set_epoch` before each epoch starts (also when resuming), so a sample gets new
noise every epoch, the same on any number of ranks and after a resume.

**Buckets.** Clips of several resolutions and lengths give latents of several shapes; a micro-batch must
hold one shape. :meth:`~VideoLatentsDataset.sample_buckets` gives every distinct latent shape (with its
audio latent shape, if any) its own bucket,
and with ``data.dataloader_param.max_tokens_per_batch`` mm cuts micro-batches that never mix buckets (the
collator checks it). Without a token budget, a dataset of several shapes needs ``training.micro_batch_size:
1``.

A record whose files are missing, of another shape than the index says, or holding NaN/inf is a DataError
naming ``index.jsonl:line (id)``; with ``data.dataset_param.on_error: skip`` it is replaced by the next good
record and counted in ``skipped_samples``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    Field,
    check_weights,
    optional_weights,
    paths,
    positive_int,
    read_params,
)
from mm_core.data.plan import DataPlan
from mm_core.errors import DataError

from .store import LatentRecord, load_array, read_index

logger = logging.getLogger("mm")


def _patch(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 3 and all(isinstance(x, int) and x > 0 for x in v)


BASIC_FIELDS = {
    "dataset": paths(),
    "weights": optional_weights(None),
    "text_length": positive_int(512),
    "patch_size": Field("a list of 3 positive integers [t, h, w]", _patch, [1, 2, 2]),
}


def noise_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` in epoch ``epoch`` of a run seeded ``seed`` (the same on every
    platform)."""
    digest = hashlib.sha256(f"mm-video-noise:{seed}:{epoch}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class VideoLatentsDataset:
    """Map-style dataset over one or more latent stores (module docstring)."""

    #: the parameter keys mm reads (run outputs kept out of the sources, tokenizer files in an export)
    mm_data_plan: ClassVar[DataPlan] = DataPlan(source_keys=("dataset",))

    def __init__(
        self,
        basic_param: dict[str, Any] | None = None,
        preprocess_param: dict[str, Any] | None = None,
        dataset_param: Any = None,
        seed: int = 42,
    ) -> None:
        params = read_params(basic_param, BASIC_FIELDS, BASIC)
        read_params(preprocess_param, {}, PREPROCESS)
        stores = [params["dataset"]] if isinstance(params["dataset"], str) else list(params["dataset"])
        self.records: list[LatentRecord] = []
        sizes = []
        for store in stores:
            try:
                records = read_index(store)
            except DataError as exc:
                raise DataError(f"{BASIC}.dataset: {exc}") from None
            self.records += records
            sizes.append(len(records))
        self.source_sizes = sizes
        self.source_weights = check_weights(params["weights"], len(stores), f"{BASIC}.weights")
        self.text_length: int = params["text_length"]
        pt, ph, pw = params["patch_size"]
        self.patch_size = (int(pt), int(ph), int(pw))
        self.seed = seed
        self.epoch = 0
        self.on_error: str = getattr(dataset_param, "on_error", "raise")
        self._check_consistent()

    def _check_consistent(self) -> None:
        first = self.records[0]
        pt, ph, pw = self.patch_size
        audio = [(r, r.audio_latent_shape) for r in self.records if r.audio_latent_shape is not None]
        for r, a in audio:
            b = audio[0][1]
            at, bt = r.audio_text_shape, audio[0][0].audio_text_shape
            if a[0] != b[0] or a[2] != b[2] or (at is None) != (bt is None) or (at and bt and at[1] != bt[1]):
                raise DataError(
                    f"{r.where}: audio latent channels × mel bins {a[0]}×{a[2]} / audio text "
                    f"{list(at) if at else None} differ from {audio[0][0].where} ({b[0]}×{b[2]} / "
                    f"{list(bt) if bt else None}); every store of one run must come from the same audio VAE "
                    "and text encoder"
                )
        for r in self.records:
            if r.latent_shape[0] != first.latent_shape[0] or r.text_shape[1] != first.text_shape[1]:
                raise DataError(
                    f"{r.where}: latent channels {r.latent_shape[0]} / text dim {r.text_shape[1]} differ "
                    f"from {first.where} ({first.latent_shape[0]} / {first.text_shape[1]}); every store of "
                    "one run must come from the same VAE and text encoder"
                )
            _, f, h, w = r.latent_shape
            if f % pt or h % ph or w % pw:
                raise DataError(
                    f"{r.where}: latent frames × height × width {f}×{h}×{w} are not multiples of "
                    f"{BASIC}.patch_size {list(self.patch_size)}"
                )

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        """Called by mm before each epoch's samples are read: the noise seeds depend on it."""
        self.epoch = int(epoch)

    def sample_lengths(self) -> npt.NDArray[np.int64]:
        """Tokens per sample (for ``max_tokens_per_batch``): video tokens after patchify, plus one per audio
        latent frame for a record with audio."""
        pt, ph, pw = self.patch_size
        return np.array(
            [
                (r.latent_shape[1] // pt) * (r.latent_shape[2] // ph) * (r.latent_shape[3] // pw)
                + (r.audio_latent_shape[1] if r.audio_latent_shape else 0)
                for r in self.records
            ],
            dtype=np.int64,
        )

    def sample_buckets(self) -> npt.NDArray[np.int64]:
        """One bucket per distinct latent shape, audio latent shape included (a micro-batch holds one)."""
        ids: dict[tuple[Any, ...], int] = {}
        return np.array(
            [ids.setdefault((r.latent_shape, r.audio_latent_shape), len(ids)) for r in self.records],
            dtype=np.int64,
        )

    def load(self, index: int) -> dict[str, Any]:
        """Sample ``index`` without the skip rule (DataError for a bad record)."""
        r = self.records[index]
        if r.text_shape[0] > self.text_length:
            raise DataError(
                f"{r.where}: the text embedding has {r.text_shape[0]} tokens, more than {BASIC}.text_length "
                f"{self.text_length}"
            )
        latents = load_array(r.latents, r.latent_shape, "latents", r.where)
        mask = torch.zeros(self.text_length, dtype=torch.long)
        mask[: r.text_shape[0]] = 1
        sample = {
            "latents": torch.from_numpy(latents),
            "encoder_hidden_states": self._padded_text(r.text, r.text_shape, "text embedding", r.where),
            "encoder_attention_mask": mask,
            "noise_seed": noise_seed(self.seed, self.epoch, index),
            "sample_id": index,
        }
        if r.audio_latents is not None and r.audio_latent_shape is not None:
            audio = load_array(r.audio_latents, r.audio_latent_shape, "audio latents", r.where)
            sample["audio_latents"] = torch.from_numpy(audio)
        if r.audio_text is not None and r.audio_text_shape is not None:
            sample["audio_encoder_hidden_states"] = self._padded_text(
                r.audio_text, r.audio_text_shape, "audio text embedding", r.where
            )
        return sample

    def _padded_text(self, path: Path, shape: tuple[int, int], what: str, where: str) -> torch.Tensor:
        """The ``[L, D]`` array at ``path``, zero-padded to ``[text_length, D]``."""
        padded = np.zeros((self.text_length, shape[1]), dtype=np.float32)
        padded[: shape[0]] = load_array(path, shape, what, where)
        return torch.from_numpy(padded)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.records)
        for skipped in range(n):
            at = (index + skipped) % n
            try:
                sample = self.load(at)
            except DataError as exc:
                if self.on_error != "skip":
                    raise
                logger.warning("video_latents: skipping a record (on_error: skip): %s", exc)
                continue
            sample["skipped_samples"] = skipped
            return sample
        raise DataError("video_latents: every record failed to load (data.dataset_param.on_error: skip)")
