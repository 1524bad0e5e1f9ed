"""Activation offload, FSDP2 CPU offload and execution-order prefetch on 2 gloo ranks: exact losses."""

from __future__ import annotations

import pytest
import torch
from _memory_model import assert_same, build, train_losses
from _muon_dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from mm_parallel.fsdp import apply_fsdp
from mm_parallel.memory import ActivationOffloader, ExecutionOrderPrefetch


def test_offload_moves_saved_activations_not_parameters():
    ids = torch.randint(0, 64, (2, 16))
    model = build()
    off = ActivationOffloader("cpu", copy_host_tensors=True, min_bytes=0)
    assert off.attach((f"layers.{i}", m) for i, m in enumerate(model.layers)) == 3
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model(ids).sum().backward()
    assert off.stats.tensors > 0 and off.stats.bytes > 0
    assert off.stats.prefetched_blocks == 2  # layers 1 and 0 fetched ahead of their backward
    assert off._blocks == []  # every block came back
    # parameters were kept (the weights of 6 linears + 2 norms per layer are saved by autograd)
    assert off.stats.kept_tensors >= 3 * 6
    grads = [p.grad.clone() for p in model.parameters()]
    ref = build()
    ref(ids).sum().backward()
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
    assert params == {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_offload_on_cpu_without_copy_keeps_tensors_in_place():
    model = build()
    off = ActivationOffloader("cpu")
    off.attach([("layers.0", model.layers[0])])
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    assert off.stats.tensors == 0 and off.stats.kept_tensors > 0


def test_prefetch_needs_fsdp_units():
    model = build()
    with pytest.raises(ValueError, match="not an FSDP2 module"):
        ExecutionOrderPrefetch(model, [("layers.0", model.layers[0])], num_forward=1)


def _worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    order = [2, 0, 1]  # layers run in an order that differs from their names

    def sharded(**kw):
        model = build(order=order)
        return apply_fsdp(model, mesh, list(model.layers), **kw)

    ref = train_losses(sharded(), rank)
    assert ref[-1] < ref[0]

    # activation offload (copying, so the pack/unpack path really runs on CPU) under FSDP2
    model = build(order=order)
    off = ActivationOffloader("cpu", copy_host_tensors=True)
    off.attach((f"layers.{i}", m) for i, m in enumerate(model.layers))
    apply_fsdp(model, mesh, list(model.layers))
    assert_same(ref, train_losses(model, rank), "activation offload")
    assert off.stats.tensors > 0 and off.stats.prefetched_blocks == 3 * 2

    # FSDP2 CPU offload policy: sharded parameters, gradients and optimizer states live on the host
    assert_same(ref, train_losses(sharded(cpu_offload=True), rank), "fsdp cpu_offload")

    # prefetch in the order the layers really ran (2, 0, 1), not by name
    model = sharded()
    names = [(f"layers.{i}", m) for i, m in enumerate(model.layers)]
    pf = ExecutionOrderPrefetch(model, names, num_forward=1, num_backward=2)
    assert_same(ref, train_losses(model, rank), "prefetch")
    assert pf.wired and pf.order == ["layers.2", "layers.0", "layers.1"]
    assert pf.forward_plan == {"layers.2": ["layers.0"], "layers.0": ["layers.1"], "layers.1": []}
    assert pf.backward_plan == {
        "layers.2": [],
        "layers.0": ["layers.2"],
        "layers.1": ["layers.0", "layers.2"],
    }
    # FSDP2 received it (its private state, read only to check the wiring)
    state = model.layers[2]._get_fsdp_state()
    assert state._states_to_forward_prefetch == [model.layers[0]._get_fsdp_state()]
    state = model.layers[1]._get_fsdp_state()
    assert state._states_to_backward_prefetch == [
        model.layers[0]._get_fsdp_state(),
        model.layers[2]._get_fsdp_state(),
    ]

    # hook groups: each layer with its MLP input projection as a second, nested unit (as a decoder layer with
    # its expert unit); a group gathers its units together and prefetch counts whole groups; pregather
    # all-gathers the root and the first group after every optimizer step
    model = build(order=order)
    apply_fsdp(model, mesh, [layer.up for layer in model.layers] + list(model.layers))
    names = [(f"layers.{i}.up", m.up) for i, m in enumerate(model.layers)]
    names += [(f"layers.{i}", m) for i, m in enumerate(model.layers)]
    groups = {n: n.removesuffix(".up") for n, _ in names}
    pf = ExecutionOrderPrefetch(model, names, num_forward=1, num_backward=1, groups=groups)
    pending = []

    def pregather():
        pf.pregather()
        # FSDP2's private state, read only to check that the all-gather was issued ahead
        pending.append(model.layers[2].up._get_fsdp_state()._fsdp_param_group._all_gather_result is not None)

    assert_same(ref, train_losses(model, rank, after_step=pregather), "hook groups + pregather")
    assert pending == [True, True, True]
    assert pf.group_order == [[f"layers.{i}", f"layers.{i}.up"] for i in order]
    assert pf.forward_plan["layers.2"] == ["layers.2.up", "layers.0", "layers.0.up"]
    assert pf.forward_plan["layers.2.up"] == []
    assert pf.backward_plan["layers.0"] == ["layers.0.up", "layers.2", "layers.2.up"]
    assert pf.backward_plan["layers.0.up"] == []
    with pytest.raises(ValueError, match="not one of the FSDP units"):
        ExecutionOrderPrefetch(model, names, groups={"layers.9": "layers"})


@pytest.mark.slow
def test_offload_and_prefetch_parity_fsdp2():
    run_ranks(_worker, 2, timeout=60)
