"""Build a model from the ``model`` block: Hugging Face ``PreTrainedModel``s and custom ``BaseModel``s."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from mm_core.config.schema import ModelConfig
from mm_core.errors import ConfigError, MMError
from mm_core.models.base import BaseModel
from mm_core.models.varlen import plain_attn_implementation, resolve_attn_implementation
from mm_core.registry import model_register

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def has_weights(path: str | Path) -> bool:
    """True when a local Hugging Face folder holds safetensors weights."""
    p = Path(path)
    return any((p / f).is_file() for f in _WEIGHT_FILES) or any(p.glob("*.safetensors"))


# Keys transformers derives from others at construction; an override of the source makes them stale.
_DERIVED = {"num_hidden_layers": ("layer_types",)}


def _merge_overrides(
    config: PretrainedConfig, data: dict[str, Any], overrides: dict[str, Any], prefix: str
) -> dict[str, Any]:
    """Apply overrides to a config's dict form (checking each key exists), dropping stale derived keys."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if not hasattr(config, key):
            raise ConfigError(f"{prefix}.{key}: {type(config).__name__} has no attribute {key!r}")
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            data[key] = _merge_overrides(
                current, dict(data.get(key) or current.to_dict()), value, f"{prefix}.{key}"
            )
            continue
        # an alias (e.g. Qwen3-MoE's num_experts -> num_local_experts) must land on the stored key
        data[getattr(config, "attribute_map", {}).get(key, key)] = value
        for derived in _DERIVED.get(key, ()):
            if derived not in overrides:
                data.pop(derived, None)
    return data


def _update_config(config: PretrainedConfig, overrides: dict[str, Any], prefix: str) -> PretrainedConfig:
    if not overrides:
        return config
    data = _merge_overrides(config, config.to_dict(), overrides, prefix)
    try:
        return type(config).from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix}: {type(config).__name__} rejects the overrides: {exc}") from None


def build_hf_config(model_cls: type[PreTrainedModel], args: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config from ``model_name_or_path`` (a local folder) or the class default, plus
    ``model.config_overrides``."""
    if args.model_name_or_path:
        path = Path(args.model_name_or_path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.model_name_or_path: {str(path)!r} is not a local Hugging Face folder with a "
                "config.json "
                "(mm never downloads; point it at a folder on disk)"
            )
        config = AutoConfig.from_pretrained(
            path, trust_remote_code=args.trust_remote_code, local_files_only=True
        )
        _check_model_type(model_cls, args, config)
    elif model_cls.config_class is not None:
        config = model_cls.config_class()
    else:
        raise ConfigError(
            f"model.model_name_or_path: {model_cls.__name__} has no config_class; point "
            "model.model_name_or_path at a local Hugging Face folder with a config.json"
        )
    config = _update_config(config, args.config_overrides, "model.config_overrides")
    config.use_cache = False
    return config


def _check_model_type(model_cls: type[PreTrainedModel], args: ModelConfig, config: PretrainedConfig) -> None:
    """A folder of another architecture (qwen3 weights under ``model_id: qwen3_moe``) is named before the
    model class reads a field its config lacks. A folder whose config holds the model's config as a
    sub-config (a whole Qwen3-Omni folder for the ``qwen3_omni_moe`` thinker) is accepted."""
    expected = model_cls.config_class
    if expected is None or isinstance(config, expected):
        return
    subs = getattr(config, "sub_configs", None) or {}
    if any(isinstance(getattr(config, key, None), expected) for key in subs):
        return
    wanted = str(getattr(expected, "model_type", "") or expected.__name__)
    found = str(getattr(config, "model_type", "") or type(config).__name__)
    ids = [
        name
        for name in model_register.names()
        if getattr(_registered_config_class(name), "model_type", None) == found
    ]
    hint = (
        f"model.model_id: {' or '.join(map(repr, ids))} builds it"
        if ids
        else "no registered model_id builds it"
    )
    raise ConfigError(
        f"model.model_id: {args.model_id!r} ({model_cls.__name__}) takes a {wanted!r} config, but "
        f"{args.model_name_or_path}/config.json has model_type {found!r} ({hint}); set model.model_id to "
        "match the folder, or point model.model_name_or_path at a folder of this model"
    )


def _registered_config_class(name: str) -> type | None:
    try:
        cls = model_register.get(name)
    except MMError:  # a plugin that fails to import is reported when it is used, not here
        return None
    return getattr(cls, "config_class", None)


def share_weight_conversions(cls: type) -> None:
    """Let a subclass of a transformers model (mm's ``*ForTraining`` classes, a plugin's own) load and save
    checkpoints under the weight names of the model it extends.

    transformers renames weights between a checkpoint's names and the module's (per class name or
    ``model_type``: e.g. Step 3.7's ``vision_model.conv1`` is ``model.vision_model.embeddings
    .patch_embedding``), but skips classes defined outside transformers. A subclass would then load an
    official checkpoint with weights missing and export names that transformers itself cannot load. This
    registers the transformers base class's own mapping under the subclass's name, or re-registers its
    ``model_type``'s mapping unchanged, through transformers' ``register_checkpoint_conversion_mapping``
    (which makes transformers apply it to classes outside transformers); idempotent."""
    from transformers import conversion_mapping

    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)) or not cls.is_custom_code():
        return
    if cls.__name__ in conversion_mapping.USER_REGISTERED_MAPPINGS:
        return
    ours = [c for c in cls.__mro__ if issubclass(c, PreTrainedModel)]
    base = next((c for c in ours if c.__module__.startswith("transformers.")), None)
    if base is None or base is PreTrainedModel:
        return
    # transformers' conversion_mapping functions are unannotated
    find = cast("Callable[[str], list[Any] | None]", conversion_mapping.get_checkpoint_conversion_mapping)
    mapping = find(base.__name__)
    if mapping:  # the base class has its own mapping: the subclass takes it under its name
        conversion_mapping.register_checkpoint_conversion_mapping(cls.__name__, mapping, overwrite=True)
        return
    model_type = str(getattr(getattr(base, "config_class", None), "model_type", None) or "")
    mapping = find(model_type) if model_type else None
    if mapping and model_type not in conversion_mapping.USER_REGISTERED_MAPPINGS:
        # the same mapping under the same model_type, registered as the user's: transformers then applies it
        # to classes outside transformers too, exactly as to the base class (nested models included)
        conversion_mapping.register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)


class ModelHub:
    """One place that turns the ``model`` block into an ``nn.Module``."""

    @staticmethod
    def model_class(args: ModelConfig) -> type:
        cls: type = model_register.get(args.model_id)
        share_weight_conversions(cls)
        return cls

    @staticmethod
    def build(args: ModelConfig, *, meta: bool = False) -> nn.Module:
        """Build the model. With ``meta`` the structure is created on the meta device (no memory, no init);
        otherwise weights are loaded from ``model_name_or_path`` or, with ``model.from_scratch``,
        initialised."""
        cls = ModelHub.model_class(args)
        device_ctx = torch.device("meta") if meta else contextlib.nullcontext()
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            config = build_hf_config(cls, args)
            attn = resolve_attn_implementation(args.attn_implementation, cls, config)
            wants_weights = not args.from_scratch
            if wants_weights and not (args.model_name_or_path and has_weights(args.model_name_or_path)):
                where = args.model_name_or_path or "(not set)"
                raise ConfigError(
                    f"model.model_name_or_path: {where!r} holds no *.safetensors weights; set "
                    "model.from_scratch: true to train from a random initialisation"
                )
            if meta or args.from_scratch:
                with device_ctx:
                    # PreTrainedModel._from_config is unannotated in transformers
                    model: PreTrainedModel = cls._from_config(  # type: ignore[no-untyped-call]
                        config, attn_implementation=attn, dtype=torch.float32
                    )
            else:
                # typed as returning the model; with output_loading_info it returns (model, info)
                loaded: Any = cls.from_pretrained(
                    args.model_name_or_path,
                    config=config,
                    attn_implementation=attn,
                    dtype=torch.float32,
                    local_files_only=True,
                    output_loading_info=True,
                )
                model, info = loaded
                missing = sorted(info.get("missing_keys") or ())
                if missing:
                    shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                    raise ConfigError(
                        f"model.model_name_or_path: {args.model_name_or_path!r} lacks {len(missing)} weights "
                        f"of {cls.__name__} ({shown}); they would train from a random initialisation. Check "
                        "that the folder holds this model (model.model_id) and all its shards, or set "
                        "model.from_scratch: true"
                    )
            return model
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            # mm's own models keep sdpa unless mm_varlen is asked for
            args = args.model_copy(
                update={"attn_implementation": plain_attn_implementation(args.attn_implementation)}
            )
            if meta or args.from_scratch:
                with device_ctx:
                    return cls._from_config(args)
            return cls.from_pretrained(args)
        raise ConfigError(
            f"model.model_id: {args.model_id!r} is registered to {cls!r}, which is neither a "
            "transformers PreTrainedModel subclass nor an mm_core.models.BaseModel subclass"
        )
