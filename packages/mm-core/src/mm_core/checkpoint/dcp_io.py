"""Save and load training state with torch.distributed.checkpoint (DCP) through the Stateful protocol."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mm_core.checkpoint import layout
from mm_core.checkpoint.json_state import JsonTensorState
from mm_core.checkpoint.reader import load_dcp, raise_on_all_ranks, read_metadata
from mm_core.checkpoint.rng import RNGState
from mm_core.errors import CheckpointError
from mm_core.lora import is_adapter_key

CONFIG_FILE = "mm_config.yaml"

logger = logging.getLogger(__name__)


class ModelState:
    """The model's (sharded) state dict, with fully qualified names that match the unwrapped model.

    ``skip`` names keys to leave out when loading: aliases of tied parameters that a checkpoint stores
    only once (e.g. ``lm_head.weight`` tied to ``model.embed_tokens.weight`` in a Hugging Face export), or
    base weights an adapters-only checkpoint does not hold. ``keep``, when given, selects the keys to save
    (e.g. only LoRA adapters)."""

    def __init__(
        self, model: nn.Module, skip: set[str] | None = None, keep: Callable[[str], bool] | None = None
    ) -> None:
        self.model = model
        self.skip = skip or set()
        self.keep = keep

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        return {k: v for k, v in state.items() if k not in self.skip and (self.keep is None or self.keep(k))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))


class OptimizerState:
    """The optimizer's state keyed by parameter names (so it reshards and survives layout changes)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


@dataclass
class TrainProgress:
    """Counters that must survive a restart."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    world_size: int = 1

    def state_dict(self) -> dict[str, Any]:
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in self.__dict__.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.__dict__:
            if key in state:
                setattr(self, key, int(state[key]))


@dataclass
class ModelParts:
    """One more model of a task (``mm.tasks``) with its optimizer and lr scheduler (None: not trained by
    an optimizer of its own, or no schedule)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None


@dataclass
class TrainingState:
    """Everything a checkpoint may hold. ``data`` (the data position) is the same on every rank and saved
    once; ``rng`` is saved per rank under ``rng_rank<r>``. The main model, its optimizer and scheduler are
    stored under ``model``, ``optimizer`` and ``scheduler``; each model of ``extra`` under its name,
    ``optimizer_<name>`` and ``scheduler_<name>``, in the same checkpoint (one atomic save)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    progress: TrainProgress = field(default_factory=TrainProgress)
    data: Any = None  # a Stateful with tensor-only state, e.g. mm_core.data.EpochIterator
    rng: RNGState | None = None
    adapters_only: bool = False  # model part holds LoRA adapters only (training.lora.save_adapters_only)
    extra: dict[str, ModelParts] = field(default_factory=dict)

    def models(self) -> dict[str, nn.Module]:
        """Every model by its checkpoint entry (``model`` first)."""
        return {"model": self.model, **{name: parts.model for name, parts in self.extra.items()}}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def _states(ts: TrainingState, *, optim: bool, rng: bool) -> dict[str, Any]:
    """The DCP state dict: Stateful objects whose state is made of tensors only (see json_state)."""
    keep = is_adapter_key if ts.adapters_only else None
    states: dict[str, Any] = {"model": ModelState(ts.model, keep=keep), "progress": ts.progress}
    if optim and ts.optimizer is not None:
        states["optimizer"] = JsonTensorState(OptimizerState(ts.model, ts.optimizer))
    if ts.scheduler is not None:
        states["scheduler"] = JsonTensorState(ts.scheduler)
    if ts.data is not None:
        states["data"] = ts.data
    if rng and ts.rng is not None:
        states[rng_key(_rank())] = ts.rng
    for name, parts in ts.extra.items():
        states[name] = ModelState(parts.model)
        if optim and parts.optimizer is not None:
            states[f"optimizer_{name}"] = JsonTensorState(OptimizerState(parts.model, parts.optimizer))
        if parts.scheduler is not None:
            states[f"scheduler_{name}"] = JsonTensorState(parts.scheduler)
    return states


def begin_save(root: Path, step: int) -> Path:
    """Make an empty ``.step_<N>.partial`` folder (rank 0) and return it once every rank can see it."""
    partial = layout.partial_dir(root, step)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
        partial.mkdir()
    _barrier()
    return partial


def finish_save(root: Path, step: int, config_text: str | None, keep: int | None) -> Path:
    """Rank 0 only, after every rank's data and DCP's ``.metadata`` are written: add the config, rename the
    folder to ``step_<N>``, move ``latest``, prune."""
    partial = layout.partial_dir(root, step)
    if config_text is not None:
        (partial / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    final = layout.finalize(root, step)
    layout.prune(root, keep)
    return final


def save_checkpoint(
    root: str | Path,
    step: int,
    ts: TrainingState,
    *,
    save_optim: bool = True,
    save_rng: bool = True,
    config_text: str | None = None,
    keep: int | None = None,
) -> Path:
    """Write ``<root>/step_<step>`` atomically (see :mod:`mm_core.checkpoint.layout`); all ranks call this."""
    root = Path(root)
    partial = begin_save(root, step)
    dcp.save(_states(ts, optim=save_optim, rng=save_rng), checkpoint_id=str(partial))
    _barrier()
    if _rank() == 0:
        finish_save(root, step, config_text, keep)
    _barrier()
    return layout.step_dir(root, step)


def check_shapes(path: Path, metadata: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Every stored tensor that will be loaded has the shape the model expects (``expected`` maps the
    flattened checkpoint key to a tensor or a shape); a mismatch names the tensor and both shapes."""
    wrong = []
    for key, value in expected.items():
        md = metadata.get(key)
        if md is None:
            continue
        shape = tuple(value.shape) if hasattr(value, "shape") else tuple(value)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{where}: {path}: {key} is stored as a pickled object, not a tensor")
        if tuple(md.size) != shape:
            wrong.append((key, list(md.size), list(shape)))
    if wrong:
        key, saved, want = wrong[0]
        more = f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""
        raise CheckpointError(
            f"{where}: {path}: {key} has shape {saved} in the checkpoint but {want} in this model{more}; the "
            f"checkpoint was saved from a different model: compare model.* (config_overrides, "
            f"model_name_or_path) with {path / CONFIG_FILE}"
        )


def tied_aliases(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _check_model_keys(
    path: Path, model: nn.Module, entry: str, strict: bool, keys: set[str]
) -> tuple[list[str], set[str]]:
    """Missing keys of the model stored under ``entry`` (a tied group counts as present when any alias is
    stored; ``keys`` are the checkpoint's flattened keys), and the aliases to skip when loading."""
    stored = {k[len(entry) + 1 :] for k in keys if k.startswith(f"{entry}.")}
    expected = set(get_model_state_dict(model))
    skip: set[str] = set()
    for names in tied_aliases(model):
        if any(n in stored for n in names):
            skip.update(n for n in names if n not in stored)
    if entry == "model" and stored and all(is_adapter_key(k) for k in stored):
        # an adapters-only checkpoint: the base weights come from model.model_name_or_path
        skip.update(k for k in expected if not is_adapter_key(k))
    missing, unexpected = sorted(expected - stored - skip), sorted(stored - expected)
    if strict and (missing or unexpected):

        def show(keys: list[str]) -> str:
            return ", ".join(keys[:10]) + (f" ... ({len(keys)} in all)" if len(keys) > 10 else "") or "none"

        what = "the model" if entry == "model" else f"the task's model {entry!r}"
        raise CheckpointError(
            f"training.load: {path} does not match {what} (load_strict is true). Missing from the "
            f"checkpoint: {show(missing)}. Unexpected in the checkpoint: {show(unexpected)}. Set "
            "training.load_strict: false to load the matching tensors only."
        )
    return missing, skip


def _saved_task(path: Path) -> str:
    """``training.task`` of the run that saved ``path`` (its config copy), or ``"unknown"``."""
    try:
        saved = yaml.safe_load((path / CONFIG_FILE).read_text(encoding="utf-8"))
        return str(((saved or {}).get("training") or {}).get("task", "standard"))
    except (OSError, yaml.YAMLError, AttributeError):
        return "unknown"


def _check_no_other_models(path: Path, stored_top: set[str], ts: TrainingState, strict: bool) -> None:
    """A checkpoint that holds models this run's task does not build (a vocoder run's discriminator resumed
    by the standard task) is refused under ``load_strict``, naming them and the task that saved them."""
    known = {*ts.models(), "optimizer", "scheduler", "progress", "data"}
    others = sorted(
        k for k in stored_top - known if not k.startswith(("rng_rank", "optimizer_", "scheduler_"))
    )
    if not others:
        return
    if strict:
        raise CheckpointError(
            f"training.load: {path} also holds {', '.join(map(repr, others))}, models of the task that saved "
            f"it (training.task: {_saved_task(path)}), which this run's task does not build. Resume under "
            "that task, or set training.load_strict: false to load the models this task builds and leave the "
            "rest"
        )
    if _rank() == 0:
        logger.warning(
            "training.load: %s also holds %s (training.task: %s), not loaded: this run's task does not build "
            "them (training.load_strict: false)",
            path,
            ", ".join(others),
            _saved_task(path),
        )


def load_checkpoint(
    path: str | Path,
    ts: TrainingState,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """Load whatever ``path`` holds into ``ts``: the model always; optimizer, scheduler, progress, data
    position and this rank's random state when present (a weights-only checkpoint from ``mm convert
    hf-to-dcp`` starts at step 0). Works on any world size: DCP reshards model and optimizer, the data
    position is global, and a rank the saving job did not have gets a fresh random state derived from the
    seed, the step and its rank.
    Returns a report: what was loaded, missing model keys, the saving world size, reseeded ranks."""
    path = Path(path)

    def plan() -> tuple[dict[str, Any], list[str], set[str]]:
        # read and checked on every rank; a failure anywhere stops every rank with the same one line
        if not layout.is_checkpoint(path):
            raise CheckpointError(f"training.load: {path} is not a complete DCP checkpoint (no .metadata)")
        metadata = read_metadata(path, where="training.load").state_dict_metadata
        stored_top = {k.split(".", 1)[0] for k in metadata}
        _check_no_other_models(path, stored_top, ts, strict)
        states = _states(ts, optim=load_optim, rng=load_rng)
        missing: list[str] = []
        for entry, model in ts.models().items():
            absent, skip = _check_model_keys(path, model, entry, strict, set(metadata))
            missing += absent if entry == "model" else [f"{entry}.{k}" for k in absent]
            model_state = {f"{entry}.{k}": v for k, v in get_model_state_dict(model).items()}
            check_shapes(path, metadata, model_state, "training.load")
            states[entry] = ModelState(model, skip=skip | set(absent))
        states = {k: v for k, v in states.items() if k in stored_top}
        for name, obj in states.items():
            if isinstance(obj, JsonTensorState):
                md = metadata.get(f"{name}.json")
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointError(f"training.load: {path}: {name}.json is missing or not a tensor")
                obj.json_size = int(md.size[0])
        return states, missing, stored_top

    states, missing, stored_top = raise_on_all_ranks(plan)
    load_dcp(states, path, allow_partial=not strict, where="training.load")
    saved_world = ts.progress.world_size if "progress" in states else None
    reseeded = False
    has_rng = any(k.startswith("rng_rank") for k in stored_top)
    if load_rng and has_rng and ts.rng is not None and rng_key(_rank()) not in states:
        ts.rng.reseed(ts.progress.step, _rank())  # a rank the saving job did not have
        reseeded = True
    ts.progress.world_size = _world()
    return {
        "loaded": sorted(states),
        "missing_model_keys": missing,
        "saved_world_size": saved_world,
        "reseeded_rng": reseeded,
    }
