"""Single-process Muon: torch.optim.Muon parity, AdamW groups, eager state, parameter selection."""

from __future__ import annotations

import inspect

import pytest
import torch
from _muon_dist_utils import full_grads, reference_muon, relative_error
from torch import nn

from mm_parallel.optim import (
    Muon,
    classify_muon_params,
    muon_param_groups,
    zeropower_via_newtonschulz,
)
from mm_parallel.optim.exchange import assign_owners, plan_exchange
from mm_parallel.optim.layout import MatrixLayout, chunk_sizes

SHAPES = [(24, 8), (8, 24), (16, 16), (13, 7), (1, 6)]


def _params(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def _run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def test_defaults_match_torch_muon():
    ours = inspect.signature(Muon).parameters
    theirs = inspect.signature(torch.optim.Muon).parameters
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
    assert ours["ns_dtype"].default is torch.bfloat16


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_fp32_matches_reference(nesterov, adjust_lr_fn):
    params = _params([*SHAPES, (3, 10, 6)])
    initial = [p.detach().clone() for p in params]
    grads = full_grads([tuple(p.shape) for p in params], 3, seed=1)
    opt = Muon(
        params,
        lr=0.02,
        weight_decay=0.05,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=torch.float32,
    )
    _run(opt, params, grads)
    expected = reference_muon(
        initial,
        grads,
        lr=0.02,
        weight_decay=0.05,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
    )
    for p, e in zip(params, expected):
        assert relative_error(p.detach(), e) < 1e-6


def test_bf16_matches_torch_muon():
    params = _params(SHAPES)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    initial = [p.detach().clone() for p in params]
    grads = full_grads(SHAPES, 3, seed=2)
    _run(Muon(params, lr=0.02), params, grads)
    _run(torch.optim.Muon(reference, lr=0.02), reference, grads)
    for p, r, p0 in zip(params, reference, initial):
        assert relative_error(p.detach() - p0, r.detach() - p0) < 3e-2


def test_expert_weights_are_a_batch_of_matrices():
    params = _params([(4, 12, 6), (2, 5, 9)])
    initial = [p.detach().clone() for p in params]
    grads = full_grads([(4, 12, 6), (2, 5, 9)], 3, seed=3)
    _run(Muon(params, lr=0.02, ns_dtype=torch.float32), params, grads)
    for p, e in zip(params, reference_muon(initial, grads, lr=0.02)):
        assert relative_error(p.detach(), e) < 1e-6
    # lr adjustment uses the matrix shape [m, n], not [E, m]
    one = _params([(1, 12, 6)], seed=4)
    two = [nn.Parameter(one[0].detach()[0].clone())]
    g = torch.randn(1, 12, 6)
    one[0].grad, two[0].grad = g.clone(), g[0].clone()
    Muon(one, lr=0.1, ns_dtype=torch.float32).step()
    Muon(two, lr=0.1, ns_dtype=torch.float32).step()
    torch.testing.assert_close(one[0].detach()[0], two[0].detach())


def test_adamw_group_matches_torch_adamw():
    muon_params = _params([(6, 4)], seed=5)
    adamw_params = _params([(7,), (5, 3)], seed=6)
    reference = [nn.Parameter(p.detach().clone()) for p in adamw_params]
    opt = Muon(
        [
            {"params": muon_params},
            {
                "params": adamw_params,
                "use_muon": False,
                "lr": 3e-3,
                "betas": (0.8, 0.95),
                "weight_decay": 0.02,
            },
        ],
        lr=0.02,
    )
    torch_opt = torch.optim.AdamW(reference, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.02)
    for step_grads in full_grads([(7,), (5, 3)], 3, seed=7):
        for p, r, g in zip(adamw_params, reference, step_grads):
            p.grad, r.grad = g.clone(), g.clone()
        muon_params[0].grad = torch.ones(6, 4)
        opt.step()
        torch_opt.step()
    for p, r in zip(adamw_params, reference):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
    assert opt.param_groups[1]["eps"] == 1e-8 and opt.param_groups[0]["eps"] == 1e-7


def test_state_is_eager_and_round_trips():
    params = _params([(6, 4), (5,)])
    opt = Muon([{"params": params[:1]}, {"params": params[1:], "use_muon": False}])
    assert set(opt.state[params[0]]) == {"step", "momentum_buffer"}
    assert set(opt.state[params[1]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[params[0]]["step"].item() == 0
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    clone = Muon([{"params": params[:1]}, {"params": params[1:], "use_muon": False}])
    clone.load_state_dict(saved)
    assert clone.state[params[0]]["step"].item() == 1
    torch.testing.assert_close(
        clone.state[params[0]]["momentum_buffer"],
        opt.state[params[0]]["momentum_buffer"],
    )


def test_params_without_grad_are_skipped_and_closure_runs():
    params = _params([(6, 4), (4, 6)])
    before = params[1].detach().clone()
    opt = Muon(params)
    params[0].grad = torch.ones(6, 4)
    assert opt.step(lambda: 3.0) == 3.0
    torch.testing.assert_close(params[1].detach(), before)
    assert opt.state[params[1]]["step"].item() == 0


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(_params([(2, 2)]), adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(_params([(2, 2)]), ns_dtype=torch.int8)
    with pytest.raises(ValueError, match="amsgrad"):
        Muon([{"params": _params([(2,)]), "use_muon": False, "amsgrad": True}])


def test_newton_schulz_orthogonalises():
    x = torch.randn(3, 32, 16)
    out = zeropower_via_newtonschulz(x, ns_dtype=torch.float32)
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_chunk_sizes_follow_torch_chunk():
    for length in range(11):
        for parts in (1, 2, 3, 4):
            chunks = list(torch.arange(length).chunk(parts)) if length else []
            expected = [len(c) for c in chunks] + [0] * (parts - len(chunks))
            assert chunk_sizes(length, parts) == expected


def test_owner_assignment_balances_cost():
    costs = [64, 8, 8, 8, 8, 27, 27, 1000]
    owners = assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert loads == [1000, 150] or loads == [150, 1000]
    assert assign_owners(costs, 2) == owners  # deterministic
    layouts = [
        MatrixLayout(64, 64, 1, None, 0, 4, 1),
        MatrixLayout(8, 8, 3, None, 0, 4, 1),
    ]
    plan = plan_exchange(layouts)
    assert sum(len(items) for items in plan.by_owner) == 4
    assert max(plan.loads) == 64**3


class _TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 24)
        self.router = _Router()
        self.experts = nn.Parameter(torch.zeros(4, 16, 8))
        self.scale = nn.Parameter(torch.ones(()))


def test_classification_uses_module_types_and_metadata():
    model = _TinyMoE()
    model.layers[1].attn.weight.requires_grad_(False)
    plan = classify_muon_params(model, exclude_modules=[_Router], exclude=["layers.0.experts"])
    reasons = {d.name: (d.use_muon, d.reason) for d in plan.decisions}
    assert reasons["embed.weight"][0] is False and "output head" in reasons["embed.weight"][1]
    assert "lm_head.weight" not in reasons  # tied: one decision, listed as an alias
    assert next(d for d in plan.decisions if d.name == "embed.weight").aliases == ("lm_head.weight",)
    assert reasons["conv.weight"] == (False, "convolution kernel")
    assert reasons["norm.weight"] == (False, "normalization layer")
    assert reasons["layers.0.attn.bias"][0] is False
    assert reasons["layers.0.attn.weight"] == (True, "hidden 2-D weight")
    assert "layers.1.attn.weight" not in reasons  # frozen
    assert reasons["layers.0.router.proj.weight"] == (
        False,
        "in excluded module layers.0.router (_Router)",
    )
    assert reasons["layers.0.experts"] == (
        False,
        "excluded by pattern 'layers.0.experts'",
    )
    assert reasons["layers.1.experts"] == (
        True,
        "hidden 3-D weight (batch of matrices)",
    )
    assert reasons["layers.1.scale"][0] is False
    text = str(plan)
    assert "layers.1.experts" in text and "muon:" in text

    by_path = classify_muon_params(model, exclude_modules=["layers.*.router"])
    by_object = classify_muon_params(model, exclude_modules=[model.layers[0].router, model.layers[1].router])
    for other in (by_path, by_object):
        assert not any(d.use_muon for d in other.decisions if "router" in d.name)

    groups = muon_param_groups(model, exclude_modules=[_Router], adamw_lr=1e-3)
    assert [g["use_muon"] for g in groups] == [True, False] and groups[1]["lr"] == 1e-3
    opt = Muon(groups, lr=0.02)
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[0]["lr"] == 0.02


def test_unmatched_patterns_are_errors_with_suggestions():
    model = _TinyMoE()
    with pytest.raises(ValueError, match=r"layers\.0\.router"):
        classify_muon_params(model, exclude_modules=["layers.0.routr"])
    with pytest.raises(ValueError, match="matches no parameter"):
        classify_muon_params(model, exclude=["nothing.*"])
