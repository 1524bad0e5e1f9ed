"""Reading and writing Qwen3-TTS weights under the official tensor names.

The module tree of :class:`~mm_models_qwen.qwen3_tts.Qwen3TTSForTraining` spells the official names
(``talker.model.layers.0.self_attn.q_proj.weight``, ``talker.code_predictor.lm_head.3.weight``, ...), so
loading is a strict name-for-name copy: a tensor the model has and the folder lacks, a tensor the folder has
and the model does not know, or a shape that differs is a ConfigError naming them. The official checkpoints
ship one ``model.safetensors``; a sharded folder (``model.safetensors.index.json``) loads the same way.

**Not loaded: ``speaker_encoder.*``** (the ECAPA-TDNN x-vector encoder of the Base checkpoints). It is not
part of what is trained: the official fine-tuning detaches its output, and drops its weights from the
checkpoint it saves (which becomes a ``custom_voice`` model). mm takes the x-vector of a speaker as data
instead (a ``.npy`` computed once with the official encoder, see mm-data-audio's ``tts_codes``), so the model
holds no speaker encoder and its tensors are skipped when present.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mm_core.errors import ConfigError

WHERE = "model.model_name_or_path"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: official tensors that are intentionally not loaded (module docstring)
NOT_LOADED_PREFIXES = ("speaker_encoder.",)


def _shown(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the folder's safetensors weights and the file holding it."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{WHERE}: {index}: not a safetensors index with a weight_map ({exc})"
            ) from None
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise ConfigError(f"{WHERE}: {index} names missing files: {_shown(absent)}")
        return files
    single = folder / SINGLE
    if not single.is_file():
        raise ConfigError(f"{WHERE}: {str(folder)!r} holds neither {SINGLE} nor {INDEX}")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118 - safe_open is not a dict


@torch.no_grad()
def load_official(model: nn.Module, folder: str | Path) -> list[str]:
    """Copy the folder's tensors into ``model`` by name (cast to each parameter's dtype); returns the names
    skipped on purpose (:data:`NOT_LOADED_PREFIXES`). ConfigError for missing, unexpected or misshapen
    tensors."""
    folder = Path(folder)
    files = tensor_files(folder)
    state = model.state_dict()
    skipped = sorted(n for n in files if n.startswith(NOT_LOADED_PREFIXES))
    unexpected = sorted(n for n in files if n not in state and n not in skipped)
    missing = sorted(n for n in state if n not in files)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} tensors of the model ({_shown(missing)})")
        if unexpected:
            parts.append(f"holds {len(unexpected)} tensors the model does not have ({_shown(unexpected)})")
        raise ConfigError(
            f"{WHERE}: {str(folder)!r} {' and '.join(parts)}; check that the folder is a Qwen3-TTS "
            "checkpoint (all its shards) and that model.config_overrides keeps its sizes"
        )
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name not in skipped:
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                target = state[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ConfigError(
                        f"{WHERE}: {path}: {name} has shape {tuple(tensor.shape)}, the model expects "
                        f"{tuple(target.shape)} (does config.json match the weights?)"
                    )
                target.copy_(tensor)
    return skipped


def save_official(model: nn.Module, folder: str | Path, config: dict[str, object]) -> Path:
    """Write ``model.safetensors`` (the official names, one file as the official checkpoints ship) and
    ``config.json`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(state, str(folder / SINGLE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder
