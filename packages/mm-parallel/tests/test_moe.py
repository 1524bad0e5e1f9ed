"""Expert parallelism on real gloo ranks: all-to-all dispatch with uneven splits, empty experts and empty
ranks, grouped expert products, FSDP2 over efsdp x ep with the gradient divide factor, and the global
router load-balancing loss. Everything is compared with a plain one-process loop over experts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _muon_dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mm_parallel.moe import (
    ExpertParallelExperts,
    expert_mlp,
    grouped_linear,
    grouped_mm_supported,
    load_balancing_loss,
    shard_experts,
)

E, H, INTER, K = 8, 16, 8, 2


def reference_experts(x, idx, w, gate_up, down):
    """transformers' fused-experts loop, written out."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * w[tok, pos, None]
        out.index_add_(0, tok, y)
    return out


def make_inputs(rank: int, tokens: int, skew: bool):
    """Routing where experts 1 and 6 never receive a token and expert 0 gets most of them."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, H, generator=g)
    if skew:
        choices = torch.tensor([0, 0, 0, 2, 3, 4, 5, 7])
        idx = choices[torch.randint(0, len(choices), (tokens, K), generator=g)]
        idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 3) % E, idx[:, 1])
        idx[idx == 1] = 0
        idx[idx == 6] = 7
    else:
        idx = torch.argsort(torch.rand(tokens, E, generator=g), dim=-1)[:, :K]
    w = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)
    return x, idx, w


def full_weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.3, torch.randn(E, H, INTER, generator=g) * 0.3


@pytest.mark.parametrize("counts", [[3, 0, 5, 0], [0, 0, 0, 0], [4, 4, 4, 4]])
def test_grouped_mm_and_loop_agree(counts):
    torch.manual_seed(0)
    w = torch.randn(4, 8, 16, requires_grad=True)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    c = torch.tensor(counts)
    outs = []
    for grouped in (True, False):
        if grouped and not grouped_mm_supported(x, w):
            pytest.skip("grouped_mm is not available in this torch build")
        y = grouped_linear(x, w, c, use_grouped_mm=grouped)
        (y * y).sum().backward()
        outs.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad, w.grad = None, None
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_unaligned_sizes_fall_back_to_the_loop():
    x, w = torch.randn(5, 6), torch.randn(3, 10, 6)
    assert not grouped_mm_supported(x, w)
    y = expert_mlp(
        torch.randn(5, 6),
        torch.randn(3, 10, 6),
        torch.randn(3, 6, 5),
        torch.tensor([2, 0, 3]),
        lambda gate, up: F.silu(gate) * up,
    )
    assert y.shape == (5, 6)


def test_one_process_adapter_equals_reference():
    gate_up, down = full_weights()
    x, idx, w = make_inputs(0, 13, skew=True)
    ad = ExpertParallelExperts(gate_up, down, F.silu)
    torch.testing.assert_close(
        ad(x, idx, w), reference_experts(x, idx, w, gate_up, down), rtol=1e-5, atol=1e-6
    )


def _reference_load_balancing(logits_list, top_k, mask=None):
    """transformers' load_balancing_loss_func on concatenated layers, written out."""
    probs = torch.cat([torch.softmax(lg, -1) for lg in logits_list])
    sel = torch.topk(probs, top_k, -1).indices
    onehot = F.one_hot(sel, probs.shape[-1]).float().sum(1)
    m = torch.ones(probs.shape[0]) if mask is None else mask.float().repeat(len(logits_list))
    f = (onehot * m[:, None]).sum(0) / m.sum()
    p = (probs * m[:, None]).sum(0) / m.sum()
    return probs.shape[-1] * (f * p).sum()


def test_load_balancing_loss_single_process():
    torch.manual_seed(1)
    logits = [torch.randn(10, E, requires_grad=True) for _ in range(3)]
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1])
    for m in (None, mask):
        share, value = load_balancing_loss(logits, E, K, m)
        ref = _reference_load_balancing(logits, K, m)
        torch.testing.assert_close(value, ref.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(share.detach(), ref.detach(), rtol=1e-6, atol=0)
        (g_share,) = torch.autograd.grad(share, logits[0])
        (g_ref,) = torch.autograd.grad(ref, logits[0])
        torch.testing.assert_close(g_share, g_ref, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------------------------ distributed
TOKENS = [7, 0, 12, 3]  # rank 1 sends no tokens at all


def _dispatch(rank, world, ep, skew, dispatcher):
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    gate_up, down = full_weights()
    inputs = [make_inputs(r, TOKENS[r], skew) for r in range(world)]
    ad = ExpertParallelExperts(gate_up, down, F.silu, mesh["ep"], dispatcher=dispatcher)
    x, idx, w = inputs[rank]
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    out = ad(x, idx, w)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))
    (out * target).sum().backward()
    # reference: one process, every rank's tokens, full weights
    ref_gu, ref_dn = gate_up.clone().requires_grad_(True), down.clone().requires_grad_(True)
    total = 0.0
    for r, (xr, ir, wr) in enumerate(inputs):
        xr = xr.clone().requires_grad_(True)
        wr = wr.clone().requires_grad_(True)
        o = reference_experts(xr, ir, wr, ref_gu, ref_dn)
        total = total + (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + r))).sum()
        if r == rank:
            mine = (o, xr, wr)
    total.backward()
    o, xr, wr = mine
    torch.testing.assert_close(out, o, rtol=1e-5, atol=1e-6)
    if TOKENS[rank]:
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)
    else:
        assert out.shape == (0, H) and x.grad.shape == (0, H)
    # each ep rank holds the gradient of its experts, summed over the ep group's tokens; summing it over the
    # efsdp ranks (what FSDP does) gives the reference gradient
    lo = ad.local_expert_ids
    for p, ref in ((ad.gate_up_proj, ref_gu), (ad.down_proj, ref_dn)):
        assert isinstance(p, DTensor)
        g = p.grad.to_local().clone()
        dist.all_reduce(g, group=mesh["efsdp"].get_group())
        torch.testing.assert_close(g, ref.grad[lo.start : lo.stop], rtol=1e-5, atol=1e-6)
    if dispatcher == "alltoall":
        assert ad.comm_timer.calls == 5  # counts; dispatch + combine, forward and backward
    else:  # gathers of x, weights and expert ids + reduce-scatter; backward: 2 reduce-scatters + 1 gather
        assert ad.comm_timer.calls == 7


@pytest.mark.parametrize(
    ("ep", "skew", "dispatcher"),
    [
        (2, True, "alltoall"),
        (2, False, "alltoall"),
        (4, True, "alltoall"),
        (4, False, "alltoall"),
        (2, True, "allgather"),
        (4, True, "allgather"),
    ],
)
def test_expert_dispatch_matches_one_process(ep, skew, dispatcher):
    """Both dispatchers, with ranks of 7, 0, 12 and 3 tokens (so the all-gather pads) and empty experts."""
    run_ranks(_dispatch, 4, ep, skew, dispatcher)


def test_unknown_dispatcher_is_refused():
    gate_up, down = full_weights()
    with pytest.raises(ValueError, match="dispatcher: got 'mc2'"):
        ExpertParallelExperts(gate_up, down, F.silu, dispatcher="mc2")


def _fsdp_experts(rank, world, ep):
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    gate_up, down = full_weights()
    inputs = [make_inputs(r, TOKENS[r], True) for r in range(world)]
    ad = ExpertParallelExperts(gate_up, down, F.silu, mesh["ep"])
    shard_experts([ad], mesh["efsdp"], gradient_divide_factor=world)
    assert ad.gate_up_proj.device_mesh.mesh_dim_names == ("efsdp", "ep")
    x, idx, w = inputs[rank]
    out = ad(x, idx, w)
    # the trainer's convention: every rank's loss is multiplied by the number of ranks FSDP averages over.
    # (A wrong divide factor is off by a factor of ep or more; the tolerance only absorbs summation order.)
    (out.square().sum() * world).backward()
    ref_gu, ref_dn = gate_up.clone().requires_grad_(True), down.clone().requires_grad_(True)
    sum(reference_experts(*inp, ref_gu, ref_dn).square().sum() for inp in inputs).backward()
    torch.testing.assert_close(ad.gate_up_proj.grad.full_tensor(), ref_gu.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ad.down_proj.grad.full_tensor(), ref_dn.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ep", [2, 4])
def test_fully_sharded_experts_get_one_process_gradients(ep):
    run_ranks(_fsdp_experts, 4, ep)


def _global_aux(rank, world):
    torch.manual_seed(3)
    all_logits = [torch.randn(sum(TOKENS), E) for _ in range(2)]
    start = sum(TOKENS[:rank])
    mine = [lg[start : start + TOKENS[rank]].clone().requires_grad_(True) for lg in all_logits]
    share, value = load_balancing_loss(mine, E, K)
    ref_logits = [lg.clone().requires_grad_(True) for lg in all_logits]
    ref = _reference_load_balancing(ref_logits, K)
    ref.backward()
    torch.testing.assert_close(value, ref.detach(), rtol=1e-6, atol=0)
    total = share.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-6, atol=0)
    share.backward()
    for m, r in zip(mine, ref_logits):
        torch.testing.assert_close(m.grad, r.grad[start : start + TOKENS[rank]], rtol=1e-5, atol=1e-8)


def test_load_balancing_loss_reduced_over_ranks_equals_one_process():
    run_ranks(_global_aux, 4)
