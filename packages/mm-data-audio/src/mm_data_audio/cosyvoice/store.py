"""The speech store every CosyVoice3 stage trains on: its layout, writing it, and reading it back with checks.

A *speech store* is a folder:

- ``index.jsonl``: one JSON object per utterance: ``id`` (unique, letters / digits / ``._-``), ``text``,
  ``audio`` (``wavs/<id>.wav``), ``speech_tokens`` (``tokens/<id>.npy``), ``mel`` (``mels/<id>.npy``) and,
  optionally, ``speaker`` (``spk/<id>.npy``); paths relative to the folder;
- ``wavs/<id>.wav``: mono PCM16 at 24 kHz, a multiple of 960 samples long (two mel frames per token);
- ``mels/<id>.npy``: float32 ``[T, 80]``, :func:`mm_data_audio.cosyvoice.audio.log_mel` of the wave
  (``T = samples / 480``);
- ``tokens/<id>.npy``: int64 ``[S]`` speech tokens at 25 Hz, ``S = T / 2``, in ``[0, speech_vocab)``;
- ``spk/<id>.npy``: float32 ``[192]`` speaker embedding (CAM++ in CosyVoice3; the flow stage uses it when
  present, else zeros);
- ``meta.json``: ``{"sample_rate": 24000, "hop": 480, "n_mels": 80, "token_rate": 25, "speech_vocab": K}``.

:func:`read_index` checks the index (fields, types, paths inside the store, unique ids) and ``meta.json``;
the arrays are checked when a sample is read (:func:`load_tokens`, :func:`load_mel`, :func:`load_speaker`,
:func:`load_wave`), so that ``data.dataset_param.on_error: skip`` can pass over one bad record. Every problem
is a :class:`~mm_core.errors.DataError` naming ``<store>/index.jsonl:<line> (<id>)`` and the file.

:func:`write_store` writes a store from waves and their speech tokens (which come from a speech tokenizer:
CosyVoice3's ``speech_tokenizer_v3``, or synthetic ones in tests); the tokens decide the length: the wave is
zero-padded or cut to ``960 × len(tokens)`` samples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mm_core.data.records import iter_store_index
from mm_core.errors import DataError

from .audio import HOP, N_MELS, SAMPLE_RATE, TOKEN_SAMPLES, fit_length, log_mel, read_wav, resample, write_wav

INDEX = "index.jsonl"
META = "meta.json"
TOKEN_RATE = 25
SPEAKER_DIM = 192
#: how many tokens the audio may be longer or shorter than the tokens say before write_store refuses it
LENGTH_SLACK_TOKENS = 2
_ID = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class StoreMeta:
    """What ``meta.json`` says; every store of one run must agree."""

    speech_vocab: int
    sample_rate: int = SAMPLE_RATE
    hop: int = HOP
    n_mels: int = N_MELS
    token_rate: int = TOKEN_RATE

    def to_json(self) -> dict[str, int]:
        return {
            "sample_rate": self.sample_rate,
            "hop": self.hop,
            "n_mels": self.n_mels,
            "token_rate": self.token_rate,
            "speech_vocab": self.speech_vocab,
        }


@dataclass(frozen=True)
class SpeechRecord:
    """One utterance of a store: its text and where its files are."""

    where: str  # "<store>/index.jsonl:<line> (<id>)", for messages
    id: str
    text: str
    audio: Path
    speech_tokens: Path
    mel: Path
    speaker: Path | None = None


@dataclass
class Utterance:
    """An utterance to write with :func:`write_store`: ``wave`` (mono, at ``sample_rate``), its 25 Hz
    ``speech_tokens`` and optionally a 192-d ``speaker`` embedding."""

    id: str
    text: str
    wave: npt.NDArray[np.floating]
    speech_tokens: npt.NDArray[np.integer]
    speaker: npt.NDArray[np.floating] | None = None
    sample_rate: int = SAMPLE_RATE


# ------------------------------------------------------------------------------------------------ reading
def read_meta(root: str | Path) -> StoreMeta:
    """``meta.json`` of the store at ``root``, checked (24 kHz, hop 480, 80 mels, 25 Hz tokens)."""
    path = Path(root) / META
    if not path.is_file():
        raise DataError(
            f"{root}: no {META}; a speech store is written by mm_data_audio.cosyvoice.store.write_store"
        )
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object")
    vocab = obj.get("speech_vocab")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise DataError(f"{path}: speech_vocab must be a positive integer, got {vocab!r}")
    meta = StoreMeta(vocab)
    for key, want in meta.to_json().items():
        if key != "speech_vocab" and obj.get(key, want) != want:
            raise DataError(
                f"{path}: {key} is {obj.get(key)!r}; CosyVoice3 stores hold {key} {want} (see the store "
                "layout)"
            )
    return meta


def _relative(root: Path, value: Any, key: str, where: str) -> Path:
    if not isinstance(value, str) or not value or Path(value).is_absolute() or ".." in Path(value).parts:
        raise DataError(f"{where}: {key} must be a path inside the store, relative to it; got {value!r}")
    return root / value


def read_index(root: str | Path) -> list[SpeechRecord]:
    """The records of the store at ``root`` (checked: JSON, fields, types, paths inside the store, unique
    ids; not the files). An empty index is a DataError."""
    root = Path(root)
    index = root / INDEX
    if not index.is_file():
        raise DataError(
            f"{root}: no {INDEX}; a speech store is written by mm_data_audio.cosyvoice.store.write_store"
        )
    records: list[SpeechRecord] = []
    for where, obj in iter_store_index(index, ("text", "audio", "speech_tokens", "mel")):
        if not isinstance(obj["text"], str):
            raise DataError(f"{where}: text must be a string, got {obj['text']!r}")
        speaker = obj.get("speaker")
        records.append(
            SpeechRecord(
                where=where,
                id=obj["id"],
                text=obj["text"],
                audio=_relative(root, obj["audio"], "audio", where),
                speech_tokens=_relative(root, obj["speech_tokens"], "speech_tokens", where),
                mel=_relative(root, obj["mel"], "mel", where),
                speaker=None if speaker is None else _relative(root, speaker, "speaker", where),
            )
        )
    if not records:
        raise DataError(f"{index}: no records")
    return records


def _load_npy(path: Path, what: str, where: str) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{where}: the {what} file {path} does not exist")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: cannot read the {what} file {path}: {exc}") from None


def token_count(record: SpeechRecord) -> int:
    """How many speech tokens the record has (the ``.npy`` header only)."""
    tokens = _load_npy(record.speech_tokens, "speech tokens", record.where)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise DataError(
            f"{record.where}: {record.speech_tokens} holds an array of shape {list(tokens.shape)}; expected "
            "[S] speech tokens, S >= 1"
        )
    return int(tokens.shape[0])


def load_tokens(record: SpeechRecord, speech_vocab: int) -> torch.Tensor:
    """The record's speech tokens as int64 ``[S]``, each in ``[0, speech_vocab)``."""
    token_count(record)
    tokens = _load_npy(record.speech_tokens, "speech tokens", record.where)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"{record.where}: {record.speech_tokens} holds {tokens.dtype} values; expected integers"
        )
    out = torch.from_numpy(np.array(tokens, dtype=np.int64))
    low, high = int(out.min()), int(out.max())
    if low < 0 or high >= speech_vocab:
        raise DataError(
            f"{record.where}: {record.speech_tokens} holds tokens in [{low}, {high}]; the store's "
            f"speech_vocab is {speech_vocab} (tokens must be in [0, {speech_vocab}))"
        )
    return out


def check_mel(record: SpeechRecord, tokens: int) -> np.ndarray:
    """The record's log-mel, memory-mapped, after checking its shape is ``[2 × tokens, 80]`` (the header
    only)."""
    mel = _load_npy(record.mel, "mel", record.where)
    if mel.ndim != 2 or mel.shape[1] != N_MELS or mel.shape[0] != 2 * tokens:
        raise DataError(
            f"{record.where}: {record.mel} holds an array of shape {list(mel.shape)}; expected "
            f"[{2 * tokens}, {N_MELS}] (two 50 Hz frames per speech token, {tokens} tokens)"
        )
    return mel


def load_mel(record: SpeechRecord, tokens: int) -> torch.Tensor:
    """The record's log-mel as float32 ``[T, 80]`` with ``T = 2 × tokens``, finite."""
    mel = check_mel(record, tokens)
    out = torch.from_numpy(np.array(mel, dtype=np.float32))
    if not torch.isfinite(out).all():
        raise DataError(f"{record.where}: {record.mel} holds NaN or inf")
    return out


def load_speaker(record: SpeechRecord) -> torch.Tensor:
    """The record's 192-d speaker embedding, or zeros when it has none."""
    if record.speaker is None:
        return torch.zeros(SPEAKER_DIM)
    spk = _load_npy(record.speaker, "speaker embedding", record.where)
    if spk.shape != (SPEAKER_DIM,):
        raise DataError(
            f"{record.where}: {record.speaker} holds an array of shape {list(spk.shape)}; expected "
            f"[{SPEAKER_DIM}]"
        )
    out = torch.from_numpy(np.array(spk, dtype=np.float32))
    if not torch.isfinite(out).all():
        raise DataError(f"{record.where}: {record.speaker} holds NaN or inf")
    return out


def load_wave(record: SpeechRecord, tokens: int | None = None) -> torch.Tensor:
    """The record's wave as float32 ``[L]`` at 24 kHz; with ``tokens``, ``L`` must be ``960 × tokens``."""
    if not record.audio.is_file():
        raise DataError(f"{record.where}: the audio file {record.audio} does not exist")
    try:
        wave = read_wav(record.audio, SAMPLE_RATE)
    except ValueError as exc:
        raise DataError(f"{record.where}: {exc}") from None
    if tokens is not None and len(wave) != TOKEN_SAMPLES * tokens:
        raise DataError(
            f"{record.where}: {record.audio} has {len(wave)} samples at {SAMPLE_RATE} Hz; expected "
            f"{TOKEN_SAMPLES * tokens} ({TOKEN_SAMPLES} per speech token, {tokens} tokens)"
        )
    return torch.from_numpy(wave)


# ------------------------------------------------------------------------------------------------ writing
def write_store(root: str | Path, utterances: Iterable[Utterance], speech_vocab: int) -> Path:
    """Write a speech store at ``root`` (a new or empty folder) from ``utterances`` and return it.

    Each wave is resampled to 24 kHz and fitted (zero-padded or cut) to ``960 × len(speech_tokens)``
    samples; its log-mel is computed with :func:`~mm_data_audio.cosyvoice.audio.log_mel`. Raises ValueError
    naming the utterance for a bad id (or a repeated one), tokens out of ``[0, speech_vocab)``, a wave more
    than two tokens longer or shorter than its tokens, or a speaker embedding that is not ``[192]``."""
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"write_store: {root} exists and is not empty; choose a new folder")
    for sub in ("wavs", "tokens", "mels", "spk"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    lines, seen = [], set()
    for n, utt in enumerate(utterances):
        what = f"write_store: utterance {n} ({utt.id!r})"
        if not isinstance(utt.id, str) or not _ID.match(utt.id):
            raise ValueError(f"{what}: the id must be letters, digits, '.', '_' or '-' (it names the files)")
        if utt.id in seen:
            raise ValueError(f"{what}: the id is used twice")
        seen.add(utt.id)
        tokens = np.asarray(utt.speech_tokens)
        if tokens.ndim != 1 or len(tokens) == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{what}: speech_tokens must be a non-empty 1-D integer array")
        if int(tokens.min()) < 0 or int(tokens.max()) >= speech_vocab:
            raise ValueError(f"{what}: speech tokens must be in [0, {speech_vocab})")
        wave = resample(np.asarray(utt.wave, dtype=np.float32).reshape(-1), utt.sample_rate, SAMPLE_RATE)
        samples = TOKEN_SAMPLES * len(tokens)
        if abs(len(wave) - samples) > LENGTH_SLACK_TOKENS * TOKEN_SAMPLES:
            raise ValueError(
                f"{what}: {len(wave)} samples at {SAMPLE_RATE} Hz but {len(tokens)} speech tokens "
                f"({samples} samples at 25 Hz); the tokens do not belong to this wave"
            )
        wave = fit_length(wave, samples)
        record: dict[str, Any] = {
            "id": utt.id,
            "text": utt.text,
            "audio": f"wavs/{utt.id}.wav",
            "speech_tokens": f"tokens/{utt.id}.npy",
            "mel": f"mels/{utt.id}.npy",
        }
        write_wav(root / record["audio"], wave)
        # the mel of the wave as stored (PCM16), the one the dataset reads back
        mel = log_mel(torch.from_numpy(read_wav(root / record["audio"]))).numpy()
        np.save(root / record["speech_tokens"], tokens.astype(np.int64))
        np.save(root / record["mel"], mel.astype(np.float32))
        if utt.speaker is not None:
            spk = np.asarray(utt.speaker, dtype=np.float32)
            if spk.shape != (SPEAKER_DIM,):
                raise ValueError(f"{what}: the speaker embedding has shape {list(spk.shape)}; expected [192]")
            record["speaker"] = f"spk/{utt.id}.npy"
            np.save(root / record["speaker"], spk)
        lines.append(json.dumps(record, ensure_ascii=False))
    if not lines:
        raise ValueError("write_store: no utterances")
    (root / META).write_text(json.dumps(StoreMeta(speech_vocab).to_json(), indent=2) + "\n", encoding="utf-8")
    (root / INDEX).write_text(
        "\n".join(lines) + "\n", encoding="utf-8"
    )  # last: a store with an index is whole
    return root
