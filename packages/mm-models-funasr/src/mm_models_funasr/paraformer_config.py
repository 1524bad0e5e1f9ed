"""The model folder of ``model_id: paraformer``: funasr's own ``config.yaml`` (plus mm's overrides), its
vocabulary size, its feature front end (scale and CMVN) and its weights.

A folder as funasr publishes one (``iic/speech_paraformer-large-asr_nat-zh-cn-16k-common-vocab8404-pytorch``)
works as it is: ``config.yaml``, ``model.pt`` (a state dict), ``am.mvn`` (Kaldi CMVN) and ``tokens.json``
(the vocabulary). mm's own exports add ``model.safetensors`` (preferred when both exist).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mm_core.errors import ConfigError

CONFIG_FILE = "config.yaml"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "model.pt"
TOKENS_FILE = "tokens.json"
#: funasr's ``WavFrontend`` multiplies waveforms by 2**15 before the filter bank; on log energies that is
#: this constant (the power spectrum scales by 2**30), except where Kaldi's floor (float32 eps) applies
LOG_INT16_SCALE = 2.0 * math.log(32768.0)


def read_config(folder: str | Path, overrides: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``folder/config.yaml`` with ``overrides`` merged in (dicts recursively); ConfigError naming ``key``."""
    import yaml

    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"{key}: {str(folder)!r} has no {CONFIG_FILE}; model_id paraformer reads funasr's model folder "
            f"({CONFIG_FILE} with model: Paraformer, encoder/decoder/predictor and their *_conf; weights in "
            f"{SAFETENSORS_FILE} or {TORCH_FILE})"
        )
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {path} must hold a mapping, got {type(config).__name__}")
    return merge(config, overrides)


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied: nested mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def vocab_size(config: Mapping[str, Any], folder: Path | None, key: str) -> int:
    """``vocab_size`` of the config, else the length of the folder's ``tokens.json`` (what funasr uses)."""
    value = config.get("vocab_size")
    if value is None and folder is not None and (folder / TOKENS_FILE).is_file():
        tokens = json.loads((folder / TOKENS_FILE).read_text(encoding="utf-8"))
        if isinstance(tokens, list):
            value = len(tokens)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(
            f"{key}: no vocabulary size; set vocab_size in {CONFIG_FILE} (or model.config_overrides), or put "
            f"funasr's {TOKENS_FILE} (the token list) in the model folder"
        )
    return value


def input_size(config: Mapping[str, Any]) -> int:
    """Values per feature row: ``input_size``, else the front end's ``n_mels × lfr_m``, else 560."""
    if config.get("input_size") is not None:
        return int(config["input_size"])
    frontend = config.get("frontend_conf") or {}
    return int(frontend.get("n_mels", 80)) * int(frontend.get("lfr_m", 7))


def read_cmvn(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The shift and scale of a Kaldi nnet1 text CMVN file (``am.mvn``): the bracketed vectors after the
    ``<AddShift>`` and ``<Rescale>`` components (features become ``(x + shift) * scale``)."""
    text = path.read_text(encoding="utf-8")
    vectors: dict[str, torch.Tensor] = {}
    for name in ("AddShift", "Rescale"):
        match = re.search(rf"<{name}>[^\[]*\[([^\]]*)\]", text)
        if match is None:
            raise ConfigError(f"{path}: no <{name}> vector; not a Kaldi CMVN file (am.mvn)")
        try:
            values = [float(v) for v in match.group(1).split()]
            vectors[name] = torch.tensor(values, dtype=torch.float32, device="cpu")
        except ValueError:
            raise ConfigError(f"{path}: the <{name}> vector holds a non-number") from None
    shift, scale = vectors["AddShift"], vectors["Rescale"]
    if shift.numel() != scale.numel():
        raise ConfigError(f"{path}: <AddShift> has {shift.numel()} values but <Rescale> {scale.numel()}")
    return shift, scale


@dataclass(frozen=True)
class Frontend:
    """What mm's features need to become the features funasr's front end gives this model.

    mm-data-audio's ``fun-asr-nano`` format computes exactly the filter banks and LFR stacking of funasr's
    ``WavFrontend`` (Kaldi fbank, hamming, LFR 7/6), from waveforms in [-1, 1] and without CMVN. funasr's
    ``WavFrontend`` scales waveforms to the int16 range first (``upsacle_samples``, default true: a constant
    :data:`LOG_INT16_SCALE` on every log energy) and applies the CMVN of ``frontend_conf.cmvn_file``."""

    log_offset: float
    cmvn: tuple[torch.Tensor, torch.Tensor] | None
    cmvn_file: Path | None

    @classmethod
    def of(cls, config: Mapping[str, Any], folder: Path | None, dim: int) -> Frontend:
        frontend = config.get("frontend")
        conf = config.get("frontend_conf") or {}
        if frontend is None:
            return cls(0.0, None, None)
        if frontend not in ("WavFrontend", "wav_frontend"):
            raise ConfigError(
                f"{CONFIG_FILE}: frontend {frontend!r}: mm's paraformer takes the features of funasr's "
                "WavFrontend (Kaldi fbank + LFR, what mm-data-audio's fun-asr-nano format computes); set "
                "frontend: WavFrontend or null"
            )
        offset = LOG_INT16_SCALE if conf.get("upsacle_samples", True) else 0.0
        name = conf.get("cmvn_file")
        if not name:
            return cls(offset, None, None)
        path = Path(name)
        if not path.is_absolute() and folder is not None:
            path = folder / path
        if not path.is_file() and folder is not None and (folder / path.name).is_file():
            path = folder / path.name  # published configs name the file where it was trained
        if not path.is_file():
            raise ConfigError(f"{CONFIG_FILE}: frontend_conf.cmvn_file {name!r}: no such file")
        shift, scale = read_cmvn(path)
        if shift.numel() != dim:
            raise ConfigError(f"{path}: {shift.numel()} CMVN values for {dim}-value features (input_size)")
        return cls(offset, (shift, scale), path)
