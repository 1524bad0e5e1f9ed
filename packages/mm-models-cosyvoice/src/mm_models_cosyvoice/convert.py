"""Converting an official CosyVoice3 folder (``llm.pt``, ``flow.pt``, ``hift.pt``) once into folders mm
also loads on the meta device (``config.json`` + ``model.safetensors`` under the official names).

Separate from :mod:`mm_models_cosyvoice.weights`, which the model classes import: this module imports them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_core.errors import ConfigError


def convert_official(model_id: str, src: str | Path, dst: str | Path, **config_overrides: Any) -> Path:
    """Write the official weights of stage ``model_id`` (``cosyvoice3_lm``: ``src/llm.pt`` with
    ``src/CosyVoice-BlankEN/config.json``; ``cosyvoice3_flow``: ``src/flow.pt``; ``cosyvoice3_hift``:
    ``src/hift.pt``) as a folder ``dst`` that
    mm loads on the meta device too (``config.json`` + ``model.safetensors``)."""
    from mm_core.models import ModelArguments

    from .flow import CosyVoice3FlowForTraining
    from .hift import HiFTGenerator
    from .lm import CosyVoice3LMForTraining

    classes: dict[str, Any] = {
        "cosyvoice3_lm": CosyVoice3LMForTraining,
        "cosyvoice3_flow": CosyVoice3FlowForTraining,
        "cosyvoice3_hift": HiFTGenerator,
    }
    if model_id not in classes:
        raise ConfigError(f"convert_official: model_id {model_id!r}; accepted: {', '.join(classes)}")
    args = ModelArguments(model_id=model_id, model_name_or_path=str(src), config_overrides=config_overrides)
    model = classes[model_id].from_pretrained(args)
    model.save_pretrained(Path(dst))
    return Path(dst)
