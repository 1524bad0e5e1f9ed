"""``mm check --simulate``: one rank of an N-rank run, built as a worker builds it, without the other ranks.

torch's fake process-group backend stands for the N-rank world (this process is one rank of it; every
collective returns at once, nothing is sent). On it the run's own code builds the meshes
(:func:`~mm_core.parallel.state.init_parallel_state`), the model at its configured size on the meta device
(no memory), and applies the same build plan as training (:func:`~mm_core.parallel.apply.shard_model`: FSDP2,
expert parallelism, HSDP). The bytes this rank would hold are then counted from the sharded tensors:

- parameters: the local shard of every parameter, in its stored dtype;
- gradients: the same for every trainable parameter (FSDP2 keeps sharded gradients in the parameters'
  dtype);
- optimizer: the optimizer plugin's states per parameter times the trainable local shards (AdamW keeps 2
  moments per parameter; its scalar step counters, 4 bytes per tensor, are not counted);
- gathered: what FSDP2 all-gathers on this rank, counted from the sharded tensors (a shard times the size
  of the mesh dimensions FSDP shards it over, ``dp_shard_cp`` or ``efsdp``: an expert unit gathers only
  this rank's experts), in ``parallel.fsdp_plan.param_dtype``: the root unit for the whole step, the
  largest unit (with the units nested in it, gathered as one group) and ``num_to_forward_prefetch`` more
  like it, and that unit's unsharded gradient (``reduce_dtype``) waiting for its reduce-scatter;
- activations: the estimate of ``mm check`` under the recompute plan (saved activations and the backward's
  transient, as on an accelerator: offloaded layers are not counted), see docs/memory.md.

The total is the peak of ``mm check``'s estimate: parameters + optimizer + gathered + the larger of
(activations) and (gradients). Not counted: allocator caching and fragmentation, communication buffers,
the data pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mm_core.check import plan_on_meta
from mm_core.config.schema import MMConfig
from mm_core.config.support import check_supported
from mm_core.errors import ConfigError
from mm_core.optim.factory import optimizer_plugin
from mm_core.parallel.apply import shard_model, to_dtype
from mm_core.parallel.estimate import estimate_activations
from mm_core.parallel.state import init_parallel_state, resolve_sizes
from mm_core.parallel.summary import tokens_per_micro_batch
from mm_core.registry import import_plugins, optimizer_register

GiB = 2**30
#: device memory sizes ``--device-memory`` is usually given (64 GiB: Ascend 910B; 80: H100/A100; 141: H200)
DEVICE_MEMORY_GIB = 64.0


@dataclass(frozen=True)
class Simulation:
    """What one rank of a ``world_size``-rank run holds (bytes), and whether it fits ``device_memory``."""

    world_size: int
    rank: int
    layout: str
    process_groups: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: float
    device_memory: float

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.gathered + max(self.activations, self.grads)

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def as_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "layout": self.layout,
            "process_groups": self.process_groups,
            "per_rank_bytes": {
                "params": self.params,
                "grads": self.grads,
                "optimizer": self.optimizer,
                "gathered": self.gathered,
                "activations": self.activations,
                "total": self.total,
            },
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
        }

    def describe(self) -> list[str]:
        verdict = "fits" if self.fits else "does NOT fit"
        return [
            f"simulated   : rank {self.rank} of {self.world_size} ({self.layout}) on torch's fake process "
            f"group; {self.process_groups} process groups created by this rank",
            f"memory/rank : {self.total / GiB:.2f} GiB = params {self.params / GiB:.2f} + optimizer "
            f"{self.optimizer / GiB:.2f} + gathered units {self.gathered / GiB:.2f} + max(activations "
            f"{self.activations / GiB:.2f}, grads {self.grads / GiB:.2f}) (counted from the sharded tensors; "
            "activations estimated)",
            f"device      : {self.device_memory / GiB:g} GiB: {verdict}",
        ]


#: the mesh dimensions FSDP2 shards parameters over (``ParallelState``): the others are EP or replicas
FSDP_DIMS = ("dp_shard_cp", "efsdp")


def _local_bytes(tensor: nn.Parameter) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _gathered_numel(param: nn.Parameter) -> int:
    """Elements of ``param`` on this rank while its FSDP unit is gathered."""
    if not isinstance(param, DTensor):
        return param.numel()
    numel: int = param.to_local().numel()
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if placement.is_shard() and mesh.mesh_dim_names and mesh.mesh_dim_names[dim] in FSDP_DIMS:
            numel *= mesh.size(dim)
    return numel


def _gathered_units(model: nn.Module, units: list[tuple[str, ...]]) -> tuple[int, int]:
    """(elements of the root unit, of the largest unit with the units nested in it) while gathered; ``units``:
    each unit's module names (several for a unit of sibling modules, e.g. the final norm and head)."""
    names = [n for unit in units for n in unit]
    tops = [u for u in units if not any(n.startswith(o + ".") for n in u for o in names if o not in u)]
    owner: dict[int, tuple[str, ...]] = {}
    for name, param in model.named_parameters():
        inside = (u for u in tops if any(name.startswith(n + ".") for n in u))
        owner.setdefault(id(param), next(inside, ()))
    sizes: dict[tuple[str, ...], int] = {}
    for param in model.parameters():
        unit = owner[id(param)]
        sizes[unit] = sizes.get(unit, 0) + _gathered_numel(param)
    root = sizes.pop((), 0)
    return root, max(sizes.values(), default=0)


def simulate(
    cfg: MMConfig, world_size: int, *, rank: int = 0, device_memory_gib: float = DEVICE_MEMORY_GIB
) -> Simulation:
    """Build rank ``rank`` of a ``world_size``-rank run of ``cfg`` on the fake backend (module docstring).
    Rank 0 holds the largest shards when a dimension does not divide evenly."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ConfigError("mm check --simulate: a process group already exists in this process")
    if not 0 <= rank < world_size:
        raise ConfigError(f"mm check --simulate: rank {rank} is not in a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        state = init_parallel_state(cfg.parallel, "cpu")
        model, plan = plan_on_meta(cfg, state.sizes)
        tokens = tokens_per_micro_batch(cfg.data, cfg.training.micro_batch_size)
        acts, transient = estimate_activations(model, plan, tokens, device_type="cuda")
        sharded, _ = shard_model(model, plan, state)
        params = list(sharded.parameters())
        root, largest = _gathered_units(sharded, [*plan.unit_groups, *((n,) for n in plan.expert_units)])
        ahead = plan.settings.parallel.fsdp_plan.num_to_forward_prefetch
        compute = to_dtype(plan.mixed_precision.param_dtype).itemsize
        reduce = to_dtype(plan.mixed_precision.reduce_dtype).itemsize
        gathered = (root + (1 + ahead) * largest) * compute + largest * reduce
        param_bytes = sum(_local_bytes(p) for p in params)
        trainable = sum(_local_bytes(p) for p in params if p.requires_grad)
        moments = optimizer_plugin(cfg.training.optimizer).states_per_param
        return Simulation(
            world_size=world_size,
            rank=rank,
            layout=state.sizes.layout,
            process_groups=state.process_groups,
            params=param_bytes,
            grads=trainable,
            optimizer=int(moments * trainable),
            gathered=gathered,
            activations=acts + transient,
            device_memory=device_memory_gib * GiB,
        )
    finally:
        dist.destroy_process_group()


def run_simulation(
    cfg: MMConfig, world_size: int, device_memory_gib: float, *, as_json: bool = False
) -> None:
    """``mm check --simulate``: the checks of ``mm check`` that read no file (the run is usually planned
    away from its data), then one rank of ``world_size`` built on torch's fake process group
    (:func:`mm_core.simulate.simulate`); prints its bytes per rank, or one JSON object."""

    if device_memory_gib <= 0:
        raise ConfigError(f"mm check --device-memory: got {device_memory_gib:g} GiB; give a positive size")
    check_supported(cfg)
    import_plugins(cfg.training.plugin)
    resolve_sizes(cfg.parallel, world_size)  # a layout that does not fit the world: one line, nothing built
    optimizer_register.get(cfg.training.optimizer)
    result = simulate(cfg, world_size, device_memory_gib=device_memory_gib)
    if as_json:
        print(json.dumps(result.as_json(), indent=1))
        return
    for line in result.describe():
        print(line)
