"""``clip_grad_norm_`` with an optimizer's clipping policy (``scale_only``): the norm is over every gradient,
only the selected gradients are scaled; the same on DTensor gradients sharded over 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from _muon_dist_utils import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from mm_parallel.grad import clip_grad_norm_


def _params() -> list[nn.Parameter]:
    a, b, c = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.full((2, 2), 3.0), torch.full((2,), 4.0)  # c has no gradient
    return [a, b, c]


def test_scale_only_scales_the_selected_gradients_of_the_global_norm() -> None:
    a, b, c = _params()
    expected = (4 * 9 + 2 * 16) ** 0.5
    total = clip_grad_norm_([a, b, c], 1.0, scale_only=lambda p: p is b)
    assert total.item() == pytest.approx(expected)
    assert torch.equal(a.grad, torch.full((2, 2), 3.0))
    torch.testing.assert_close(b.grad, torch.full((2,), 4.0 / (expected + 1e-6)))
    # no policy: every gradient is scaled, by the same factor
    a, b, c = _params()
    clip_grad_norm_([a, b, c], 1.0)
    torch.testing.assert_close(a.grad, torch.full((2, 2), 3.0 / (expected + 1e-6)))
    torch.testing.assert_close(b.grad, torch.full((2,), 4.0 / (expected + 1e-6)))
    # only measuring (max_norm None): nothing changes, whatever the policy
    a, b, c = _params()
    assert clip_grad_norm_([a, b, c], None, scale_only=lambda p: True).item() == pytest.approx(expected)
    assert torch.equal(b.grad, torch.full((2,), 4.0))


def _dtensor_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = [torch.randn(4, 3), torch.randn(5), torch.randn(2, 2)]
    grads = [torch.randn_like(t) for t in full]
    placements = [[Shard(0)], [Replicate()], [Shard(1)]]
    params = []
    for t, g, pl in zip(full, grads, placements):
        p = nn.Parameter(distribute_tensor(t, mesh, pl))
        p.grad = distribute_tensor(g, mesh, pl)
        params.append(p)
    plain = nn.Parameter(torch.zeros(3))
    plain.grad = torch.full((3,), 2.0)
    params.append(plain)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in [*grads, plain.grad]]).double())
    keep = {id(params[0]), id(plain)}
    total = clip_grad_norm_(params, 0.5, scale_only=lambda p: id(p) in keep)
    assert abs(total.item() - expected.item()) <= 1e-6 * expected.item(), (total, expected)
    coef = 0.5 / (total + 1e-6)
    torch.testing.assert_close(params[0].grad.full_tensor(), grads[0] * coef)
    assert torch.equal(params[1].grad.full_tensor(), grads[1])
    assert torch.equal(params[2].grad.full_tensor(), grads[2])
    torch.testing.assert_close(plain.grad, torch.full((3,), 2.0) * coef)


def test_scale_only_on_dtensor_gradients_over_two_ranks() -> None:
    run_ranks(_dtensor_worker, 2)
