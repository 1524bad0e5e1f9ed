"""MiniMax-M3-VL (``minimax_m3_vl``) from a tiny config: its default plans match real modules; a forward with
an image returns a finite loss and every trainable parameter gets a gradient; the indexer is frozen by
policy (and would get no gradient if it were not), also after ``from_pretrained``; a micro-batch without
images still runs the vision tower; meta-device init with the expert-parallel adapters swapped in
initialises every tensor; the adapter computes what transformers' experts compute, in one process and on
two gloo ranks with both dispatchers."""

from __future__ import annotations

import logging
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import START_METHOD
from _tiny import MINIMAX_M3_TEXT, MINIMAX_M3_VISION
from torch.distributed.device_mesh import init_device_mesh
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts, MiniMaxM3VLIndexer

from mm_core.config.loader import validate_config
from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub, plan_of
from mm_core.parallel.apply import materialize_meta, shard_model
from mm_core.parallel.state import init_parallel_state
from mm_core.tasks.building import build_settings, prepare_and_plan
from mm_models_minimax.minimax_m3_vl import INDEXER, MiniMaxM3ExpertParallelExperts, MiniMaxM3VLForTraining
from mm_parallel.patterns import match_modules

IMAGE, VIDEO = 120, 121
#: two decoder layers: 0 = full attention + dense MLP, 1 = sparse attention (indexer) + MoE (4 experts,
#: top-2, one shared expert); 20-token sequences span 5 key blocks of 4, of which each query keeps 2
TEXT = {**MINIMAX_M3_TEXT, "vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2}
VISION = dict(MINIMAX_M3_VISION)
OVERRIDES = {
    "text_config": TEXT,
    "vision_config": VISION,
    "image_token_index": IMAGE,
    "video_token_index": VIDEO,
    "projector_hidden_size": 32,
}
ARGS = ModelConfig(model_id="minimax_m3_vl", from_scratch=True, config_overrides=OVERRIDES)
EXPERTS = "model.language_model.layers.{*}.mlp.experts"


def image_batch() -> dict[str, torch.Tensor]:
    """Two rows of 20 tokens; row 0 holds one 56x56 image (grid 1x4x4: 16 patches -> 4 image tokens)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 20), generator=g)
    ids[0, 2:6] = IMAGE
    return {
        "input_ids": ids,
        "labels": ids,
        "pixel_values": torch.randn(16, 3 * 2 * 14 * 14, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


def indexer_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {
        f"{name}.{pname}": p
        for name, m in model.named_modules()
        if isinstance(m, MiniMaxM3VLIndexer)
        for pname, p in m.named_parameters()
    }


def test_default_plans_match_modules():
    model = ModelHub.build(ARGS)
    assert type(model) is MiniMaxM3VLForTraining
    plan = plan_of(model)
    units = match_modules(model, plan.fsdp_units)
    assert units["model.vision_tower.layers.{*}"] == [
        "model.vision_tower.layers.0",
        "model.vision_tower.layers.1",
    ]
    assert units["model.language_model.layers.{*}"] == [
        "model.language_model.layers.0",
        "model.language_model.layers.1",
    ]
    assert match_modules(model, plan.recompute_units) == units
    assert match_modules(model, plan.expert_modules)[EXPERTS] == ["model.language_model.layers.1.mlp.experts"]
    experts = model.get_submodule("model.language_model.layers.1.mlp.experts")
    assert isinstance(experts, MiniMaxM3VLExperts)  # the fused layout mm's adapter takes
    assert tuple(experts.gate_up_proj.shape) == (4, 2 * 16, 32)
    assert tuple(experts.down_proj.shape) == (4, 32, 16)
    shared = model.get_submodule("model.language_model.layers.1.mlp.shared_experts")
    assert shared.gate_up_proj.weight.ndim == 2  # the shared expert stays a dense MLP in its layer
    assert plan.expert_adapter is MiniMaxM3ExpertParallelExperts
    excluded = match_modules(model, plan.muon_exclude_modules)
    assert excluded["model.vision_tower.embeddings.proj"] == ["model.vision_tower.embeddings.proj"]
    assert excluded["model.language_model.layers.{*}.mlp.gate"] == ["model.language_model.layers.1.mlp.gate"]
    assert plan.cp_split_module is not None
    model.get_submodule(plan.cp_split_module)
    assert list(match_modules(model, [INDEXER])[INDEXER]) == [
        "model.language_model.layers.1.self_attn.indexer"
    ]


def test_indexer_is_frozen_with_one_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="mm_models_minimax"):
        model = ModelHub.build(ARGS)
    frozen = indexer_params(model)
    assert sorted(frozen) == [
        "model.language_model.layers.1.self_attn.indexer.k_norm.weight",
        "model.language_model.layers.1.self_attn.indexer.k_proj.weight",
        "model.language_model.layers.1.self_attn.indexer.q_norm.weight",
        "model.language_model.layers.1.self_attn.indexer.q_proj.weight",
    ]
    assert not any(p.requires_grad for p in frozen.values())
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == list(frozen)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("mm_models_minimax")]
    n = sum(p.numel() for p in frozen.values())
    assert len(lines) == 1 and lines[0].startswith(
        f"minimax_m3_vl: {n} indexer parameters (4 tensors in 1 sparse-attention layer, "
    )
    assert "frozen" in lines[0] and INDEXER in lines[0]


def test_forward_with_image_trains_every_trainable_parameter():
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    model.train()
    out = model(**image_batch(), use_cache=False)
    assert out.logits.shape == (2, 20, 128)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    assert model.model.vision_tower.embeddings.proj.weight.grad.abs().sum() > 0
    assert model.model.language_model.layers[1].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    assert all(p.grad is None for p in indexer_params(model).values())


def test_an_unfrozen_indexer_would_get_no_gradient():
    """Why the policy exists: the indexer's output is block indices, so even when it is made trainable the
    loss gives it no gradient (a silent parameter without gradients, which the policy forbids)."""
    model = ModelHub.build(ARGS)
    model.train()
    params = indexer_params(model)
    for p in params.values():
        p.requires_grad_(True)
    model(**image_batch(), use_cache=False).loss.backward()
    assert all(p.grad is None for p in params.values())


def test_from_pretrained_keeps_the_indexer_frozen(tmp_path):
    """Loading replaces parameters with new ones that require gradients; the class freezes them again."""
    ModelHub.build(ARGS).save_pretrained(tmp_path)
    loaded = ModelHub.build(ModelConfig(model_id="minimax_m3_vl", model_name_or_path=str(tmp_path)))
    assert isinstance(loaded, MiniMaxM3VLForTraining)
    params = indexer_params(loaded)
    assert params and not any(p.requires_grad for p in params.values())
    assert sum(not p.requires_grad for p in loaded.parameters()) == len(params)


def test_micro_batch_without_images_runs_the_vision_tower():
    torch.manual_seed(0)
    model = ModelHub.build(ARGS)
    ids = torch.randint(3, 100, (2, 12))
    model.train()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    vision = [p for n, p in model.named_parameters() if n.startswith(("model.vision_tower", "model.multi_"))]
    assert vision and all(p.grad is not None and p.grad.abs().sum() == 0 for p in vision)
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    with torch.no_grad():  # the idle tower adds exactly 0 and is skipped without gradients
        plain = model(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, plain.loss, rtol=0, atol=0)


@pytest.fixture
def one_rank_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_meta_init_initialises_routers_and_expert_adapters(one_rank_group):
    cfg = validate_config(
        {
            "parallel": {"ep_plan": {"apply_modules": [EXPERTS]}},  # swap the adapters in, even with ep = 1
            "data": {"dataset_param": {"dataset_type": "none"}},
            "model": {"model_id": "minimax_m3_vl", "from_scratch": True, "config_overrides": OVERRIDES},
            "training": {"train_iters": 1, "micro_batch_size": 1},
        }
    )
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    adapters = [m for m in model.modules() if isinstance(m, MiniMaxM3ExpertParallelExperts)]
    assert len(adapters) == 1 and adapters[0].swiglu_alpha == pytest.approx(1.702)
    materialize_meta(model, state.device, init=True)  # raises naming any tensor left NaN
    weights = [adapters[0].gate_up_proj, adapters[0].down_proj]
    weights.append(model.get_submodule("model.language_model.layers.1.mlp.gate").weight)
    for weight in weights:
        assert weight.full_tensor().std().item() == pytest.approx(0.02, rel=0.3)
    bias = model.get_submodule("model.language_model.layers.1.mlp.gate").e_score_correction_bias
    assert torch.equal(bias, torch.zeros(4))
    assert not any(p.requires_grad for p in indexer_params(model).values())
    # the sharded model trains, with and without an image (the idle tower on FSDP's sharded weights)
    model.train()
    ids = torch.randint(3, 100, (2, 12))
    for batch in (image_batch(), {"input_ids": ids, "labels": ids}):
        out = model(**batch, use_cache=False)
        assert torch.isfinite(out["loss"])
        out["loss"].backward()
    vision = model.get_submodule("model.vision_tower.layers.0.mlp.fc1").weight
    assert vision.grad is not None and adapters[0].gate_up_proj.grad is not None


# ------------------------------------------------------------------------------ expert-parallel adapter
E, H, INTER, K = 8, 32, 16, 2
CONFIG = MiniMaxM3VLTextConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, swiglu_limit=1.5)
TOKENS = [7, 0]  # rank 1 routes no token at all (the all-gather dispatcher pads)


def reference_experts() -> MiniMaxM3VLExperts:
    experts = MiniMaxM3VLExperts(CONFIG)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large enough that the +-1.5 clamps bite
        experts.gate_up_proj.copy_(torch.randn(E, 2 * INTER, H, generator=g))
        experts.down_proj.copy_(torch.randn(E, H, INTER, generator=g) * 0.3)
    return experts


def routing(rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing in which experts 1 and 6 never receive a token."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, H, generator=g)
    choices = torch.tensor([0, 2, 3, 4, 5, 7])
    idx = torch.argsort(torch.rand(tokens, len(choices), generator=g), dim=-1)[:, :K]
    return x, choices[idx], torch.rand(tokens, K, generator=g)


@pytest.mark.parametrize("grouped", [False, True])
def test_adapter_matches_transformers_experts(grouped):
    ref = reference_experts()
    adapter = MiniMaxM3ExpertParallelExperts.from_fused(ref, use_grouped_mm=grouped)
    x, idx, w = routing(0, 24)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out, expected = adapter(xa, idx, wa), ref(xr, idx, wr)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * target).sum().backward()
    (expected * target).sum().backward()
    for a, b in (
        (xa, xr),
        (wa, wr),
        (adapter.gate_up_proj, ref.gate_up_proj),
        (adapter.down_proj, ref.down_proj),
    ):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def _dispatch(rank: int, world: int, dispatcher: str) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ref = reference_experts()
    adapter = MiniMaxM3ExpertParallelExperts.from_fused(ref, mesh["ep"], dispatcher=dispatcher)
    inputs = [routing(r, TOKENS[r]) for r in range(world)]
    x, idx, w = inputs[rank]
    x = x.clone().requires_grad_(True)
    out = adapter(x, idx, w)
    (out * out).sum().backward()
    total = torch.zeros(())
    for r, (xr, ir, wr) in enumerate(inputs):
        o = ref(xr.clone().requires_grad_(r == rank), ir, wr)
        total = total + (o * o).sum()
        if r == rank:
            mine = o
    total.backward()
    torch.testing.assert_close(out, mine, rtol=1e-5, atol=1e-5)
    lo = adapter.local_expert_ids
    for p, full in ((adapter.gate_up_proj, ref.gate_up_proj), (adapter.down_proj, ref.down_proj)):
        torch.testing.assert_close(p.grad.to_local(), full.grad[lo.start : lo.stop], rtol=1e-4, atol=1e-5)


def _worker(rank: int, world: int, init_file: str, dispatcher: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _dispatch(rank, world, dispatcher)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_adapter_dispatchers_match_one_process(dispatcher):
    """ep = 2 on 2 gloo ranks (4 experts each) with 7 and 0 tokens and two experts never routed to."""
    world = 2
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "rendezvous"), dispatcher),
            nprocs=world,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + 180
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{dispatcher} dispatch on {world} ranks did not finish")
