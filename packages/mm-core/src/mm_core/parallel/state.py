"""Parallel sizes from the ``parallel`` block, the process group, and the device meshes built from them.

Layout: ``world = dp_replicate x dp_shard x cp``. FSDP shards parameters over ``dp_shard`` (x ``cp``);
``dp_replicate > 1`` gives HSDP; ``fully_shard_parallel_size: 1`` gives plain data parallelism (DDP).
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mm_core.config.schema import ParallelConfig
from mm_core.errors import ConfigError
from mm_parallel.device import detect_device_type, process_group_backend, set_local_device
from mm_parallel.teardown import wait_for_idle_threads


@dataclass(frozen=True)
class ParallelSizes:
    """Resolved sizes of every parallel dimension for one world size."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    ulysses: int = 1
    ring: int = 1
    ep: int = 1

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def efsdp(self) -> int:
        """Ranks one expert weight is sharded over: the expert mesh is ``efsdp x ep`` = ``dp_shard x cp``."""
        return self.fsdp // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel size: how many ranks read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks one parameter is sharded over."""
        return self.dp_shard * self.cp

    @property
    def layout(self) -> str:
        if self.world_size == 1:
            return "single process"
        if self.dp_shard == 1:
            return f"DDP x{self.dp_replicate}"
        if self.dp_replicate > 1:
            return f"HSDP {self.dp_replicate} replicas x {self.dp_shard} shards"
        return f"FSDP x{self.dp_shard}"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_sizes(cfg: ParallelConfig, world_size: int) -> ParallelSizes:
    """Check the ``parallel`` block against a world size; raise :class:`ConfigError` naming the key."""
    if world_size < 1:
        raise ConfigError(f"world size must be positive, got {world_size}")
    cp = cfg.ulysses_parallel_size * cfg.ring_attention_size
    if world_size % cp:
        key = "ulysses_parallel_size" if cfg.ring_attention_size == 1 else "ring_attention_size"
        raise ConfigError(
            f"parallel.{key}: got {getattr(cfg, key)}; the context-parallel size ulysses x ring = {cp} must "
            f"divide the world size {world_size}"
        )
    dp = world_size // cp
    if cfg.data_parallel_size != "auto" and cfg.data_parallel_size != dp:
        raise ConfigError(
            f"parallel.data_parallel_size: got {cfg.data_parallel_size}; with world size {world_size} and "
            f"context parallel {cp} it must be {dp} (or auto)"
        )
    fs = cfg.fully_shard_parallel_size
    if fs == "auto":
        fs = world_size
    if world_size % fs:
        raise ConfigError(
            f"parallel.fully_shard_parallel_size: got {fs}; must divide the world size {world_size} "
            f"(accepted: {_divisors(world_size)} or auto)"
        )
    if fs % cp and fs != 1:
        raise ConfigError(
            f"parallel.fully_shard_parallel_size: got {fs}; must be a multiple of the context-parallel "
            f"size {cp}"
        )
    dp_shard = 1 if fs == 1 else fs // cp
    if fs == 1 and cp > 1:
        raise ConfigError(
            f"parallel.fully_shard_parallel_size: got 1; with context parallel size {cp} the ranks of one "
            f"sequence must shard the parameters together (use a multiple of {cp})"
        )
    ep = cfg.expert_parallel_size
    if (dp_shard * cp) % ep:
        raise ConfigError(
            f"parallel.expert_parallel_size: got {ep}; must divide the FSDP shard group size {dp_shard * cp} "
            f"(experts are split over ranks carved from dp_shard x cp; accepted: {_divisors(dp_shard * cp)})"
        )
    efsdp = cfg.expert_fully_shard_parallel_size
    if efsdp != "auto" and efsdp != dp_shard * cp // ep:
        raise ConfigError(
            f"parallel.expert_fully_shard_parallel_size: got {efsdp}; with shard group {dp_shard * cp} and "
            f"expert parallel {ep} it must be {dp_shard * cp // ep} (or auto)"
        )
    return ParallelSizes(
        world_size=world_size,
        dp_replicate=dp // dp_shard,
        dp_shard=dp_shard,
        ulysses=cfg.ulysses_parallel_size,
        ring=cfg.ring_attention_size,
        ep=cfg.expert_parallel_size,
    )


@dataclass
class ParallelState:
    """This process's place in the job: sizes, device and meshes (passed explicitly, never global).

    ``world_mesh`` has the dimensions ``(dp_replicate, dp_shard, ring, ulysses)``; Ulysses is innermost so its
    all-to-all stays among neighbouring ranks. ``shard_mesh`` is ``(dp_replicate, dp_shard_cp)`` over the same
    ranks (what FSDP uses), and ``expert_mesh`` is ``(dp_replicate, efsdp, ep)``, carved from
    ``dp_shard x cp``. Each is built directly rather than by flattening, so no private mesh API is needed.
    """

    sizes: ParallelSizes
    rank: int
    local_rank: int
    device: torch.device
    world_mesh: DeviceMesh
    shard_mesh: DeviceMesh
    expert_mesh: DeviceMesh | None = None
    #: process groups this rank created for the meshes (the default group not counted)
    process_groups: int = 0

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """1-D ``(dp_shard_cp,)`` for FSDP, 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP and DDP."""
        if self.sizes.dp_replicate > 1:
            return self.shard_mesh
        return self.shard_mesh["dp_shard_cp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """``(ring, ulysses)``: the ranks that hold shards of one sequence."""
        return self.world_mesh["ring", "ulysses"]

    @property
    def dp_rank(self) -> int:
        """Index of this rank among the ranks that read different data."""
        coordinate = self.world_mesh.get_coordinate()
        assert coordinate is not None  # every rank is in the world mesh
        replicate, shard = coordinate[:2]
        return replicate * self.sizes.dp_shard + shard


def build_meshes(
    device_type: str, sizes: ParallelSizes, timeout: datetime.timedelta | None = None
) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh | None, int]:
    """The world mesh, the FSDP shard mesh and (with expert parallelism) the expert mesh, in the same rank
    order: within a replica, ranks are numbered ``dp_shard``-major, then ring, then Ulysses; and the number
    of process groups this rank created for them.

    Each rank holds one group per mesh dimension (:func:`_dimension_group`) and connects only those: at
    1,024 ranks a size-1 dimension is one local group per rank, not 1,024 collective ``new_group`` calls,
    and on NCCL each dimension is one ``split_group``, not a communicator split per group. A group shared
    by two meshes (e.g. ``dp_replicate``) is made once; a dimension spanning the world is the default group.
    Every group gets ``timeout`` (``parallel.timeout_minutes``; ``init_device_mesh`` would give its groups
    torch's default) and inherits the default group's backend string (``cuda:nccl,cpu:gloo``)."""
    groups: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}

    def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        return _mesh_of_groups(device_type, shape, names, groups, timeout)

    world = mesh(
        (sizes.dp_replicate, sizes.dp_shard, sizes.ring, sizes.ulysses),
        ("dp_replicate", "dp_shard", "ring", "ulysses"),
    )
    shard = mesh((sizes.dp_replicate, sizes.dp_shard * sizes.cp), ("dp_replicate", "dp_shard_cp"))
    expert = None
    if sizes.ep > 1:
        expert = mesh((sizes.dp_replicate, sizes.efsdp, sizes.ep), ("dp_replicate", "efsdp", "ep"))
    created = sum(1 for group in groups.values() if group is not dist.group.WORLD)
    return world, shard, expert, created


def _mesh_of_groups(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    groups: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup],
    timeout: datetime.timedelta | None,
) -> DeviceMesh:
    """A ``DeviceMesh`` over ranks ``0..world-1`` laid out row-major in ``shape``, from this rank's group of
    each dimension (``groups``: those made so far, by the dimension's partition of the ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = torch.arange(world).view(shape)
    mine = []
    for dim, size in enumerate(shape):
        rows = tuple(tuple(row) for row in layout.movedim(dim, -1).reshape(-1, size).tolist())
        if rows not in groups:  # the same decision on every rank: the partition, not this rank's row
            groups[rows] = _dimension_group(rows, rank, timeout)
        mine.append(groups[rows])
    return DeviceMesh.from_group(mine, device_type, mesh=layout, mesh_dim_names=names)


def _dimension_group(
    rows: tuple[tuple[int, ...], ...], rank: int, timeout: datetime.timedelta | None
) -> dist.ProcessGroup:
    """This rank's group among ``rows`` (one mesh dimension's groups, a partition of the world).

    - one row: the default group;
    - a device bound to the default group (cuda: NCCL connected eagerly): one ``split_group`` call by every
      rank for the whole dimension (one ``ncclCommSplit``; a ``new_group`` per row would be one split each);
    - rows of one rank: this rank's own 1-rank group, made locally (``use_local_synchronization``: no other
      rank takes part, and no name has to agree with another rank's);
    - otherwise a ``new_group`` for every row, in the same order on every rank, as torch requires; outside
      its row a rank returns at once (no connection is made and, with no bound device, no split).
    """
    world = dist.group.WORLD
    assert world is not None  # the default group exists (init_distributed)
    if len(rows) == 1:
        return world
    if getattr(world, "bound_device_id", None) is not None:
        split = dist.split_group(split_ranks=[list(row) for row in rows], timeout=timeout)
        assert split is not None  # the rows cover every rank
        return split
    if len(rows[0]) == 1:
        group = dist.new_group([rank], timeout=timeout, use_local_synchronization=True)
        assert group is not None
        return group
    mine = None
    for row in rows:
        group = dist.new_group(list(row), timeout=timeout)
        if rank in row:
            mine = group
    assert mine is not None  # the rows cover every rank
    return mine


def init_distributed(device_type: str | None = None, timeout_minutes: int = 30) -> tuple[int, int, int, str]:
    """Join the process group that torchrun set up (or a 1-process group); returns rank, local rank,
    world size and device type.

    A new group has the backends of :func:`mm_parallel.device.process_group_backend` (``cuda:nccl,cpu:gloo``
    on GPUs) and the given collective timeout. The local accelerator is bound first; on cuda it is also
    passed as ``device_id``, which torch documents as making NCCL connect eagerly (errors show at start-up)
    and create subgroups by ``ncclCommSplit``. A group that already exists is used as it is.

    At interpreter exit the process first waits for the communication threads to be idle
    (:func:`mm_parallel.teardown.wait_for_idle_threads`): without it, a gloo thread still releasing the last
    collective's tensors can abort a finished run (``terminate called without an active exception``)."""
    device_type = device_type or detect_device_type()
    atexit.unregister(wait_for_idle_threads)  # registered once however often this runs
    atexit.register(wait_for_idle_threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        device = set_local_device(device_type, local_rank)
        kwargs: dict[str, Any] = {
            "backend": process_group_backend(device_type),
            "timeout": datetime.timedelta(minutes=timeout_minutes),
            "device_id": device if device_type == "cuda" else None,
        }
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(**kwargs)
        else:
            dist.init_process_group(**kwargs, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), local_rank, dist.get_world_size(), device_type


def init_parallel_state(cfg: ParallelConfig, device_type: str | None = None) -> ParallelState:
    """Resolve sizes against the live process group and build the device meshes."""
    rank, local_rank, world, device_type = init_distributed(device_type, cfg.timeout_minutes)
    sizes = resolve_sizes(cfg, world)
    device = set_local_device(device_type, local_rank)
    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
    world_mesh, shard, expert, created = build_meshes(device_type, sizes, timeout)
    return ParallelState(
        sizes=sizes,
        rank=rank,
        local_rank=local_rank,
        device=device,
        world_mesh=world_mesh,
        shard_mesh=shard,
        expert_mesh=expert,
        process_groups=created,
    )
