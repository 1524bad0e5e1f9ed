"""The expert-parallel adapter: a module that takes the place of a model's fused experts module.

A mixture-of-experts block in transformers (Qwen3-MoE, Qwen3.5-MoE, ...) calls
``experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])`` on a module
that holds all experts' weights as two 3-D parameters, ``gate_up_proj [experts, 2 * inter, hidden]`` and
``down_proj [experts, hidden, inter]``. :class:`ExpertParallelExperts` has the same call, the same parameter
names and global shapes (so checkpoints and exports are unchanged), but each rank of the ``ep`` mesh holds
only its ``experts / ep`` consecutive experts (a DTensor ``Shard(0)`` on ``ep``). Tokens travel to the rank
of their expert with an all-to-all, are computed there with grouped matrix products, and come back the
same way (``dispatcher="alltoall"``), or every rank's tokens are all-gathered, each rank computes its own
experts' share and the shares are reduce-scattered back (``dispatcher="allgather"``, see
:mod:`mm_parallel.moe.allgather`). It is installed by replacing the child module in the model's own
module tree (:func:`swap_experts`); nothing in transformers is patched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mm_parallel.device import group_backend
from mm_parallel.memory.recompute import read_once
from mm_parallel.moe.all_to_all import CommTimer, all_to_all, exchange_counts
from mm_parallel.moe.allgather import allgather_experts
from mm_parallel.moe.grouped import expert_mlp, tokens_per_expert

#: how tokens reach the ranks of their experts (``parallel.ep_plan.dispatcher``)
DISPATCHERS = ("alltoall", "allgather")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(nn.Module):
    """Fused experts split by expert over ``ep_mesh`` (or all local when ``ep_mesh`` is None)."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        ep_mesh: DeviceMesh | None = None,
        *,
        use_grouped_mm: bool | None = None,
        dispatcher: str = "alltoall",
    ) -> None:
        """``gate_up_proj``/``down_proj`` are the FULL fused weights (any device, meta included); this rank
        keeps its slice of experts. ``act_fn`` is the gate's activation of the default :meth:`glu` (None only
        for a subclass whose :meth:`glu` needs none). ``dispatcher`` is one of :data:`DISPATCHERS`."""
        super().__init__()
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher: got {dispatcher!r}; expected one of {', '.join(DISPATCHERS)}")
        self.dispatcher = dispatcher
        num_experts = int(gate_up_proj.shape[0])
        ep = ep_mesh.size() if ep_mesh is not None else 1
        if ep_mesh is not None and ep_mesh.ndim != 1:
            raise ValueError(f"ExpertParallelExperts needs a 1-D ep mesh, got {ep_mesh.ndim}-D")
        if num_experts % ep:
            raise ValueError(
                f"{num_experts} experts cannot be split evenly over an expert-parallel size of {ep}; "
                "choose an expert-parallel size that divides the number of experts"
            )
        self.num_experts = num_experts
        self.ep_size = ep
        self.ep_rank = ep_mesh.get_local_rank() if ep_mesh is not None else 0
        self.num_local_experts = num_experts // ep
        self.ep_mesh = ep_mesh
        self.act_fn = act_fn
        self.use_grouped_mm = use_grouped_mm
        self.comm_timer = CommTimer()
        self.gate_up_proj = nn.Parameter(self._split(gate_up_proj.detach()))
        self.down_proj = nn.Parameter(self._split(down_proj.detach()))

    @classmethod
    def from_fused(
        cls,
        experts: nn.Module,
        ep_mesh: DeviceMesh | None = None,
        *,
        use_grouped_mm: bool | None = None,
        dispatcher: str = "alltoall",
    ) -> ExpertParallelExperts:
        """Adapt a module with ``gate_up_proj``, ``down_proj`` and ``act_fn`` (transformers' experts; a
        subclass with its own :meth:`glu` needs no ``act_fn``), then :meth:`adopt` its other settings."""
        needed = ("gate_up_proj", "down_proj") + (("act_fn",) if cls.glu is ExpertParallelExperts.glu else ())
        missing = [a for a in needed if not hasattr(experts, a)]
        if missing:
            raise TypeError(
                f"{type(experts).__name__} has no {', '.join(missing)}; expert parallelism needs fused 3-D "
                "expert weights gate_up_proj [experts, 2*inter, hidden], down_proj [experts, hidden, inter]"
            )
        # nn.Module.__getattr__ is typed Tensor | Module; the attributes exist (checked above)
        gate_up = cast(torch.Tensor, experts.gate_up_proj)
        down = cast(torch.Tensor, experts.down_proj)
        act_fn = cast("Callable[[torch.Tensor], torch.Tensor] | None", getattr(experts, "act_fn", None))
        adapter = cls(gate_up, down, act_fn, ep_mesh, use_grouped_mm=use_grouped_mm, dispatcher=dispatcher)
        adapter.adopt(experts)
        adapter.gate_up_proj.requires_grad_(gate_up.requires_grad)
        adapter.down_proj.requires_grad_(down.requires_grad)
        return adapter

    def adopt(self, experts: nn.Module) -> None:
        """Take the settings of the experts module this adapter replaces, besides its weights and
        ``act_fn`` (called by :meth:`from_fused`). None here; a subclass reads e.g. a clamp bound."""

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The experts' gated unit, ``down(glu(gate(x), up(x)))``: ``act_fn(gate) * up`` (SwiGLU and its
        kin). A model whose experts gate differently (a clamp, a shifted up half) overrides this method and
        keeps everything else: routing, both dispatchers, grouped products, sharding."""
        if self.act_fn is None:
            raise TypeError(f"{type(self).__name__} has no act_fn for the default glu(gate, up)")
        return self.act_fn(gate) * up

    def _split(self, full: torch.Tensor) -> torch.Tensor:
        if self.ep_mesh is None:
            return full
        n = self.num_local_experts
        local = full[self.ep_rank * n : (self.ep_rank + 1) * n].contiguous()
        return DTensor.from_local(
            local, self.ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )

    @property
    def local_expert_ids(self) -> range:
        """Global indices of the experts this rank computes."""
        start = self.ep_rank * self.num_local_experts
        return range(start, start + self.num_local_experts)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) initialisation, as transformers initialises fused experts."""
        for p in (self.gate_up_proj, self.down_proj):
            _local(p).normal_(0.0, std)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, ep={self.ep_size}, local experts {self.local_expert_ids.start}.."
            f"{self.local_expert_ids.stop - 1}, dispatcher={self.dispatcher}"
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Same call and result as transformers' fused experts: ``[tokens, hidden]`` out."""
        if self.ep_size > 1 and self.dispatcher == "allgather":
            assert self.ep_mesh is not None  # ep_size > 1
            return allgather_experts(
                hidden_states,
                top_k_index,
                top_k_weights,
                _local(self.gate_up_proj),
                _local(self.down_proj),
                self.glu,
                first_expert=self.local_expert_ids.start,
                group=self.ep_mesh.get_group(),
                timer=self.comm_timer,
                use_grouped_mm=self.use_grouped_mm,
            )
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert (hence by destination rank)
        token_of = order // k
        counts = tokens_per_expert(flat, self.num_experts)
        x = hidden_states[token_of]
        w1, w2 = _local(self.gate_up_proj), _local(self.down_proj)
        if self.ep_size == 1:
            y = expert_mlp(x, w1, w2, counts, self.glu, use_grouped_mm=self.use_grouped_mm)
        else:
            y = self._dispatch_compute_combine(x, counts, w1, w2)
        weights = top_k_weights.reshape(-1)[order].to(y.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, (y * weights[:, None]).to(out.dtype))

    def _dispatch_compute_combine(
        self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        assert self.ep_mesh is not None  # only called when ep_size > 1
        group = self.ep_mesh.get_group()
        ep, n_local = self.ep_size, self.num_local_experts
        send = counts.view(ep, n_local)
        # recv[s, e]: rows that source rank s sends to my local expert e
        recv = exchange_counts(send, group, self.comm_timer)
        # the exchange's split sizes (and the local experts' row counts, for the loop of plain products) in
        # this layer's one host sync; a recomputed forward reuses them (read_once), the backward keeps them
        sizes = read_once(torch.cat([send.sum(1), recv.sum(1), recv.sum(0)]))
        in_splits, out_splits, local_counts = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
        received = all_to_all(x, out_splits, in_splits, group, self.comm_timer)
        # received rows are ordered (source rank, local expert); regroup them by local expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(n_local, device=x.device).repeat(ep), recv.reshape(-1), output_size=sum(out_splits)
        )
        perm = torch.argsort(expert_of_row, stable=True)
        y = expert_mlp(
            received[perm],
            w1,
            w2,
            recv.sum(0),
            self.glu,
            use_grouped_mm=self.use_grouped_mm,
            host_counts=local_counts,
        )
        y = y[torch.argsort(perm)]
        return all_to_all(y, in_splits, out_splits, group, self.comm_timer)


def swap_experts(
    model: nn.Module,
    names: Sequence[str],
    ep_mesh: DeviceMesh | None,
    *,
    adapter: type[ExpertParallelExperts] = ExpertParallelExperts,
    use_grouped_mm: bool | None = None,
    dispatcher: str = "alltoall",
) -> dict[str, ExpertParallelExperts]:
    """Replace each named fused-experts module of ``model`` with ``adapter.from_fused(module, ep_mesh)``
    (through ``setattr`` on its parent), before FSDP. Returns the new modules by name."""
    modules = dict(model.named_modules())
    out: dict[str, ExpertParallelExperts] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        new = adapter.from_fused(modules[name], ep_mesh, use_grouped_mm=use_grouped_mm, dispatcher=dispatcher)
        setattr(modules[parent_name] if parent_name else model, child, new)
        out[name] = new
    return out


def expert_placement_fn(efsdp_size: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP placement for expert weights: ``Shard(1)`` (rows of every expert matrix) when it divides evenly,
    so that each (efsdp, ep) shard is a plain ``Shard`` layout that Muon and DCP take as is; ``Shard(0)``
    otherwise."""

    def place(param: nn.Parameter) -> Shard:
        return Shard(1) if param.ndim == 3 and param.shape[1] % efsdp_size == 0 else Shard(0)

    return place


def shard_experts(
    experts: Sequence[nn.Module],
    mesh: DeviceMesh,
    gradient_divide_factor: float,
    **fully_shard_kwargs: Any,
) -> None:
    """``fully_shard`` each expert module over ``mesh`` (``(efsdp,)`` or ``(dp_replicate, efsdp)``), with
    gradients divided by ``gradient_divide_factor``.

    The training loss is scaled for FSDP's average over every data-parallel rank (the ``world`` factor);
    expert gradients are reduced over fewer ranks (``world / ep``) after the all-to-all has already summed
    the contributions of the ``ep`` group, so dividing them by the same world factor gives every expert
    exactly the gradient one process would compute.
    """
    from torch.distributed.fsdp import fully_shard

    efsdp = mesh.size(mesh.ndim - 1)
    # the backend of the mesh's device tensors: "nccl" also under "cuda:nccl,cpu:gloo"
    premul_sum = group_backend(mesh.get_group(mesh.ndim - 1), mesh.device_type) == "nccl"
    for module in experts:
        sharded = fully_shard(
            module, mesh=mesh, shard_placement_fn=expert_placement_fn(efsdp), **fully_shard_kwargs
        )
        sharded.set_gradient_divide_factor(float(gradient_divide_factor))
        if efsdp > 1 and not premul_sum:
            # a custom factor reduce-scatters with PREMUL_SUM, which only NCCL has: sum, then divide. (With
            # one efsdp rank FSDP divides while copying instead; forcing sums there would divide twice.)
            sharded.set_force_sum_reduction_for_comms(True)


def expert_owner(expert: int, num_experts: int, ep: int) -> int:
    """The ep rank that computes ``expert``."""
    return expert // math.ceil(num_experts / ep)


def total_comm_seconds(model: nn.Module) -> tuple[float, int]:
    """Sum of dispatcher communication time (all-to-all, or all-gather and reduce-scatter) and call count
    over every adapter in ``model`` (see :class:`CommTimer`)."""
    seconds, calls = 0.0, 0
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            seconds += m.comm_timer.seconds
            calls += m.comm_timer.calls
    return seconds, calls
