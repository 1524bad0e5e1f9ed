"""What every diffusers transformer wrapped by mm shares: reading ``model.model_name_or_path`` (a local
diffusers model folder) and ``model.config_overrides`` against the transformer's constructor, loading the
weights with a clear error for missing ones, the plan hooks that call the model's own token count and
context-parallel split, and an export whose ``config.json`` names the diffusers class.

``wan2_2`` (:mod:`mm_models_video.wan`) and ``ltx2`` (:mod:`mm_models_video.ltx2`) are subclasses of their
diffusers transformers; each adds its training forward and its Ulysses split, the rest is here.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mm_core.errors import ConfigError
from mm_core.models import ModelArguments

OVERRIDES = "model.config_overrides"


def init_defaults(cls: type) -> dict[str, Any]:
    """The config keys of a diffusers model class with their defaults (its constructor's signature)."""
    init: Any = getattr(cls, "__init__")  # noqa: B009  (mypy: __init__ of a class object, not an instance)
    params = inspect.signature(init).parameters
    return {name: p.default for name, p in params.items() if name != "self"}


def config_overrides(
    args: ModelArguments,
    base: type,
    training_keys: Iterable[str],
    tuple_keys: Iterable[str] = (),
) -> dict[str, Any]:
    """The transformer config keys of ``config_overrides`` (each must be a key of ``base``'s constructor;
    ``training_keys`` are the wrapper's own settings and are skipped)."""
    known = init_defaults(base)
    skip, tuples = tuple(training_keys), set(tuple_keys)
    out = {}
    for key, value in args.config_overrides.items():
        if key in skip:
            continue
        if key not in known:
            accepted = ", ".join(sorted(k for k in known if not k.startswith("_")) + list(skip))
            raise ConfigError(f"{OVERRIDES}.{key}: not a {base.__name__} config key; accepted: {accepted}")
        out[key] = tuple(value) if key in tuples and isinstance(value, list) else value
    return out


def model_folder(args: ModelArguments) -> Path | None:
    """``model.model_name_or_path`` as a local diffusers model folder (None when unset)."""
    if not args.model_name_or_path:
        return None
    path = Path(args.model_name_or_path)
    if not (path / "config.json").is_file():
        hint = (
            " (a pipeline folder: point at its transformer/ or transformer_2/)"
            if (path / "model_index.json").is_file()
            else ""
        )
        raise ConfigError(
            f"model.model_name_or_path: {str(path)!r} is not a local diffusers model folder with a "
            f"config.json{hint}; mm never downloads"
        )
    return path


def config_from(cls: Any, args: ModelArguments, overrides: Mapping[str, Any]) -> nn.Module:
    """``cls`` built from the folder's config (if any) plus ``overrides``, with random weights."""
    folder = model_folder(args)
    stored: Any = cls.load_config(str(folder)) if folder is not None else {}
    config = {k: v for k, v in dict(stored).items() if not k.startswith("_")}
    config.update(overrides)
    model: nn.Module = cls.from_config(config)
    return model


def load_folder(loader: Any, args: ModelArguments, base: type, overrides: Mapping[str, Any]) -> nn.Module:
    """diffusers' ``from_pretrained`` (``loader``: the subclass's inherited classmethod) of the local folder
    in float32; missing weights are a ConfigError."""
    folder = model_folder(args)
    if folder is None:
        raise ConfigError(
            "model.model_name_or_path: not set; point it at a diffusers model folder (e.g. a pipeline's "
            "transformer/), or set model.from_scratch: true"
        )
    model, info = loader(
        str(folder), torch_dtype=torch.float32, local_files_only=True, output_loading_info=True, **overrides
    )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"model.model_name_or_path: {str(folder)!r} lacks {len(missing)} weights of "
            f"{base.__name__} ({shown}); check the folder, or set model.from_scratch: true"
        )
    loaded: nn.Module = model
    return loaded


def name_diffusers_class(save_directory: str | Path, base: type) -> None:
    """Make the exported ``config.json`` name the diffusers class ``base`` (not mm's subclass), so any
    diffusers pipeline or ``AutoModel`` loads the folder."""
    path = Path(save_directory) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["_class_name"] = base.__name__
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def count_tokens(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """``ModelPlan.count_tokens``: the model's ``local_tokens(batch)``."""
    count: Any = model.local_tokens
    result: torch.Tensor = count(batch)
    return result


def context_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """``ModelPlan.context_parallel``: the model's ``use_context_parallel(mesh)``."""
    attach: Any = model.use_context_parallel
    attach(mesh)
