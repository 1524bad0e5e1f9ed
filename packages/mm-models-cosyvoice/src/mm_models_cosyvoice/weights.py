"""Reading the weights of a CosyVoice3 stage from a local folder: this project's ``model.safetensors`` or the
official PyTorch file (``llm.pt`` / ``flow.pt``), with every name checked against the model.

The official files are plain state dicts under the module names this package keeps (``llm.model.model.
layers.0...``, ``decoder.estimator.transformer_blocks.0...``), saved with ``torch.save``; they are read with
``torch.load(weights_only=True)`` (tensors only, no code). A model built on the meta device
(``training.init_model_with_meta_device``) is filled by mm from safetensors files only, so an official file
is converted once with :func:`mm_models_cosyvoice.convert.convert_official` (or by building without the meta
device).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mm_core.errors import ConfigError

SAFETENSORS_FILE = "model.safetensors"
#: prefixes a training wrapper may put before the official names (a DDP ``module.``)
_WRAPPER_PREFIXES = ("module.",)


def read_state(folder: Path, official_file: str) -> tuple[dict[str, torch.Tensor], Path]:
    """The state dict in ``folder``: ``model.safetensors`` when present, else ``official_file``; a
    ConfigError naming ``model.model_name_or_path`` when neither exists or the file cannot be read."""
    for name in (SAFETENSORS_FILE, official_file):
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return dict(load_file(str(path))), path
            state: Any = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unpickling / format errors of many kinds
            raise ConfigError(
                f"model.model_name_or_path: cannot read {path}: {' '.join(str(exc).split())}"
            ) from None
        if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
            state = state["state_dict"]
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ConfigError(f"model.model_name_or_path: {path} is not a state dict of tensors")
        out = {}
        for key, value in state.items():
            for prefix in _WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix) :]
            out[str(key)] = value
        return out, path
    raise ConfigError(
        f"model.model_name_or_path: {str(folder)!r} holds neither {SAFETENSORS_FILE} nor {official_file}; "
        "point it at a folder with this stage's weights, or set model.from_scratch: true"
    )


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The state-dict names that share one tensor (a tied ``lm_head`` and ``embed_tokens``), in state-dict
    order; a file needs one name of each group."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load_checked(model: nn.Module, state: Mapping[str, torch.Tensor], source: Path) -> None:
    """Load ``state`` into ``model``; a ConfigError naming ``source`` for any missing (a tied alias may be
    absent when another name of its tensor is present), unexpected or wrongly shaped tensor."""
    expected = model.state_dict()
    present_alias = {n for names in tied_groups(model) if any(k in state for k in names) for n in names}
    missing = sorted(k for k in expected if k not in state and k not in present_alias)
    unexpected = sorted(k for k in state if k not in expected)
    wrong = sorted(
        f"{k} {list(state[k].shape)} (model: {list(expected[k].shape)})"
        for k in state
        if k in expected and tuple(state[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong)):
        if names:
            problems.append(f"{len(names)} {what} ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''})")
    if problems:
        raise ConfigError(
            f"model.model_name_or_path: {source} does not match {type(model).__name__}: "
            f"{'; '.join(problems)}; check model.config_overrides (sizes) against the weights"
        )
    with torch.no_grad():
        model.load_state_dict(dict(state), strict=False)


def save_safetensors(model: nn.Module, folder: Path) -> None:
    """The model's weights as ``folder/model.safetensors`` under its own names; a tied tensor once, under its
    first name (``embed_tokens``, whose copy mm loads into the alias as well)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    aliases = {n for names in tied_groups(model) for n in names[1:]}
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in aliases}
    save_file(state, str(folder / SAFETENSORS_FILE))


def refuse_official_only_on_meta(args: Any, official_file: str, model_id: str) -> None:
    """In ``_from_config`` (the meta-device build): a ConfigError when ``model.model_name_or_path`` holds the
    official ``official_file`` but no ``model.safetensors``. mm fills a meta-built model from safetensors
    only, so the official weights would be silently replaced by a fresh initialisation."""
    path = args.model_name_or_path
    if args.from_scratch or not path:
        return
    folder = Path(str(path))
    if (folder / official_file).is_file() and not (folder / SAFETENSORS_FILE).is_file():
        raise ConfigError(
            f"model.model_name_or_path: {str(path)!r} holds {official_file} but no {SAFETENSORS_FILE}, "
            "which a meta-device build (training.init_model_with_meta_device) needs; convert it once with "
            f"mm_models_cosyvoice.convert.convert_official({model_id!r}, SRC, DST), or build without the "
            "meta device"
        )
