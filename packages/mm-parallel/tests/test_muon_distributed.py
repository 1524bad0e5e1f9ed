"""Distributed Muon on real gloo process groups: FSDP2, HSDP, expert sharding, AdamW groups, DCP."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _muon_dist_utils import full_grads, reference_muon, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mm_parallel.optim import Muon

LR = 0.02
STEPS = 3
# tall, wide, square, rows not divisible by 2 or 4, fewer rows than ranks
DENSE = [(24, 8), (8, 24), (16, 16), (13, 7), (3, 10), (1, 6)]
# Experts with FSDP's default Shard(0): whole experts per rank (E=3 leaves a rank empty at W=4).
EXPERTS_DIM0 = [(4, 12, 6), (3, 10, 6)]
# Experts sharded inside the matrix (Shard(1)): exchanged expert by expert.
EXPERTS_DIM1 = [(2, 8, 5), (3, 4, 6)]  # FSDP2 allows only even Shard(1)
ADAMW = [(10,), (5, 4)]


class _Bag(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        for i, tensor in enumerate(tensors):
            self.register_parameter(f"w{i}", nn.Parameter(tensor.clone()))


def _init(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = g.clone()


def _check_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    initial: torch.Tensor,
    tol: float,
    what: str,
) -> None:
    """fp32: ``tol`` relative to the parameter; bf16: relative to the total update (bf16 tolerance)."""
    denom = (expected - initial).norm() if tol > 1e-4 else expected.norm()
    err = ((actual - expected).norm() / denom.clamp(min=1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g} (rank {dist.get_rank()})"


def _fsdp_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    shapes = DENSE + EXPERTS_DIM0 + EXPERTS_DIM1 + ADAMW
    initial = _init(shapes, seed=1)
    grads = full_grads(shapes, STEPS, seed=2)
    n0, n1 = (
        len(DENSE) + len(EXPERTS_DIM0),
        len(DENSE) + len(EXPERTS_DIM0) + len(EXPERTS_DIM1),
    )
    for ns_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 3e-2)):
        dense = _Bag(initial[:n0])
        experts = _Bag(initial[n0:n1])
        others = _Bag(initial[n1:])
        fully_shard(dense, mesh=mesh)
        fully_shard(experts, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        fully_shard(others, mesh=mesh)
        muon_params = list(dense.parameters()) + list(experts.parameters())
        adamw_params = list(others.parameters())
        assert all(isinstance(p, DTensor) for p in muon_params + adamw_params)
        opt = Muon(
            [
                {"params": muon_params},
                {
                    "params": adamw_params,
                    "use_muon": False,
                    "lr": 1e-2,
                    "weight_decay": 0.01,
                },
            ],
            lr=LR,
            ns_dtype=ns_dtype,
        )
        for step in range(STEPS):
            _set_grads(muon_params + adamw_params, grads[step])
            opt.step()
            assert opt.last_step_stats.all_to_all_calls == 2
        # every matrix orthogonalised exactly once in the shard group
        count = torch.tensor([opt.last_step_stats.matrices_orthogonalized])
        dist.all_reduce(count)
        expected_count = len(DENSE) + sum(s[0] for s in EXPERTS_DIM0 + EXPERTS_DIM1)
        assert count.item() == expected_count, (count.item(), expected_count)

        muon_shapes = shapes[:n1]
        muon_grads = [g[:n1] for g in grads]
        dense_ref = reference_muon(initial[:n1], muon_grads, lr=LR, dtype=ns_dtype)
        if ns_dtype == torch.bfloat16:  # the 2-D ones against torch.optim.Muon itself
            torch_params = [nn.Parameter(t.clone()) for t in initial[: len(DENSE)]]
            torch_opt = torch.optim.Muon(torch_params, lr=LR)
            for step in range(STEPS):
                for p, g in zip(torch_params, grads[step]):
                    p.grad = g.clone()
                torch_opt.step()
            dense_ref[: len(DENSE)] = [p.detach() for p in torch_params]
        for i, (p, ref) in enumerate(zip(muon_params, dense_ref)):
            _check_close(
                p.full_tensor(),
                ref,
                initial[i],
                tol,
                f"{ns_dtype} param {muon_shapes[i]}",
            )

        adamw_ref = [nn.Parameter(t.clone()) for t in initial[n1:]]
        torch_adamw = torch.optim.AdamW(adamw_ref, lr=1e-2, weight_decay=0.01)
        for step in range(STEPS):
            for p, g in zip(adamw_ref, grads[step][n1:]):
                p.grad = g.clone()
            torch_adamw.step()
        for p, ref in zip(adamw_params, adamw_ref):
            torch.testing.assert_close(p.full_tensor(), ref.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_matches_single_process(world: int) -> None:
    run_ranks(_fsdp_worker, world)


def _mesh_worker(rank: int, world: int) -> None:
    """HSDP (Replicate, Shard(0)), EP-only Shard(0) and EP x FSDP (Shard(1) on efsdp, Shard(0) on ep)."""
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    ep_1d = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ep_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dense_shapes = [(24, 8), (8, 24), (13, 7), (1, 6)]
    expert_shapes = [(4, 12, 6), (8, 5, 7)]
    shapes = dense_shapes + expert_shapes + expert_shapes
    initial = _init(shapes, seed=3)
    grads = full_grads(shapes, STEPS, seed=4)
    for ns_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 3e-2)):
        dense = _Bag(initial[: len(dense_shapes)])
        fully_shard(dense, mesh=hsdp)
        params = list(dense.parameters())
        assert params[0].placements == (Replicate(), Shard(0))
        for tensor in initial[len(dense_shapes) : len(dense_shapes) + len(expert_shapes)]:
            params.append(nn.Parameter(distribute_tensor(tensor, ep_1d, [Shard(0)], src_data_rank=None)))
        for tensor in initial[len(dense_shapes) + len(expert_shapes) :]:
            params.append(
                nn.Parameter(distribute_tensor(tensor, ep_2d, [Shard(1), Shard(0)], src_data_rank=None))
            )
        opt = Muon(params, lr=LR, ns_dtype=ns_dtype, adjust_lr_fn="match_rms_adamw")
        for step in range(STEPS):
            _set_grads(params, grads[step])
            opt.step()
        # HSDP shard group + efsdp group: two exchanges, two all-to-alls each; EP-only experts: none
        assert opt.last_step_stats.all_to_all_calls == 4, opt.last_step_stats
        ref = reference_muon(initial, grads, lr=LR, dtype=ns_dtype, adjust_lr_fn="match_rms_adamw")
        for i, (p, expected) in enumerate(zip(params, ref)):
            _check_close(
                p.full_tensor(),
                expected,
                initial[i],
                tol,
                f"{ns_dtype} {shapes[i]} {p.placements}",
            )


def test_hsdp_and_expert_parallel_match_single_process() -> None:
    run_ranks(_mesh_worker, 4)


def _backward_worker(rank: int, world: int) -> None:
    """A real forward/backward through fully_shard; grads come from FSDP2's reduce-scatter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 7), nn.ReLU(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def groups(m: nn.Module) -> list[dict]:
        return [
            {"params": [p for p in m.parameters() if p.ndim == 2]},
            {"params": [p for p in m.parameters() if p.ndim == 1], "use_muon": False},
        ]

    opt = Muon(groups(model), lr=LR, ns_dtype=torch.float32, nesterov=False)
    # reference: the same optimizer on the unsharded model (validated against torch in test_muon.py)
    ref_opt = Muon(groups(reference), lr=LR, ns_dtype=torch.float32, nesterov=False)
    data = torch.randn(16, 12, generator=torch.Generator().manual_seed(5))
    initial = [p.detach().clone() for p in reference.parameters()]
    for _ in range(STEPS):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(data).square().mean().backward()
            o.step()
    assert opt.last_step_stats.all_to_all_calls == 2
    for p, e, p0 in zip(model.parameters(), reference.parameters(), initial):
        _check_close(p.full_tensor(), e.detach(), p0, 1e-5, f"linear {tuple(p.shape)}")


def test_backward_through_fully_shard() -> None:
    run_ranks(_backward_worker, 2)


def _comm_count_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for count in (4, 32):
        bag = _Bag(_init([(9, 5)] * (count // 2) + [(6, 11)] * (count // 2), seed=count))
        fully_shard(bag, mesh=mesh)
        params = list(bag.parameters())
        opt = Muon(params, lr=LR)
        _set_grads(params, full_grads([tuple(p.shape) for p in params], 1, seed=7)[0])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        stats = opt.last_step_stats
        assert stats.all_to_all_calls == 2, (count, stats)
        # independent of our counter: the profiler sees exactly two all-to-all collectives
        names = [e.name for e in prof.events() if "all_to_all" in e.name or "alltoall" in e.name]
        collectives = [n for n in names if n.startswith("c10d::")]
        assert len(collectives) == 2, (count, names)


def test_all_to_all_calls_do_not_grow_with_parameter_count() -> None:
    run_ranks(_comm_count_worker, 2)


def _dcp_worker(rank: int, world: int, ckpt_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(13, 7), (8, 24), (3, 10, 6), (10,)]
    grads = full_grads(shapes, 3, seed=9)

    def build(seed: int) -> tuple[nn.Module, Muon]:
        model = _Bag(_init(shapes, seed))
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        opt = Muon(
            [
                {"params": params[:3]},
                {"params": params[3:], "use_muon": False, "lr": 3e-3},
            ],
            lr=LR,
            ns_dtype=torch.float32,
        )
        return model, opt

    model, opt = build(seed=10)
    for step in range(2):
        _set_grads(list(model.parameters()), grads[step])
        opt.step()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
    }
    dcp.save(state, checkpoint_id=ckpt_dir)
    saved_state = [
        {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in opt.state[p].items()}
        for p in model.parameters()
    ]
    _set_grads(list(model.parameters()), grads[2])
    opt.step()
    expected = [p.full_tensor() for p in model.parameters()]

    fresh, fresh_opt = build(seed=11)
    id_of = {id(p): i for i, p in enumerate(fresh.parameters())}
    state = {
        "model": get_model_state_dict(fresh),
        "optim": get_optimizer_state_dict(fresh, fresh_opt),
    }
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    first = fresh_opt.state[next(iter(fresh.parameters()))]
    assert isinstance(first["momentum_buffer"], DTensor) and first["step"].item() == 2
    for p in fresh.parameters():  # the loaded state is bit-identical to the saved one
        for key, value in fresh_opt.state[p].items():
            loaded = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(loaded, saved_state[id_of[id(p)]][key], rtol=0, atol=0)
    _set_grads(list(fresh.parameters()), grads[2])
    fresh_opt.step()
    # CPU BLAS results can depend on buffer alignment, so compare to float rounding, not bitwise
    for p, e in zip(fresh.parameters(), expected):
        torch.testing.assert_close(p.full_tensor(), e, rtol=1e-6, atol=1e-7)


def test_dcp_round_trip_then_step_equals_uninterrupted(tmp_path) -> None:
    run_ranks(_dcp_worker, 2, str(tmp_path / "ckpt"))
