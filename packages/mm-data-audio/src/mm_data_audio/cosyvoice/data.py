"""``cosyvoice_speech``: one dataset over speech stores for every CosyVoice3 stage, and the three collators.

``data.dataset_param.basic_parameters``:

- ``dataset``: a store folder or a list of them (:mod:`mm_data_audio.cosyvoice.store`; every store of a run
  must have the same ``speech_vocab``); ``weights``: optional mixing weights, one per store;
- ``stage``: ``lm``, ``flow`` or ``vocoder`` (what a sample holds, below);
- ``segment_samples`` (vocoder): the crop length in samples, a multiple of 480 (default 24960 = 52 frames,
  upstream's); ``null`` trains on whole utterances;
- ``bistream_prob`` (lm): the probability that an eligible sample trains bi-stream
  (:mod:`mm_data_audio.cosyvoice.sequence`; upstream 0.5; default 0: uni-stream only); ``mix_ratio`` (lm):
  text and speech tokens per bi-stream block, default ``[5, 15]``.

``data.dataset_param.preprocess_parameters`` (lm): ``model_name_or_path``, the local folder of the text
tokenizer (CosyVoice3: the Qwen2 tokenizer of ``CosyVoice-BlankEN`` with CosyVoice3's special tokens
added), and ``instruct``, the instruction put before every text (upstream's LibriTTS recipe: ``"You are a
helpful assistant.<|endofprompt|>"``, the default; ``""`` for none).

A sample, by stage:

- ``lm``: ``input_ids``, ``speech_mask``, ``labels`` [N]: the assembled row of
  :func:`~mm_data_audio.cosyvoice.sequence.lm_sequence`;
- ``flow``: ``speech_tokens`` [S], ``mel`` [2S, 80], ``speaker`` [192] (zeros when the record has none);
- ``vocoder``: ``audio`` [L] (a crop of ``segment_samples``, zero-padded when the utterance is shorter) and
  ``mel`` [L / 480, 80], the crop's :func:`~mm_data_audio.cosyvoice.audio.log_mel`;

each with ``noise_seed`` and ``sample_id``. **Seeds.** ``noise_seed`` is derived from the training seed,
the epoch and the sample's index (:func:`noise_seed`; mm calls :meth:`CosyVoiceSpeechDataset.set_epoch`
before each epoch, also when resuming): the flow model draws its noise, time and dropout from it, the
bi-stream coin and the vocoder's crop are drawn from streams derived from it. So a sample is the same on any
number of ranks and after a resume, and changes every epoch.

A record whose files are missing, of the wrong shape (``T != 2 × S``, ...) or out of range is a DataError
naming ``index.jsonl:line (id)``; with ``data.dataset_param.on_error: skip`` it is replaced by the next good
record and counted in ``skipped_samples``.

Collators (``data.dataloader_param.collate_param.collator_id``) right-pad and add lengths:

- ``cosyvoice_lm``: ``input_ids`` (pad 0), ``speech_mask`` (bool, pad False), ``labels`` (pad -100) and
  ``attention_mask`` [B, N];
- ``cosyvoice_flow``: ``speech_tokens`` [B, S] (pad 0) + ``speech_lengths``, ``mel`` [B, T, 80] (pad 0) +
  ``mel_lengths`` (= 2 × speech_lengths), ``speaker`` [B, 192], ``noise_seed`` (a list of ints: it stays on
  the host, the model seeds CPU generators with it);
- ``cosyvoice_vocoder``: ``audio`` [B, L] + ``audio_lengths``, ``mel`` [B, T, 80] + ``mel_lengths``,
  ``noise_seed``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from mm_core.data.collate import COLLATE_FIELDS, Padding, meta_fields, pad_tokens
from mm_core.data.params import (
    BASIC,
    PREPROCESS,
    Field,
    check_weights,
    choice,
    optional_positive_int,
    optional_string,
    optional_weights,
    paths,
    read_params,
)
from mm_core.data.plan import DataPlan
from mm_core.data.skipping import fetch_skipping, next_usable
from mm_core.errors import ConfigError, DataError
from mm_core.train.loss import IGNORE_INDEX

from .audio import HOP, log_mel
from .sequence import MIX_RATIO, bistream_allowed, lm_sequence
from .store import (
    SpeechRecord,
    StoreMeta,
    check_mel,
    load_mel,
    load_speaker,
    load_tokens,
    load_wave,
    read_index,
    read_meta,
    token_count,
)

logger = logging.getLogger("mm")

STAGES = ("lm", "flow", "vocoder")
#: upstream's vocoder crop: 24960 samples = 52 mel frames = 26 speech tokens (1.04 s)
SEGMENT_SAMPLES = 24960
DEFAULT_INSTRUCT = "You are a helpful assistant.<|endofprompt|>"
#: XOR-ed into a sample's noise_seed for the draws that must not move the model's noise
BISTREAM_STREAM = 0x2545F4914F6CDD1D
CROP_STREAM = 0x5851F42D4C957F2D


def _probability(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0


def _mix(v: Any) -> bool:
    return (
        isinstance(v, (list, tuple))
        and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
    )


BASIC_FIELDS = {
    "dataset": paths(),
    "weights": optional_weights(None),
    "stage": choice(STAGES),
    "segment_samples": optional_positive_int(SEGMENT_SAMPLES),
    "bistream_prob": Field("a probability in [0, 1]", _probability, 0.0),
    "mix_ratio": Field("a list of 2 positive integers [text, speech]", _mix, list(MIX_RATIO)),
}
PREPROCESS_FIELDS = {
    "model_name_or_path": optional_string(None),
    "instruct": optional_string(DEFAULT_INSTRUCT),
}


def noise_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` in epoch ``epoch`` of a run seeded ``seed`` (the same on every
    platform)."""
    digest = hashlib.sha256(f"mm-cosyvoice-noise:{seed}:{epoch}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def stream_uniform(seed: int, stream: int) -> float:
    """A uniform draw in [0, 1) from the stream ``stream`` of the sample seeded ``seed``."""
    g = torch.Generator()
    g.manual_seed((int(seed) ^ stream) & (2**63 - 1))
    return float(torch.rand((), generator=g, dtype=torch.float64))


def load_text_tokenizer(name_or_path: str | None) -> Any:
    """The text tokenizer of the lm stage, from a local folder (mm never downloads)."""
    from pathlib import Path

    key = f"{PREPROCESS}.model_name_or_path"
    if not name_or_path:
        raise ConfigError(f"{key}: missing; the lm stage needs the local folder of its text tokenizer")
    if not Path(name_or_path).is_dir():
        raise ConfigError(
            f"{key}: {name_or_path!r} is not a local folder; mm never downloads, so download the tokenizer "
            "first and give that folder"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing
        raise ConfigError(
            f"{key}: cannot load a tokenizer from {name_or_path!r}: {' '.join(str(exc).split())}"
        ) from None


class CosyVoiceSpeechDataset:
    """Map-style dataset over one or more speech stores, for one stage (module docstring)."""

    #: the parameter keys mm reads (run outputs kept out of the sources, tokenizer files in an export)
    mm_data_plan: ClassVar[DataPlan] = DataPlan(source_keys=("dataset",), processor_key="model_name_or_path")

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None = None,
        preprocess_param: Mapping[str, Any] | None = None,
        dataset_param: Any = None,
        seed: int = 42,
    ) -> None:
        params = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.stage: str = params["stage"]
        stores = [params["dataset"]] if isinstance(params["dataset"], str) else list(params["dataset"])
        self.records: list[SpeechRecord] = []
        sizes, metas = [], []
        for store in stores:
            try:
                metas.append(read_meta(store))
                records = read_index(store)
            except DataError as exc:
                raise DataError(f"{BASIC}.dataset: {exc}") from None
            self.records += records
            sizes.append(len(records))
        if any(m != metas[0] for m in metas):
            found = ", ".join(f"{s}: {m.speech_vocab}" for s, m in zip(stores, metas))
            raise DataError(
                f"{BASIC}.dataset: the stores have different speech_vocab ({found}); mix stores of one "
                "speech tokenizer only"
            )
        self.meta: StoreMeta = metas[0]
        self.speech_vocab = self.meta.speech_vocab
        self.source_sizes = sizes
        self.source_weights = check_weights(params["weights"], len(stores), f"{BASIC}.weights")
        segment = params["segment_samples"]
        if segment is not None and segment % HOP:
            raise ConfigError(
                f"{BASIC}.segment_samples: got {segment}; expected a multiple of {HOP} (whole mel frames)"
            )
        self.segment_samples: int | None = segment
        self.bistream_prob = float(params["bistream_prob"])
        self.mix_ratio = (int(params["mix_ratio"][0]), int(params["mix_ratio"][1]))
        self.tokenizer: Any = None
        self.instruct_ids: list[int] = []
        if self.stage == "lm":
            self.tokenizer = load_text_tokenizer(pre["model_name_or_path"])
            self.instruct_ids = self._encode(pre["instruct"] or "")
        self.seed = seed
        self.epoch = 0
        self.on_error: str = getattr(dataset_param, "on_error", "raise")
        self._first_skip: str | None = None
        self._lengths: npt.NDArray[np.int64] | None = None

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        """Called by mm before each epoch's samples are read: the seeds depend on it."""
        self.epoch = int(epoch)

    # ------------------------------------------------------------------------------------ lengths
    def _length(self, index: int) -> int:
        r = self.records[index]
        if self.stage == "vocoder" and self.segment_samples is not None:
            return self.segment_samples // HOP
        tokens = token_count(r)
        if self.stage == "lm":
            # sos + instruct + text + task_id + speech + the appended eos (uni-stream; bi-stream is as long)
            return 3 + len(self.instruct_ids) + len(self._encode(r.text)) + tokens
        if self.stage == "flow":
            check_mel(r, tokens)
        return 2 * tokens  # mel frames

    def sample_lengths(self) -> npt.NDArray[np.int64]:
        """Per sample, what the collator pads: LM sequence positions (lm) or mel frames (flow, vocoder).
        Under ``on_error: skip`` a record whose token file cannot be read counts as the one replacing it."""
        if self._lengths is None:
            lengths = np.zeros(len(self.records), dtype=np.int64)
            usable = np.ones(len(self.records), dtype=bool)
            for i in range(len(self.records)):
                try:
                    lengths[i] = self._length(i)
                except DataError:
                    if self.on_error != "skip":
                        raise
                    usable[i] = False
            if not usable.any():
                raise DataError(
                    "cosyvoice_speech: every record failed to load (data.dataset_param.on_error: skip)"
                )
            self._lengths = lengths[next_usable(usable)]
        return self._lengths

    # ------------------------------------------------------------------------------------ samples
    def load(self, index: int) -> dict[str, Any]:
        """Sample ``index`` without the skip rule (DataError for a bad record)."""
        r = self.records[index]
        seed = noise_seed(self.seed, self.epoch, index)
        sample: dict[str, Any]
        if self.stage == "lm":
            sample = self._lm(r, seed)
        elif self.stage == "flow":
            tokens = load_tokens(r, self.speech_vocab)
            sample = {"speech_tokens": tokens, "mel": load_mel(r, len(tokens)), "speaker": load_speaker(r)}
        else:
            sample = self._vocoder(r, seed)
        sample["noise_seed"] = seed
        sample["sample_id"] = index
        return sample

    def _lm(self, r: SpeechRecord, seed: int) -> dict[str, Any]:
        text = self._encode(r.text)
        if not text:
            raise DataError(f"{r.where}: the text gives no tokens; the LM needs text to speak")
        speech = load_tokens(r, self.speech_vocab)
        bistream = (
            self.bistream_prob > 0
            and bistream_allowed(len(text), len(speech), self.mix_ratio)
            and stream_uniform(seed, BISTREAM_STREAM) < self.bistream_prob
        )
        seq = lm_sequence(
            self.instruct_ids, text, speech, self.speech_vocab, bistream=bistream, mix_ratio=self.mix_ratio
        )
        return {"input_ids": seq.input_ids, "speech_mask": seq.speech_mask, "labels": seq.labels}

    def _vocoder(self, r: SpeechRecord, seed: int) -> dict[str, Any]:
        tokens = token_count(r)
        wave = load_wave(r, tokens)
        segment = self.segment_samples
        if segment is None:
            return {"audio": wave, "mel": load_mel(r, tokens)}
        if len(wave) >= segment:
            start = int(stream_uniform(seed, CROP_STREAM) * (len(wave) - segment + 1))
            crop = wave[start : start + segment]
        else:
            crop = torch.nn.functional.pad(wave, (0, segment - len(wave)))
        return {"audio": crop, "mel": log_mel(crop)}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return fetch_skipping(
            "cosyvoice_speech", index, len(self.records), self.load, self.on_error, self._skipped, logger
        )

    def _skipped(self, exc: DataError) -> str:
        if self._first_skip is None:
            self._first_skip = str(exc)
        return self._first_skip


# ---------------------------------------------------------------------------------------------- collators
def _pad_stack(tensors: Sequence[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad along the first dim and stack: ``([B, max, ...], lengths [B])``."""
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.long)
    out = tensors[0].new_full((len(tensors), int(lengths.max()), *tensors[0].shape[1:]), value)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out, lengths


def _require(features: Sequence[Mapping[str, Any]], keys: Sequence[str], collator: str) -> None:
    if not features:
        raise DataError(f"{collator} collate: got an empty list of samples")
    for f in features:
        missing = [k for k in keys if k not in f]
        if missing:
            raise DataError(
                f"{collator} collate: sample {f.get('sample_id')} lacks {', '.join(missing)}; is "
                f"data.dataset_param.basic_parameters.stage the stage of this collator?"
            )


class CosyVoiceLMCollator:
    """``cosyvoice_lm``: the assembled rows right-padded (module docstring); ``pad_to_multiple_of`` rounds
    the width up."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        self.padding = Padding.read(collate_param, None)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        _require(features, ("input_ids", "speech_mask", "labels"), "cosyvoice_lm")
        batch: dict[str, Any] = pad_tokens(
            features, {"input_ids": 0, "labels": IGNORE_INDEX, "speech_mask": 0}, self.padding
        )
        batch["speech_mask"] = batch["speech_mask"].bool()
        batch.update(meta_fields(features))
        return batch


class CosyVoiceFlowCollator:
    """``cosyvoice_flow``: speech tokens, mels and speaker embeddings, padded, with lengths."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        read_params(collate_param, COLLATE_FIELDS, "data.dataloader_param.collate_param")

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        _require(features, ("speech_tokens", "mel", "speaker", "noise_seed"), "cosyvoice_flow")
        tokens, speech_lengths = _pad_stack([f["speech_tokens"] for f in features])
        mel, mel_lengths = _pad_stack([f["mel"] for f in features])
        if not torch.equal(mel_lengths, 2 * speech_lengths):
            raise DataError(
                f"cosyvoice_flow collate: mel frames {mel_lengths.tolist()} are not twice the speech tokens "
                f"{speech_lengths.tolist()}"
            )
        batch: dict[str, Any] = {
            "speech_tokens": tokens,
            "speech_lengths": speech_lengths,
            "mel": mel,
            "mel_lengths": mel_lengths,
            "speaker": torch.stack([f["speaker"] for f in features]),
            "noise_seed": [int(f["noise_seed"]) for f in features],
        }
        batch.update(meta_fields(features))
        return batch


class CosyVoiceVocoderCollator:
    """``cosyvoice_vocoder``: audio crops and their mels, padded, with lengths."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        read_params(collate_param, COLLATE_FIELDS, "data.dataloader_param.collate_param")

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        _require(features, ("audio", "mel", "noise_seed"), "cosyvoice_vocoder")
        audio, audio_lengths = _pad_stack([f["audio"] for f in features])
        mel, mel_lengths = _pad_stack([f["mel"] for f in features])
        batch: dict[str, Any] = {
            "audio": audio,
            "audio_lengths": audio_lengths,
            "mel": mel,
            "mel_lengths": mel_lengths,
            "noise_seed": [int(f["noise_seed"]) for f in features],
        }
        batch.update(meta_fields(features))
        return batch


__all__ = [
    "CosyVoiceFlowCollator",
    "CosyVoiceLMCollator",
    "CosyVoiceSpeechDataset",
    "CosyVoiceVocoderCollator",
    "noise_seed",
]
