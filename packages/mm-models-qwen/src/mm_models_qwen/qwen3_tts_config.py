"""The configuration of ``qwen3_tts``, read from the official Qwen3-TTS ``config.json`` layout.

The official file has three levels: the top (``model_type: qwen3_tts``, the text-side special ids),
``talker_config`` (the 28-layer talker, the codec vocabulary and its control ids) and, inside it,
``code_predictor_config`` (the 5-layer code predictor). Only the keys that shape the network are read here
(:class:`DecoderConfig` per stack, the text embedding, the number of codebooks); every other key (control
ids, languages, speakers, ``speaker_encoder_config``) is kept as it is, so an export writes the file back
unchanged. The data side (mm-data-audio's ``tts_codes``) reads the special ids from the same file.

The defaults are the published 1.7B values, not the upstream class defaults (which differ: 20 layers,
special ids from 4196): a folder's ``config.json`` always wins, and ``model.config_overrides`` edits it with
the same nesting (``{talker_config: {num_hidden_layers: 2, code_predictor_config: {...}}}``). The training
setting ``code_predictor_loss_weight`` (default 0.3, the official value) also goes in
``model.config_overrides``; it never reaches ``config.json``.

Both stacks use RoPE on 1-D positions: the talker's ``rope_scaling`` names an interleaved multimodal RoPE,
but Qwen3-TTS always feeds it three identical position rows, which is exactly plain RoPE; any other RoPE type
is refused rather than silently changed.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.models.qwen3 import Qwen3Config

from mm_core.errors import ConfigError

OVERRIDES = "model.config_overrides"
MODEL_TYPE = "qwen3_tts"
#: ``model.config_overrides`` key of the code predictor's loss weight (a training setting)
LOSS_WEIGHT_KEY = "code_predictor_loss_weight"
DEFAULT_LOSS_WEIGHT = 0.3

#: the shape keys of one decoder stack
DECODER_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
DECODER_KEYS = (
    *DECODER_INTS,
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "initializer_range",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
    "attention_dropout",
)
TALKER_INTS = ("text_vocab_size", "text_hidden_size", "num_code_groups")
#: keys of the top level and of talker_config mm knows besides the shape keys (accepted in overrides
#: even when the folder's file lacks them)
TOP_KEYS = (
    "tokenizer_type",
    "tts_model_size",
    "tts_model_type",
    "im_start_token_id",
    "im_end_token_id",
    "tts_pad_token_id",
    "tts_bos_token_id",
    "tts_eos_token_id",
    "assistant_token_id",
    "sample_rate",
    "speaker_encoder_config",
)
TALKER_KEYS = (
    "codec_pad_id",
    "codec_bos_id",
    "codec_eos_token_id",
    "codec_think_id",
    "codec_nothink_id",
    "codec_think_bos_id",
    "codec_think_eos_id",
    "codec_language_id",
    "spk_id",
    "spk_is_dialect",
    "position_id_per_seconds",
)

#: the published Qwen3-TTS-12Hz-1.7B talker
TALKER_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 3072,
    "max_position_embeddings": 32768,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "initializer_range": 0.02,
    "text_vocab_size": 151936,
    "text_hidden_size": 2048,
    "num_code_groups": 16,
}
#: the published code predictor (the same for 0.6B and 1.7B)
CODE_PREDICTOR_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 5,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 2048,
    "max_position_embeddings": 65536,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "initializer_range": 0.02,
}


@dataclass(frozen=True)
class DecoderConfig:
    """One dense Qwen3 decoder stack (the talker's or the code predictor's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    initializer_range: float

    def qwen3(self, attn_implementation: str) -> Qwen3Config:
        """The transformers ``Qwen3Config`` its layers, norm and rotary embedding are built from."""
        config = Qwen3Config(
            vocab_size=1,  # the stacks have their own embeddings; Qwen3Config's is never built
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=self.attention_bias,
            attention_dropout=0.0,
            use_sliding_window=False,
            initializer_range=self.initializer_range,
        )
        config._attn_implementation = attn_implementation
        return config


@dataclass(frozen=True)
class Qwen3TTSConfig:
    """The talker, the code predictor and the number of codebooks per frame; ``raw`` is the whole
    ``config.json`` (overrides applied), written back by :meth:`to_dict`."""

    talker: DecoderConfig
    code_predictor: DecoderConfig
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    raw: Mapping[str, Any]

    @property
    def has_projection(self) -> bool:
        """Whether ``small_to_mtp_projection`` is a Linear (talker and code predictor widths differ, 1.7B)."""
        return self.talker.hidden_size != self.code_predictor.hidden_size

    def to_dict(self) -> dict[str, Any]:
        """``config.json``: the file it was read from with the values the model was built with."""
        data = copy.deepcopy(dict(self.raw))
        data["model_type"] = MODEL_TYPE
        talker = dict(data.get("talker_config") or {})
        predictor = dict(talker.get("code_predictor_config") or {})
        for target, stack in ((talker, self.talker), (predictor, self.code_predictor)):
            for key in DecoderConfig.__dataclass_fields__:
                target[key] = getattr(stack, key)
            target.pop("rope_parameters", None)  # written as rope_theta (+ the file's rope_scaling)
        talker.update(
            text_vocab_size=self.text_vocab_size,
            text_hidden_size=self.text_hidden_size,
            num_code_groups=self.num_code_groups,
        )
        predictor["num_code_groups"] = self.num_code_groups
        talker["code_predictor_config"] = predictor
        data["talker_config"] = talker
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Qwen3TTSConfig:
        """Read the official layout (``where`` names the file or key in errors)."""
        model_type = data.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ConfigError(
                f"{where}: model_type is {model_type!r}, not {MODEL_TYPE!r} (the speech tokenizer's folder, "
                "speech_tokenizer/, is not the TTS model: point at the folder above it)"
            )
        talker_raw = _section(data, "talker_config", where)
        predictor_raw = _section(talker_raw, "code_predictor_config", f"{where}.talker_config")
        talker = _decoder(talker_raw, TALKER_DEFAULTS, f"{where}.talker_config")
        predictor = _decoder(
            predictor_raw, CODE_PREDICTOR_DEFAULTS, f"{where}.talker_config.code_predictor_config"
        )
        sizes = {k: _int(talker_raw, k, TALKER_DEFAULTS[k], f"{where}.talker_config") for k in TALKER_INTS}
        groups = sizes["num_code_groups"]
        own = predictor_raw.get("num_code_groups", groups)
        if own != groups:
            raise ConfigError(
                f"{where}.talker_config.code_predictor_config.num_code_groups: {own!r} differs from "
                f"talker_config.num_code_groups {groups}"
            )
        if groups < 2:
            raise ConfigError(
                f"{where}.talker_config.num_code_groups: {groups}; at least 2 codebooks per frame"
            )
        return cls(
            talker=talker,
            code_predictor=predictor,
            text_vocab_size=sizes["text_vocab_size"],
            text_hidden_size=sizes["text_hidden_size"],
            num_code_groups=groups,
            raw=copy.deepcopy(dict(data)),
        )


def _section(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}.{key}: got {value!r}; expected a mapping")
    return dict(value)


def _int(data: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}.{key}: got {value!r}; expected a positive integer")
    return value


def _number(data: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = data.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{where}.{key}: got {value!r}; expected a non-negative number")
    return float(value)


def _rope_theta(data: Mapping[str, Any], default: float, where: str) -> float:
    """``rope_theta`` (transformers 4 layout, the official files) or ``rope_parameters.rope_theta``
    (transformers 5); refuses any RoPE but the default one (see the module docstring)."""
    params = data.get("rope_parameters")
    theta = data.get("rope_theta")
    if isinstance(params, Mapping) and theta is None:
        theta = params.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = data.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{where}.{key}: got {rope!r}; expected a mapping or null")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConfigError(
                f"{where}.{key}.rope_type: {kind!r}; Qwen3-TTS uses the default RoPE (its multimodal "
                "sections see identical position rows), and mm implements only that"
            )
    return _number({"rope_theta": theta if theta is not None else default}, "rope_theta", default, where)


def _decoder(data: Mapping[str, Any], defaults: Mapping[str, Any], where: str) -> DecoderConfig:
    ints = {k: _int(data, k, defaults[k], where) for k in DECODER_INTS}
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ConfigError(
            f"{where}.num_key_value_heads: {ints['num_key_value_heads']} does not divide "
            f"num_attention_heads {ints['num_attention_heads']}"
        )
    if data.get("use_sliding_window"):
        raise ConfigError(f"{where}.use_sliding_window: true; Qwen3-TTS stacks use full attention only")
    layer_types = data.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{where}.layer_types: {layer_types!r}; only full_attention layers are supported")
    act = data.get("hidden_act", defaults["hidden_act"])
    if not isinstance(act, str):
        raise ConfigError(f"{where}.hidden_act: got {act!r}; expected an activation name such as 'silu'")
    bias = data.get("attention_bias", defaults["attention_bias"])
    if not isinstance(bias, bool):
        raise ConfigError(f"{where}.attention_bias: got {bias!r}; expected true or false")
    return DecoderConfig(
        **ints,
        hidden_act=act,
        rms_norm_eps=_number(data, "rms_norm_eps", defaults["rms_norm_eps"], where),
        rope_theta=_rope_theta(data, defaults["rope_theta"], where),
        attention_bias=bias,
        initializer_range=_number(data, "initializer_range", defaults["initializer_range"], where),
    )


def _merge(data: dict[str, Any], overrides: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """Apply ``overrides`` to ``data`` in place; a key neither in ``known`` nor in ``data`` is refused."""
    for key, value in overrides.items():
        if key not in known and key not in data:
            accepted = ", ".join(sorted({*known, *data}))
            raise ConfigError(f"{where}.{key}: unknown key; accepted keys: {accepted}")
        data[key] = value


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """``config.json`` with ``model.config_overrides`` applied (nested as the file is), and the code
    predictor's loss weight taken out of them."""
    data = copy.deepcopy(data)
    top = dict(overrides)
    weight = _number(top, LOSS_WEIGHT_KEY, DEFAULT_LOSS_WEIGHT, OVERRIDES)
    top.pop(LOSS_WEIGHT_KEY, None)
    talker_over = top.pop("talker_config", None) or {}
    if not isinstance(talker_over, Mapping):
        raise ConfigError(f"{OVERRIDES}.talker_config: got {talker_over!r}; expected a mapping")
    _merge(data, top, (*TOP_KEYS, "model_type", "talker_config"), OVERRIDES)
    talker = _section(data, "talker_config", OVERRIDES)
    predictor_over = dict(talker_over).pop("code_predictor_config", None) or {}
    if not isinstance(predictor_over, Mapping):
        raise ConfigError(f"{OVERRIDES}.talker_config.code_predictor_config: expected a mapping")
    rest = {k: v for k, v in talker_over.items() if k != "code_predictor_config"}
    _merge(talker, rest, (*DECODER_KEYS, *TALKER_INTS, *TALKER_KEYS), f"{OVERRIDES}.talker_config")
    predictor = _section(talker, "code_predictor_config", OVERRIDES)
    _merge(
        predictor,
        predictor_over,
        (*DECODER_KEYS, "num_code_groups"),
        f"{OVERRIDES}.talker_config.code_predictor_config",
    )
    talker["code_predictor_config"] = predictor
    data["talker_config"] = talker
    return data, weight


def read_config_file(folder: str | Path) -> dict[str, Any]:
    """The JSON object of ``folder``/config.json; a ConfigError naming ``model.model_name_or_path``."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.model_name_or_path: {str(folder)!r} is not a local Qwen3-TTS folder with a config.json "
            "(mm never downloads; point it at a folder on disk)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"model.model_name_or_path: {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.model_name_or_path: {path}: expected a JSON object")
    return data
