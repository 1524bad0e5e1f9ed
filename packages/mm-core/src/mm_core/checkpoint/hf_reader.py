"""Read a Hugging Face safetensors folder into a sharded model under the model's own weight names.

transformers renames some checkpoints' weights on load and fuses others (a MoE's per-expert
``experts.{e}.gate_proj`` / ``up_proj`` become one ``experts.gate_up_proj``): its conversion mapping for the
model (``get_model_conversion_mapping``, which PEFT also reads). A model built on the meta device and
sharded loads through DCP instead of ``from_pretrained``, so :class:`ConvertingHFReader` is a DCP storage
reader that presents the folder under the model's names: a tensor transformers takes as it is (or renamed)
is read slice by slice as torch's ``HuggingFaceStorageReader`` reads it; a tensor transformers builds from
several is built by transformers' own conversion operations from the source tensors of this rank's slice.

Each rank reads only what its shards need. For a fused expert weight whose conversion stacks the experts
along dimension 0 first (``MergeModulelist(dim=0)``, then concatenations or transposes that keep dimension
0), a rank reads only the experts of its rows; other conversions read their sources whole, once per read."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from mm_core.errors import CheckpointError

_NATURAL = re.compile(r"(\d+)")
_M = TypeVar("_M", bound=nn.Module)


def _natural_key(name: str) -> list[Any]:
    """``experts.10`` after ``experts.9``: the order transformers stacks experts in."""
    return [int(part) if part.isdigit() else part for part in _NATURAL.split(name)]


@dataclass
class _Source:
    """One checkpoint tensor: its file, its name there, its shape and dtype."""

    file: str
    key: str
    shape: torch.Size
    dtype: torch.dtype

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass
class _Conversion:
    """One application of a transformers ``WeightConverter``: the source tensors it collects (per source
    pattern, in natural order) and the name of its (first) target, from which the others are named."""

    converter: Any
    layer_name: str
    sources: dict[str, list[_Source]] = field(default_factory=dict)
    ops: list[Any] = field(default_factory=list)

    def add(self, pattern: str, source: _Source) -> None:
        self.sources.setdefault(pattern, []).append(source)

    def ordered(self) -> dict[str, list[_Source]]:
        patterns = [p for p in self.converter.source_patterns if p in self.sources]
        return {p: sorted(self.sources[p], key=lambda s: _natural_key(s.key)) for p in patterns}

    def resolve(self, model: nn.Module) -> None:
        """The converter's operations, with each shape-checked ``Transpose`` decided once here on the full
        shapes (transposing when the source's shape differs from the model's parameter): on a rank's rows
        its shape check would compare a slice with the whole parameter."""
        from transformers.core_model_loading import Transpose

        self.ops = []
        for op in self.converter.operations:
            if isinstance(op, Transpose) and op.check_dims:
                (sources,) = self.sources.values()
                try:
                    expected = model.get_parameter(self.layer_name).shape
                except AttributeError:
                    self.ops.append(op)
                    continue
                if sources[0].shape != expected:
                    self.ops.append(Transpose(op.dim0, op.dim1))
                continue
            self.ops.append(op)

    def slices_dim0(self) -> bool:
        """Whether rows ``[a, b)`` of every target are the conversion of the sources' rows ``[a, b)`` (of
        their list of experts for a ``MergeModulelist(dim=0)`` first, of each tensor otherwise)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

        ops = list(self.ops)
        if ops and isinstance(ops[0], MergeModulelist):
            if ops[0].dim != 0:
                return False
            ops = ops[1:]
        elif not all(len(v) == 1 for v in self.sources.values()):
            return False
        for op in ops:
            if isinstance(op, Concatenate) and op.dim != 0:
                continue
            if isinstance(op, Transpose) and 0 not in (op.dim0, op.dim1) and not op.check_dims:
                continue
            return False
        return True

    def convert(self, model: nn.Module, tensors: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run the converter's operations on ``tensors`` (per source pattern); the targets by full name."""
        collected: dict[str, Any] = dict(tensors)
        if not self.ops:  # a shape-checked transpose resolved to none: the source under the target's name
            ((_, (tensor,)),) = collected.items()
            collected = {self.converter.target_patterns[0]: tensor}
        config = getattr(model, "config", None)
        for op in self.ops:
            collected = op.convert(
                collected,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
                full_layer_name=self.layer_name,
                model=model,
                config=config,
                missing_keys=None,
            )
        full_name = self.layer_name.replace("*.", "0.")
        found = next((k for k in collected if k in full_name), None)
        if found is None:
            return collected
        prefix, _, suffix = full_name.partition(found)
        return {prefix + k + suffix: v for k, v in collected.items()}


@dataclass
class _Plain:
    """A target read directly from one checkpoint tensor (its name there may differ)."""

    source: _Source


@dataclass
class _Converted:
    """A target built by a conversion."""

    conversion: _Conversion


def unsharded_class(cls: type[_M]) -> type[_M]:
    """The class ``fully_shard`` (or ``replicate``) replaced: they give a module a class of their own,
    ``type(f"FSDP{name}", (FSDPModule, cls), ...)``; any other class is returned as it is."""
    from torch.distributed.fsdp import FSDPModule

    original = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cast("type[_M]", original)  # a base of cls after FSDPModule: one of its module classes


def map_sharded_as_unsharded(model: nn.Module) -> None:
    """Make transformers' conversion mapping treat each ``PreTrainedModel`` module of ``model`` whose class
    ``fully_shard`` replaced as the class it replaced.

    transformers looks a module's mapping up by class name, then by ``model_type`` (for a class defined
    outside transformers only when the user registered that name or type). A sharded module's class is
    defined in torch under another name, so a mapping found by the original class's name is lost (Qwen3-Omni's
    thinker: its exported ``model.*`` text weights would not become ``model.language_model.*``), and so is
    the ``model_type`` mapping of a transformers class (a sharded ``Qwen3MoeForCausalLM`` would not fuse its
    experts). This registers, through transformers' ``register_checkpoint_conversion_mapping``, the mapping
    transformers finds for the original class under the new class's name, or re-registers the original's
    ``model_type`` mapping unchanged where the lookup goes by ``model_type`` (as
    :func:`mm_core.models.hub.share_weight_conversions` does for a subclass); idempotent."""
    from transformers import PreTrainedModel, conversion_mapping

    # transformers' conversion_mapping functions are unannotated
    find = cast("Callable[[str], list[Any] | None]", conversion_mapping.get_checkpoint_conversion_mapping)
    register = conversion_mapping.register_checkpoint_conversion_mapping
    user = conversion_mapping.USER_REGISTERED_MAPPINGS
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        cls = type(module)
        original = unsharded_class(cls)
        if original is cls or cls.__name__ in user:
            continue
        model_type = str(getattr(module.config, "model_type", None) or "")
        if original.is_custom_code() and original.__name__ not in user and model_type not in user:
            continue  # transformers applies no mapping to the original class, nor to the sharded one
        by_class = find(original.__name__)
        if by_class is not None:
            register(cls.__name__, by_class, overwrite=True)
        elif model_type and model_type not in user and (by_type := find(model_type)) is not None:
            register(model_type, by_type, overwrite=True)


def _conversion_rules(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters for ``model`` as built, before sharding (none for a model
    outside transformers)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    if not isinstance(model, PreTrainedModel):
        return [], []
    map_sharded_as_unsharded(model)
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return renamings, converters


def _files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model.model_name_or_path: {path} holds no *.safetensors files")
    return files


class ConvertingHFReader(FileSystemReader):
    """A DCP storage reader of the safetensors folder ``path`` under ``model``'s weight names (module
    docstring). ``model`` is the (sharded) model being loaded: its classes, as they were before sharding
    (:func:`map_sharded_as_unsharded`), select transformers' conversion mapping, and its state-dict names
    decide how a checkpoint name is completed (``base_model_prefix``)."""

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        super().__init__(path=str(path))
        self._folder = Path(path)
        self._model = model
        self._targets: dict[str, _Plain | _Converted] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from transformers.core_model_loading import rename_source_key

        renamings, converters = _conversion_rules(self._model)
        names = {name: True for name in self._model.state_dict()}
        prefix = getattr(self._model, "base_model_prefix", None) or None
        conversions: dict[tuple[int, str], _Conversion] = {}
        shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        seen: dict[str, str] = {}
        for file in _files(self._folder):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                    target, pattern = rename_source_key(key, renamings, converters, prefix, names)
                    shape = torch.Size(f.get_slice(key).get_shape())
                    source = _Source(str(file), key, shape, _dtype(f, key))
                    if key in seen:
                        raise CheckpointError(
                            f"model.model_name_or_path: {key} is in both {seen[key]} and {file.name}; a "
                            "folder holding pieces of one tensor (torch's sharded safetensors) must be "
                            "consolidated first"
                        )
                    seen[key] = file.name
                    if pattern is None:
                        self._targets[target] = _Plain(source)
                        shapes[target] = (source.shape, source.dtype)
                        continue
                    converter = next(c for c in converters if pattern in c.source_patterns)
                    unit = conversions.setdefault((id(converter), target), _Conversion(converter, target))
                    unit.add(pattern, source)
        for unit in conversions.values():  # on meta tensors: the targets' shapes and dtypes, no data read
            unit.resolve(self._model)
            metas = {pattern: [s.meta() for s in sources] for pattern, sources in unit.ordered().items()}
            for name, tensor in unit.convert(self._model, metas).items():
                self._targets[name] = _Converted(unit)
                shapes[name] = (tensor.shape, tensor.dtype)
        state = {
            name: TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
            for name, (size, dtype) in shapes.items()
        }
        storage = {MetadataIndex(name): name for name in shapes}
        return Metadata(state_dict_metadata=state, storage_data=storage)  # type: ignore[arg-type]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with ExitStack() as stack:
            opened: dict[str, Any] = {}

            def handle(file: str) -> Any:
                """The open safetensors file ``file`` (each opened once per read)."""
                if file not in opened:
                    opened[file] = stack.enter_context(safe_open(file, framework="pt"))
                return opened[file]

            for unit, items in self._by_conversion(plan.items):
                if unit is None:
                    for item in items:
                        target = self._targets[item.storage_index.fqn]
                        assert isinstance(target, _Plain)
                        source = target.source
                        _commit(planner, item, handle(source.file).get_slice(source.key)[_slices(item)])
                    continue
                whole: dict[str, torch.Tensor] | None = None
                for item in items:
                    if unit.slices_dim0() and item.lengths:
                        span = _slices(item)
                        rows = self._read_rows(unit, handle, span[0])[item.storage_index.fqn]
                        _commit(planner, item, rows[(slice(0, item.lengths[0]),) + span[1:]])
                        continue
                    if whole is None:  # the other conversions: their sources whole, once for all their items
                        whole = self._read_rows(unit, handle, None)
                    _commit(planner, item, whole[item.storage_index.fqn][_slices(item)])
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _by_conversion(self, items: list[ReadItem]) -> Iterator[tuple[_Conversion | None, list[ReadItem]]]:
        plain: list[ReadItem] = []
        converted: dict[int, tuple[_Conversion, list[ReadItem]]] = {}
        for item in items:
            target = self._targets[item.storage_index.fqn]
            if isinstance(target, _Plain):
                plain.append(item)
            else:
                converted.setdefault(id(target.conversion), (target.conversion, []))[1].append(item)
        yield None, plain
        yield from converted.values()

    def _read_rows(
        self, unit: _Conversion, handle: Callable[[str], Any], rows: slice | None
    ) -> dict[str, torch.Tensor]:
        """The targets of ``unit`` from its sources' ``rows`` (all rows when None); ``handle`` gives a file's
        open safetensors handle."""
        from transformers.core_model_loading import MergeModulelist

        stacks = bool(unit.ops) and isinstance(unit.ops[0], MergeModulelist)
        tensors: dict[str, list[torch.Tensor]] = {}
        for pattern, sources in unit.ordered().items():
            if rows is None:
                tensors[pattern] = [handle(s.file).get_tensor(s.key) for s in sources]
            elif stacks:  # one source per expert: this rank's experts
                tensors[pattern] = [handle(s.file).get_tensor(s.key) for s in sources[rows]]
            else:
                tensors[pattern] = [handle(s.file).get_slice(s.key)[rows] for s in sources]
        return unit.convert(self._model, tensors)


def _dtype(f: Any, key: str) -> torch.dtype:
    from safetensors.torch import _getdtype

    dtype: torch.dtype = _getdtype(f.get_slice(key).get_dtype())
    return dtype


def _slices(item: ReadItem) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))


def _commit(planner: LoadPlanner, item: ReadItem, tensor: torch.Tensor) -> None:
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointError(
            f"model.model_name_or_path: {item.storage_index.fqn} has shape {tuple(tensor.size())} in this "
            f"slice of the checkpoint, the model expects {tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)
