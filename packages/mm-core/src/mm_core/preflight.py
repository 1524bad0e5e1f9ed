"""Preflight: before anything starts, verify every path the run will read, on this process and on CPU.

``mm check`` (and ``mm train --nproc-per-node``, which runs the same check before it launches workers) calls
:func:`run_preflight`, so a missing dataset, tokenizer, weights folder or ``training.load`` checkpoint is one
line at once instead of a failure inside every worker minutes later. Nothing is loaded into memory:

- data: the dataset class's ``preflight`` hook when it has one (see below), else the dataset is built in full
  with :func:`mm_core.data.build_dataset` (correct for any plugin, but it may tokenise a whole corpus);
- weights (unless ``model.from_scratch``): ``model.model_name_or_path`` is a local folder holding the
  safetensors files transformers loads (``model.safetensors`` or every shard of its index); each file's header
  is read, so a truncated or corrupt file is found, but no tensor is;
- ``training.load``: a ``step_<N>`` checkpoint, or a save folder with one (found by name: nothing in it is
  read, let alone unpickled); ``auto`` without a checkpoint yet is a fresh start.

Dataset preflight hook: a dataset class (or factory) registered under ``mm.datasets`` may define
``preflight(basic_param, preprocess_param, dataset_param) -> list[str]``. It validates the parameters, checks
that every file exists, loads the tokenizer or processor from local files, reads and encodes the first record
of the data, and returns one or more lines describing what it verified. It raises ``ConfigError`` /
``DataError`` for what the real build would refuse, and should take well under a second on any corpus.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from mm_core.config.schema import DataConfig, MMConfig, ModelConfig, TrainingConfig
from mm_core.errors import CheckpointError, ConfigError

GiB = 2**30
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"


def _label(name: str, lines: list[str]) -> list[str]:
    """``name : first line`` and the other lines indented under it, like the rest of ``mm check``."""
    head = f"{name:<12}: "
    return [head + lines[0], *(" " * len(head) + line for line in lines[1:])] if lines else []


def run_preflight(cfg: MMConfig, out: Callable[..., object] = print) -> None:
    """Verify the data, the weights and ``training.load``; print what was verified. Raises MMError."""
    from mm_core.parallel.apply import meta_init

    meta = meta_init(cfg.training.init_model_with_meta_device, cfg.model, cfg.training.lora)[0]
    for line in (*check_data(cfg), *check_weights(cfg.model, meta), *check_load(cfg.training)):
        out(line)


# ------------------------------------------------------------------------------------------------ data
def check_data(cfg: MMConfig) -> list[str]:
    """The dataset's preflight hook, or a full build for a dataset without one; the same for the validation
    data (``data.eval_dataset_param``) when there is one."""
    lines = _check_dataset("data", cfg.data, cfg.training.seed)
    if cfg.data.eval_dataset_param is not None:
        from mm_core.errors import MMError
        from mm_core.train.evaluation import KEY, eval_data_config

        try:
            lines += _check_dataset("eval data", eval_data_config(cfg), cfg.training.seed)
        except MMError as exc:
            raise type(exc)(f"{KEY} (the validation data): {exc}") from None
    return lines


def _check_dataset(label: str, data: DataConfig, seed: int) -> list[str]:
    from mm_core.registry import data_register

    dp = data.dataset_param
    factory = data_register.get(dp.dataset_type)
    hook = getattr(factory, "preflight", None)
    if callable(hook):
        lines = list(
            hook(
                basic_param=dict(dp.basic_parameters),
                preprocess_param=dict(dp.preprocess_parameters),
                dataset_param=dp,
            )
        )
        return _label(label, [f"{dp.dataset_type}: {lines[0]}" if lines else dp.dataset_type, *lines[1:]])
    from mm_core.data.builder import build_dataset

    dataset = build_dataset(data, seed)
    return _label(
        label,
        [f"{dp.dataset_type}: {len(dataset):,} samples (built in full: the dataset has no preflight hook)"],
    )


# --------------------------------------------------------------------------------------------- weights
def weight_files(folder: Path, any_names: bool = False) -> list[Path]:
    """The safetensors files the run reads from ``folder``: ``model.safetensors`` or the shards of its index
    (what ``from_pretrained`` reads), or with ``any_names`` (meta-device init, which reads the folder through
    DCP's Hugging Face reader) every ``*.safetensors``. A ConfigError naming ``model.model_name_or_path`` when
    there are none or the index names a missing shard."""
    key = "model.model_name_or_path"
    if (folder / _SAFE_WEIGHTS).is_file():
        return [folder / _SAFE_WEIGHTS]
    index = folder / _SAFE_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{key}: {index} is not a safetensors index (no valid weight_map: {e})"
            ) from None
        for shard in shards:
            if not (folder / shard).is_file():
                raise CheckpointError(
                    f"{key}: {index} names the shard {shard!r}, which does not exist in {folder}; "
                    "the download is incomplete"
                )
        return [folder / s for s in shards]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if any_names and others:
        return [folder / name for name in others]
    found = (
        f" (it holds {', '.join(others[:3])}, but transformers loads only those names unless "
        "training.init_model_with_meta_device is true)"
        if others
        else ""
    )
    raise ConfigError(
        f"{key}: {str(folder)!r} has no {_SAFE_WEIGHTS} or {_SAFE_INDEX}{found}; point it at the model's "
        "Hugging Face folder, or set model.from_scratch: true to train from a random initialisation"
    )


def _read_header(path: Path) -> int:
    """How many tensors a safetensors file holds, from its header only; CheckpointError when it is broken."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return len(list(f.keys()))
    except Exception as e:  # noqa: BLE001 - SafetensorError and OSError, depending on the damage
        raise CheckpointError(
            f"model.model_name_or_path: {path} is not a readable safetensors file ({e}); download it again"
        ) from None


def check_weights(model: ModelConfig, meta_init: bool = False) -> list[str]:
    """``model.model_name_or_path`` holds the weights the run loads (unless ``model.from_scratch``);
    ``meta_init``: whether the model is built on the meta device (``training.init_model_with_meta_device``
    resolved by :func:`~mm_core.parallel.apply.meta_init`)."""
    from transformers import PreTrainedModel

    from mm_core.models.hub import ModelHub

    if model.from_scratch:
        return _label("weights", ["none: model.from_scratch is true (random initialisation)"])
    cls = ModelHub.model_class(model)
    path = model.model_name_or_path
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        # a custom BaseModel reads its own weights in from_pretrained; only the path can be checked
        if path and not Path(path).exists():
            raise ConfigError(f"model.model_name_or_path: {path!r} does not exist (relative to {Path.cwd()})")
        return _label("weights", [f"{path or '(model.model_name_or_path not set)'}: read by {cls.__name__}"])
    if not path:
        raise ConfigError(
            "model.model_name_or_path: not set, but model.from_scratch is false so the run loads weights; "
            "set it to the model's Hugging Face folder, or set model.from_scratch: true"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(
            f"model.model_name_or_path: {path!r} is not a local folder (relative to {Path.cwd()}); mm never "
            "downloads: download the model first and give its folder (or set model.from_scratch: true)"
        )
    files = weight_files(folder, any_names=meta_init)
    tensors = sum(_read_header(f) for f in files)
    size = sum(f.stat().st_size for f in files)
    line = (
        f"{path}: {len(files)} safetensors file(s), {tensors:,} tensors, {size / GiB:.2f} GiB (headers read)"
    )
    return _label("weights", [line])


# ---------------------------------------------------------------------------------------- training.load
def check_load(training: TrainingConfig) -> list[str]:
    """``training.load`` names a checkpoint (or ``auto``: the newest under ``training.save``, if any)."""
    from mm_core.checkpoint.layout import resolve_load_path

    load = training.load
    if load is None:
        return []
    if load == "auto":
        found = resolve_load_path(load, training.save)
        if found is None:
            return _label("load", [f"auto: no checkpoint in {training.save} yet, so the run starts fresh"])
        return _label("load", [f"auto: resumes from {found}"])
    if not Path(load).exists():
        raise CheckpointError(
            f"training.load: {load!r} does not exist (relative to {Path.cwd()}); give a step_<N> checkpoint "
            "folder, a training.save folder with checkpoints, auto (resume if there is one), or null"
        )
    return _label("load", [str(resolve_load_path(load, training.save))])
