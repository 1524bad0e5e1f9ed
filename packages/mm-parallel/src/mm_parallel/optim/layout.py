"""How a (possibly DTensor) Muon parameter is laid out across ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class MatrixLayout:
    """Where the matrices of one Muon parameter live.

    ``rows``/``cols`` are the GLOBAL matrix shape (the last two dims). ``num_local`` is how many
    matrices this rank holds slices of (1 for 2-D, the local expert count for 3-D). When ``group`` is
    None every local matrix is whole on this rank; otherwise each matrix is split along ``shard_dim``
    (0 = rows, 1 = cols of the matrix) in ``torch.chunk`` fashion over the ranks of ``group``.
    """

    rows: int
    cols: int
    num_local: int
    group: dist.ProcessGroup | None = None
    shard_dim: int = 0
    group_size: int = 1
    group_rank: int = 0

    @property
    def sharded(self) -> bool:
        return self.group is not None

    def split_sizes(self) -> list[int]:
        """Length along ``shard_dim`` held by each rank of ``group`` (torch.chunk rule)."""
        return chunk_sizes(self.rows if self.shard_dim == 0 else self.cols, self.group_size)

    def piece_numel(self, rank: int) -> int:
        """Elements of one matrix held by ``rank`` of ``group``."""
        length = self.split_sizes()[rank]
        return length * (self.cols if self.shard_dim == 0 else self.rows)

    def piece_shape(self, rank: int) -> tuple[int, int]:
        length = self.split_sizes()[rank]
        return (length, self.cols) if self.shard_dim == 0 else (self.rows, length)


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes that ``torch.chunk`` (and DTensor ``Shard``/FSDP2) give to each of ``parts`` ranks."""
    chunk = -(-length // parts) if parts else 0
    sizes = []
    for rank in range(parts):
        start = min(rank * chunk, length)
        sizes.append(min(start + chunk, length) - start)
    return sizes


def local_view(tensor: Tensor) -> Tensor:
    """The rank-local data of a DTensor (or the tensor itself), without autograd."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def describe(param: Tensor, name: str = "") -> MatrixLayout:
    """Work out the :class:`MatrixLayout` of a 2-D or 3-D Muon parameter."""
    where = f"parameter {name!r} " if name else "parameter "
    if param.ndim not in (2, 3):
        raise ValueError(
            f"Muon {where}has shape {tuple(param.shape)}; Muon groups take 2-D matrices or 3-D "
            "[experts, m, n] weights. Put it in a group with use_muon=False (AdamW) instead."
        )
    rows, cols = int(param.shape[-2]), int(param.shape[-1])
    local = local_view(param)
    num_local = 1 if param.ndim == 2 else int(local.shape[0])
    if not isinstance(param, DTensor):
        return MatrixLayout(rows, cols, num_local)
    matrix_shards: list[tuple[int, int]] = []
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if placement.is_partial():
            raise ValueError(
                f"Muon {where}has a Partial placement {param.placements}; parameters must be "
                "Shard or Replicate. Redistribute it before building the optimizer."
            )
        if type(placement) is not Shard:
            raise ValueError(
                f"Muon {where}uses placement {placement!r} on mesh dim {mesh_dim}; only plain "
                "Shard(d) and Replicate() are supported. Use a shard_placement_fn that returns Shard."
            )
        tensor_dim = placement.dim % param.ndim
        if param.ndim == 3 and tensor_dim == 0:
            continue  # whole experts per rank: no exchange needed along this mesh dim
        matrix_shards.append((mesh_dim, tensor_dim - (param.ndim - 2)))
    if not matrix_shards:
        return MatrixLayout(rows, cols, num_local)
    if len(matrix_shards) > 1:
        raise ValueError(
            f"Muon {where}is sharded over {len(matrix_shards)} mesh dims of its matrix "
            f"({param.placements} on mesh {param.device_mesh.mesh_dim_names}); at most one is "
            "supported. Flatten those mesh dims into one (e.g. dp_shard_cp) before fully_shard."
        )
    mesh_dim, shard_dim = matrix_shards[0]
    mesh = param.device_mesh
    group_size = mesh.size(mesh_dim)
    if group_size == 1:
        return MatrixLayout(rows, cols, num_local)
    group_rank = mesh.get_local_rank(mesh_dim)
    layout = MatrixLayout(
        rows,
        cols,
        num_local,
        mesh.get_group(mesh_dim),
        shard_dim,
        group_size,
        group_rank,
    )
    expected = layout.piece_shape(group_rank)
    actual = tuple(local.shape[-2:])
    if actual != expected:
        raise ValueError(
            f"Muon {where}of global shape {tuple(param.shape)} holds a local shard of shape "
            f"{tuple(local.shape)} on rank {dist.get_rank()}, but torch.chunk sharding over "
            f"{group_size} ranks gives {expected}. Only even/chunk-style sharding is supported."
        )
    return layout


def matrices_of(local: Tensor) -> Tensor:
    """Rank-local data viewed as a ``[num_local, a, b]`` batch."""
    return local.unsqueeze(0) if local.ndim == 2 else local


def check_dtype(param: Tensor, name: str = "") -> None:
    if torch.is_complex(param):
        raise ValueError(f"Muon does not support complex parameters ({name or tuple(param.shape)}).")
