"""What mm reads from a model's configuration, found once by one rule.

The decoder's configuration is ``config.get_text_config()`` when the model's config has that method (every
transformers ``PretrainedConfig``: the text config of a model with towers, else the config itself), else the
model's ``config`` attribute as is (a custom model), else None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


def text_config_of(model: nn.Module) -> Any:
    """The decoder's configuration of ``model`` (module docstring), or None for a model without a config."""
    config: Any = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass(frozen=True)
class ModelFacts:
    """The model's own numbers, for the build plan, the memory estimate and the FLOPs count (0: unknown)."""

    class_name: str
    #: the decoder's configuration (:func:`text_config_of`)
    text_config: Any
    #: the sub-configurations other than the text config (vision, audio towers)
    towers: tuple[str, ...]
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    #: routed experts and how many each token goes through (0 for a dense model)
    num_experts: int
    experts_per_token: int
    #: the attention kinds of the decoder's layers other than full attention (e.g. sliding windows)
    other_layer_types: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        """Read the facts of ``model`` (built, on any device)."""
        text = text_config_of(model)
        config: Any = getattr(model, "config", None)
        towers = tuple(name for name in getattr(config, "sub_configs", {}) or {} if name != "text_config")
        heads = _int(text, "num_attention_heads")
        hidden = _int(text, "hidden_size")
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"]) - {"full_attention"}
        return cls(
            class_name=type(model).__name__,
            text_config=text,
            towers=towers,
            num_layers=_int(text, "num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=_int(text, "intermediate_size"),
            vocab_size=_int(text, "vocab_size"),
            num_heads=heads,
            num_kv_heads=_int(text, "num_key_value_heads") or heads,
            head_dim=_int(text, "head_dim") or (hidden // heads if heads else 0),
            num_experts=_int(text, "num_experts") or _int(text, "n_routed_experts"),
            experts_per_token=_int(text, "num_experts_per_tok"),
            other_layer_types=tuple(sorted(kinds)),
        )

    def describe(self) -> str:
        """One line for ``mm check``."""
        line = (
            f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads "
            f"({self.num_kv_heads} key/value) x {self.head_dim}, vocabulary {self.vocab_size}"
        )
        if self.num_experts:
            line += f", {self.num_experts} experts ({self.experts_per_token} per token)"
        if self.towers:
            line += f"; towers {', '.join(self.towers)}"
        return line
