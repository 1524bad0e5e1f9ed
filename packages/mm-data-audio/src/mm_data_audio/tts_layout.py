"""The Qwen3-TTS training sequence: a text track and a codec track, one position each, summed by the model.

Positions of one sample, in order (P role tokens of ``<|im_start|>assistant\n``, N text tokens, F frames;
the official non-streaming layout), as *text track* / *codec track*:

- the P role tokens / nothing;
- 3 think slots: ``tts_pad`` / ``nothink, think_bos, think_eos``; with a language 4 slots:
  ``tts_pad`` / ``think, think_bos, <language id>, think_eos``;
- with a speaker, 1 slot: ``tts_pad`` / the speaker's codec row, or an x-vector (``speaker_slot``);
- ``tts_bos`` / ``codec_pad``, then the N text tokens / ``codec_pad``, then ``tts_eos`` / ``codec_pad``;
- ``tts_pad`` / ``codec_bos``;
- F frames: ``tts_pad`` / codebook 0 of the frame (the model adds the embeddings of codebooks 1..G-1);
  label: codebook 0 of the frame;
- ``tts_pad`` / ``codec_eos``; label: ``codec_eos``.

Labels are unshifted (the model trains the state at p on the label at p + 1). Every id comes from the model
folder's ``config.json`` (:class:`TTSSpecials`), never from defaults: the special ids differ between the
upstream class defaults and the released checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mm_core.errors import ConfigError

IGNORE_INDEX = -100
#: the text-side ids at the top level of config.json
TEXT_KEYS = {
    "im_start": "im_start_token_id",
    "im_end": "im_end_token_id",
    "tts_pad": "tts_pad_token_id",
    "tts_bos": "tts_bos_token_id",
    "tts_eos": "tts_eos_token_id",
}
#: the codec-side ids in talker_config
CODEC_KEYS = {
    "codec_pad": "codec_pad_id",
    "codec_bos": "codec_bos_id",
    "codec_eos": "codec_eos_token_id",
    "think": "codec_think_id",
    "nothink": "codec_nothink_id",
    "think_bos": "codec_think_bos_id",
    "think_eos": "codec_think_eos_id",
}


def _int(section: Mapping[str, Any], key: str, where: str) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}.{key}: got {value!r}; expected a non-negative integer id or size")
    return value


def _id_table(section: Mapping[str, Any], key: str, where: str) -> dict[str, int]:
    """A name -> codec id table (``codec_language_id``, ``spk_id``); a value may be ``n`` or ``[n]``."""
    table = section.get(key) or {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}.{key}: got {table!r}; expected a mapping of names to codec ids")
    out = {}
    for name, value in table.items():
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}.{key}.{name}: got {value!r}; expected a codec id (n or [n])")
        out[str(name).lower()] = value
    return out


@dataclass(frozen=True)
class TTSSpecials:
    """The special ids and sizes the layout needs, from the model's ``config.json``."""

    im_start: int
    im_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    languages: Mapping[str, int]
    speakers: Mapping[str, int]
    num_code_groups: int
    codebook_size: int
    codec_vocab_size: int
    text_vocab_size: int
    hidden_size: int

    @property
    def text_specials(self) -> frozenset[int]:
        return frozenset((self.im_start, self.im_end, self.tts_pad, self.tts_bos, self.tts_eos))

    @classmethod
    def read(cls, config: Mapping[str, Any], where: str) -> TTSSpecials:
        """From the official layout (``where``: the file, for errors)."""
        talker = config.get("talker_config")
        if not isinstance(talker, Mapping):
            raise ConfigError(f"{where}: no talker_config; is this a Qwen3-TTS model's config.json?")
        predictor = talker.get("code_predictor_config")
        if not isinstance(predictor, Mapping):
            raise ConfigError(f"{where}.talker_config: no code_predictor_config")
        tw, pw = f"{where}.talker_config", f"{where}.talker_config.code_predictor_config"
        ids = {name: _int(config, key, where) for name, key in TEXT_KEYS.items()}
        ids |= {name: _int(talker, key, tw) for name, key in CODEC_KEYS.items()}
        specials = cls(
            **ids,
            languages=_id_table(talker, "codec_language_id", tw),
            speakers=_id_table(talker, "spk_id", tw),
            num_code_groups=_int(talker, "num_code_groups", tw),
            codebook_size=_int(predictor, "vocab_size", pw),
            codec_vocab_size=_int(talker, "vocab_size", tw),
            text_vocab_size=_int(talker, "text_vocab_size", tw),
            hidden_size=_int(talker, "hidden_size", tw),
        )
        codec = [*(ids[k] for k in CODEC_KEYS), *specials.languages.values(), *specials.speakers.values()]
        if max(codec) >= specials.codec_vocab_size or specials.codebook_size > specials.codec_vocab_size:
            raise ConfigError(
                f"{tw}: a codec id or the codebook size exceeds vocab_size {specials.codec_vocab_size}"
            )
        if max(ids[k] for k in TEXT_KEYS) >= specials.text_vocab_size:
            raise ConfigError(f"{where}: a text special id exceeds talker_config.text_vocab_size")
        return specials


def sequence_length(prefix: int, text: int, frames: int, language: bool, speaker: bool) -> int:
    """Positions of a sample (the table of the module docstring)."""
    return prefix + (4 if language else 3) + int(speaker) + text + frames + 4


def build_tracks(
    prefix: Sequence[int],
    text: Sequence[int],
    codes: np.ndarray,
    specials: TTSSpecials,
    language: int | None = None,
    speaker: int | np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """The tracks of one sample: ``input_ids``, ``codec_ids``, ``codec_mask``, ``frame_mask``, ``labels``
    [S], ``codes`` [S, G]; with an x-vector ``speaker`` [H] also ``speaker_vector`` and ``speaker_slot``.
    ``language``/``speaker`` as codec ids (None: ``nothink`` / no speaker slot)."""
    sp = specials
    frames = int(codes.shape[0])
    think = (
        [sp.nothink, sp.think_bos, sp.think_eos]
        if language is None
        else [sp.think, sp.think_bos, language, sp.think_eos]
    )
    vector = speaker if isinstance(speaker, np.ndarray) else None
    slot = [] if speaker is None else [sp.codec_pad if vector is not None else int(speaker)]
    control = think + slot
    text_track = [*prefix, *([sp.tts_pad] * len(control)), sp.tts_bos, *text, sp.tts_eos]
    text_track += [sp.tts_pad] * (frames + 2)
    codec_track = [0] * len(prefix) + control + [sp.codec_pad] * (len(text) + 2) + [sp.codec_bos]
    first_frame = len(codec_track)
    codec_track += [int(c) for c in codes[:, 0]] + [sp.codec_eos]
    length = len(text_track)
    assert (
        length
        == len(codec_track)
        == sequence_length(len(prefix), len(text), frames, language is not None, speaker is not None)
    )
    codec_mask = torch.ones(length, dtype=torch.long)
    codec_mask[: len(prefix)] = 0
    frame_mask = torch.zeros(length, dtype=torch.long)
    frame_mask[first_frame : first_frame + frames] = 1
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    labels[first_frame : first_frame + frames] = torch.from_numpy(codes[:, 0].astype(np.int64))
    labels[first_frame + frames] = sp.codec_eos
    all_codes = torch.zeros(length, codes.shape[1], dtype=torch.long)
    all_codes[first_frame : first_frame + frames] = torch.from_numpy(codes.astype(np.int64))
    sample = {
        "input_ids": torch.tensor(text_track, dtype=torch.long),
        "codec_ids": torch.tensor(codec_track, dtype=torch.long),
        "codec_mask": codec_mask,
        "frame_mask": frame_mask,
        "labels": labels,
        "codes": all_codes,
    }
    if vector is not None:
        position = len(prefix) + len(think)
        codec_mask[position] = 0
        speaker_slot = torch.zeros(length, dtype=torch.long)
        speaker_slot[position] = 1
        sample["speaker_slot"] = speaker_slot
        sample["speaker_vector"] = torch.from_numpy(vector.astype(np.float32))
    return sample
