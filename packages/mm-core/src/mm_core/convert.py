"""Weights between Hugging Face safetensors folders and DCP checkpoints (``mm convert``)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from transformers import PreTrainedModel

from mm_core.checkpoint import CONFIG_FILE, resolve_load_path
from mm_core.checkpoint.dcp_io import check_shapes, tied_aliases
from mm_core.checkpoint.hf_reader import ConvertingHFReader
from mm_core.checkpoint.layout import is_checkpoint
from mm_core.checkpoint.reader import load_dcp, read_metadata
from mm_core.config import validate_config
from mm_core.config.schema import MMConfig
from mm_core.data.plan import registered_data_plan
from mm_core.errors import CheckpointError, ConfigError, PluginError
from mm_core.lora import is_adapter_key
from mm_core.models.hub import ModelHub, has_weights
from mm_core.models.special_tokens import resize_embeddings, vocabulary_size
from mm_core.registry import model_register

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
)
log = logging.getLogger("mm")


def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Load a Hugging Face safetensors folder into a (possibly sharded) model; each rank reads only the
    slices it owns, under the model's weight names (transformers' renamings and fused weights applied: see
    :mod:`mm_core.checkpoint.hf_reader`). Tensors the folder lacks (e.g. a tied ``lm_head``) keep their
    current values."""
    state = get_model_state_dict(model)
    dcp.load(
        state,
        storage_reader=ConvertingHFReader(path, model),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    set_model_state_dict(model, state)


def save_hf_weights(model: nn.Module, dst: Path, max_shard_size: str | int = "5GB") -> bool:
    """Write ``model``'s weights into the folder ``dst`` as ``mm convert dcp-to-hf`` writes them: through its
    ``save_pretrained`` (a transformers or diffusers model: its own layout, names and config) when it has one,
    else as one ``model.safetensors`` under the model's own parameter names (a custom BaseModel). Returns
    whether ``save_pretrained`` wrote the folder."""
    dst.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if not callable(save_pretrained):
        from safetensors.torch import save_model

        save_model(model, str(dst / "model.safetensors"))
        return False
    save_pretrained(dst, max_shard_size=max_shard_size)
    return True


def hf_to_dcp(src: str | Path, dst: str | Path) -> Path:
    """Write the tensors of a Hugging Face folder as a weights-only DCP checkpoint (keys ``model.<name>``),
    usable as ``training.load`` with ``training.init_model_with_meta_device: true``."""
    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"mm convert hf-to-dcp: {src} holds no *.safetensors files")
    if dst.exists():
        raise CheckpointError(f"mm convert hf-to-dcp: {dst} already exists; choose a new folder")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a dict
                state[key] = st.get_tensor(key)
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    dcp.save({"model": state}, checkpoint_id=str(partial), no_dist=True)
    if (src / "config.json").is_file():
        shutil.copy2(src / "config.json", partial / "hf_config.json")
    os.replace(partial, dst)
    return dst


def _hf_base_class_name(model: nn.Module) -> str:
    """The transformers class a registered model subclasses (what plain transformers should load)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__


def _import_user_plugins(modules: list[str]) -> None:
    """Import the modules the user named with ``--plugin`` (never those named inside the checkpoint)."""
    for mod in modules:
        if "/" in mod or "\\" in mod or mod.endswith(".py"):
            raise ConfigError(
                f"mm convert --plugin: {mod!r} looks like a file path; give a dotted module name, e.g. "
                "my_pkg.models (or install the plugin so that it registers through entry points)"
            )
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            raise PluginError(
                f"mm convert --plugin: cannot import {mod!r} ({exc}); is its package installed?"
            ) from exc


def _check_model_code(cfg: MMConfig, cfg_file: Path, trust_remote_code: bool) -> None:
    """The model class must come from an installed plugin or a ``--plugin`` module: a checkpoint's saved
    config names modules (``training.plugin``) and remote code (``model.trust_remote_code``), and mm never
    runs code because a checkpoint asks for it."""
    try:
        model_register.get(cfg.model.model_id)
    except ConfigError as exc:
        listed = cfg.training.plugin
        hint = (
            f"; the run imported training.plugin {listed} ({cfg_file}), which mm convert does not import "
            "from a checkpoint: pass --plugin MODULE for a module you trust"
            if listed
            else ""
        )
        raise ConfigError(f"mm convert dcp-to-hf: {exc}{hint}") from None
    if cfg.model.trust_remote_code and not trust_remote_code:
        raise CheckpointError(
            f"mm convert dcp-to-hf: the run used model.trust_remote_code: true ({cfg_file}), so building its "
            f"model runs Python code from {cfg.model.model_name_or_path!r}; pass --trust-remote-code if you "
            "trust that folder"
        )


def nonfinite_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """``(name, non-finite values, values)`` of each floating-point tensor holding NaN or inf."""
    bad = []
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad.append((name, n, t.numel()))
    return bad


def _check_finite(model: nn.Module, path: Path) -> None:
    bad = nonfinite_tensors(model.state_dict())
    if bad:
        shown = ", ".join(f"{name} ({n} of {total})" for name, n, total in bad[:3])
        more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
        raise CheckpointError(
            f"mm convert dcp-to-hf: {path} holds non-finite weights (NaN or inf): {shown}{more}; the run "
            "diverged before this save: export an earlier checkpoint, or pass --allow-nonfinite to export "
            "these weights anyway"
        )


def dcp_to_hf(
    ckpt: str | Path,
    dst: str | Path,
    *,
    max_shard_size: str | int = "5GB",
    plugins: list[str] | tuple[str, ...] = (),
    trust_remote_code: bool = False,
    allow_nonfinite: bool = False,
) -> Path:
    """Export the model weights of an mm checkpoint as a Hugging Face folder (sharded safetensors with an
    index when large), plus the tokenizer files the run used.

    The checkpoint is data: its metadata is read with a restricted unpickler, and no module it names is
    imported (models come from installed entry points or the ``plugins`` the caller names). Weights that
    hold NaN or inf are refused unless ``allow_nonfinite``."""
    path = Path(ckpt)
    if not is_checkpoint(path):
        resolved = resolve_load_path(str(path), None)
        if resolved is None:
            raise CheckpointError(f"mm convert dcp-to-hf: no checkpoint under {path}")
        path = resolved
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(
            f"mm convert dcp-to-hf: {path} has no {CONFIG_FILE}; was it written by mm train?"
        )
    import yaml

    cfg = validate_config(yaml.safe_load(cfg_file.read_text(encoding="utf-8")), source=str(cfg_file))
    _import_user_plugins(list(plugins))
    _check_model_code(cfg, cfg_file, trust_remote_code)
    metadata = read_metadata(path, where="mm convert dcp-to-hf").state_dict_metadata
    stored = {k[len("model.") :] for k in metadata if k.startswith("model.")}
    adapters_only = bool(stored) and all(is_adapter_key(k) for k in stored)
    if adapters_only:
        # the base weights are not in the checkpoint: read them from the folder the run started from
        base = cfg.model.model_name_or_path
        if not (base and has_weights(base)):
            raise CheckpointError(
                f"mm convert dcp-to-hf: {path} holds LoRA adapters only and its base model "
                f"(model.model_name_or_path: {base!r}) has no *.safetensors weights here"
            )
        model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": False}))
        resize_embeddings(model, vocabulary_size(cfg), mean_init=True)
        if cfg.training.lora.enable:
            from mm_core.lora import apply_lora

            apply_lora(model, cfg.training.lora)
    else:
        model = empty_export_model(cfg, metadata)
    expected = model.state_dict()
    aliases = {n for names in tied_aliases(model) for n in names[1:]}
    missing = sorted(k for k in expected if k not in stored and k not in aliases)
    if adapters_only:
        missing = [k for k in missing if is_adapter_key(k)]
    if missing:
        raise CheckpointError(
            f"mm convert dcp-to-hf: {path} lacks {len(missing)} model tensors ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}); the export would contain untrained values"
        )
    state = {"model": {k: v for k, v in expected.items() if k in stored}}
    check_shapes(path, metadata, {f"model.{k}": v for k, v in state["model"].items()}, "mm convert dcp-to-hf")
    load_dcp(state, path, allow_partial=False, no_dist=True, where="mm convert dcp-to-hf")
    model.load_state_dict(state["model"], strict=False)
    if cfg.training.lora.enable:
        from mm_core.lora import merge_lora

        merge_lora(model)  # adapters folded into the base weights: a plain transformers model again
    if not allow_nonfinite:
        _check_finite(model, path)
    return write_hf_folder(model, cfg, Path(dst), max_shard_size)


def _stored_vocabulary(model: nn.Module, metadata: Mapping[str, Any]) -> int | None:
    """Rows of the input embedding as a checkpoint stores it (``metadata``: its DCP metadata by key)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    name = next((n for n, m in model.named_modules() if m is embedding), None)
    entry = metadata.get(f"model.{name}.weight") if name is not None else None
    size = getattr(entry, "size", None)
    return int(size[0]) if size else None


def empty_export_model(cfg: MMConfig, metadata: Mapping[str, Any] | None = None) -> nn.Module:
    """The run's main model on the CPU, to be filled with its trained weights: built from its config on the
    meta device and allocated, the vocabulary resized for ``model.special_tokens`` (to the rows the checkpoint
    of DCP ``metadata`` stores, else to the run's tokenizer), LoRA adapters when the run had them,
    non-persistent buffers (e.g. rotary frequencies) initialised."""
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=True)
    if cfg.model.special_tokens:
        stored = _stored_vocabulary(model, metadata) if metadata is not None else None
        resize_embeddings(model, stored or vocabulary_size(cfg), mean_init=False)
    model.to_empty(device="cpu")
    if cfg.training.lora.enable:
        from mm_core.lora import apply_lora

        apply_lora(model, cfg.training.lora)
    with torch.no_grad():
        # weights are overwritten. PreTrainedModel and BaseModel (the only kinds ModelHub builds) both
        # define init_weights
        model.init_weights()  # type: ignore[operator]
    return model


def write_hf_folder(model: nn.Module, cfg: MMConfig, dst: Path, max_shard_size: str | int = "5GB") -> Path:
    """Write a filled export model (:func:`save_hf_weights`) into ``dst``: a transformers model's
    ``config.json`` names the transformers class it subclasses, and the tokenizer / processor files of the run
    (:func:`_tokenizer_folder`) are copied beside the weights."""
    if not save_hf_weights(model, dst, max_shard_size):
        return dst
    config_path = dst / "config.json"
    if config_path.is_file() and isinstance(model, PreTrainedModel):
        conf = json.loads(config_path.read_text(encoding="utf-8"))
        conf["architectures"] = [_hf_base_class_name(model)]
        config_path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tok = _tokenizer_folder(cfg)
    if tok is not None:
        for name in _TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copy2(tok / name, dst / name)
    return dst


def _tokenizer_folder(cfg: MMConfig) -> Path | None:
    """The tokenizer / processor folder of the run's dataset (the ``preprocess_parameters`` key its
    ``DataPlan.processor_key`` names), when it is a folder here. The dataset comes from an installed plugin or
    a ``--plugin`` module (never from the checkpoint's ``training.plugin``); without it there is none (a
    warning says the tokenizer files are not copied)."""
    try:
        key = registered_data_plan(cfg.data.dataset_param.dataset_type).processor_key
    except (ConfigError, PluginError) as exc:
        log.warning(f"mm convert dcp-to-hf: tokenizer files not copied ({exc})")
        return None
    value = cfg.data.dataset_param.preprocess_parameters.get(key) if key else None
    return Path(value) if isinstance(value, str) and value and Path(value).is_dir() else None
