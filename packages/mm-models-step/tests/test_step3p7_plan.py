"""Step 3.7 VL (``step3p7``) builds from a tiny config (on the meta device too), its default plans match real
modules, a forward with images in mm-data-vlm's Step 3.7 format (global views + local crops) returns a finite
loss, every training forward runs the vision tower twice (global views, crops) whatever the micro-batch holds,
the expert-parallel adapter reproduces Step's clamped experts (one process, and 2 gloo ranks with both
dispatchers), and a router loss coefficient is refused."""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import START_METHOD
from PIL import Image
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

from mm_core.config.schema import LossConfig, ModelConfig
from mm_core.errors import ConfigError
from mm_core.models import ModelHub, plan_of
from mm_core.parallel.apply import materialize_meta
from mm_core.parallel.experts import router_aux_for
from mm_models_step.step3p7 import Step3p7ExpertParallelExperts
from mm_parallel.moe import swap_experts
from mm_parallel.patterns import match_modules

#: the tiny configuration (layer 0 dense, layer 1 mixture-of-experts with the SwiGLU clamp 7 as
#: Step-3.7-Flash's last layers; global view 32², crops 16², ViT patch 4: 4 rows per view, 1 per crop)
TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "mlp_layer_types": ["dense", "sparse"],
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "share_expert_dim": 16,
    "swiglu_limits": [0, 7.0],
    "sliding_window": 64,  # required by the mask code although every layer is full attention
}
VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "mlp_ratio": 2.0,
    "image_size": 32,
    "patch_size": 4,
}
IMAGE = 120
TOKENS = {"<im_patch>": IMAGE, "<im_start>": 121, "<im_end>": 122}
TOKENS.update({"<patch_start>": 123, "<patch_end>": 124, "<patch_newline>": 125})
ARGS = ModelConfig(
    model_id="step3p7",
    from_scratch=True,
    config_overrides={"text_config": TEXT, "vision_config": VISION, "image_token_id": IMAGE},
)
#: the matching ``preprocessor_config.json`` values for mm-data-vlm's format
PROCESSOR = {
    "size": {"height": 32, "width": 32},
    "patch_size": 16,
    "max_image_size": 64,
    "vision_patch_size": 4,
}


def test_default_plans_match_modules():
    model = ModelHub.build(ARGS)
    assert type(model).__name__ == "Step3p7ForTraining"
    plan = plan_of(model)
    units = match_modules(model, plan.fsdp_units)
    assert units == {
        "model.vision_model.layers.{*}": ["model.vision_model.layers.0", "model.vision_model.layers.1"],
        "model.language_model.layers.{*}": ["model.language_model.layers.0", "model.language_model.layers.1"],
    }
    assert match_modules(model, plan.recompute_units) == units
    experts = match_modules(model, plan.expert_modules)["model.language_model.layers.{*}.mlp.experts"]
    assert experts == ["model.language_model.layers.1.mlp.experts"]  # the dense layer 0 has none
    module = model.get_submodule(experts[0])
    assert tuple(module.gate_up_proj.shape) == (4, 2 * 16, 32)
    assert tuple(module.down_proj.shape) == (4, 32, 16)
    assert plan.expert_adapter is Step3p7ExpertParallelExperts
    excluded = match_modules(model, plan.muon_exclude_modules)
    assert excluded["model.language_model.layers.{*}.mlp.gate"] == ["model.language_model.layers.1.mlp.gate"]
    for name in (
        "model.vision_model.embeddings",
        "model.vision_model.downsampler1",
        "model.vision_model.downsampler2",
    ):
        assert excluded[name] == [name]
    assert isinstance(model.get_submodule(plan.cp_split_module), torch.nn.Module)


def test_meta_build_with_adapters_initialises_every_tensor():
    model = ModelHub.build(ARGS, meta=True)
    assert all(p.is_meta for p in model.parameters())
    names = match_modules(model, plan_of(model).expert_modules)["model.language_model.layers.{*}.mlp.experts"]
    swap_experts(model, names, None, adapter=plan_of(model).expert_adapter)
    materialize_meta(model, torch.device("cpu"), init=True)  # raises on any tensor left NaN
    moe = model.model.language_model.layers[1].mlp
    assert isinstance(moe.experts, Step3p7ExpertParallelExperts) and moe.experts.limit == 7.0
    for weight in (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj):
        assert weight.std().item() == pytest.approx(0.02, rel=0.3)
    assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(4))


def _image_inputs(sizes):
    """mm-data-vlm's Step 3.7 pixel inputs and placeholder token ids for images of these sizes."""
    fmt_module = pytest.importorskip("mm_data_vlm.formats.step")
    fmt = fmt_module.Step3p7Format(PROCESSOR, None, None)
    images = [Image.new("RGB", size, (40 * i, 90, 200)) for i, size in enumerate(sizes)]
    ids = [torch.tensor([TOKENS[t] for t in re.findall(r"<[a-z_]+>", fmt.placeholder(*s))]) for s in sizes]
    return fmt.pixels(images), ids


def _batch(sizes_per_sample, length=40):
    """A right-padded batch, each sample: some text, its images' placeholders, more text."""
    torch.manual_seed(0)
    rows, pixels = [], []
    for sizes in sizes_per_sample:
        if sizes:
            px, ids = _image_inputs(sizes)
            pixels.append(px)
        else:
            ids = []
        rows.append(torch.cat([torch.randint(0, 100, (3,)), *ids, torch.randint(0, 100, (5,))]))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)], mask[i, : len(row)] = row, 1
    labels = input_ids.masked_fill((input_ids == IMAGE) | (mask == 0), -100)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    for key in pixels[0] if pixels else ():
        batch[key] = torch.cat([p[key] for p in pixels])  # the vlm collator's concatenation
    return batch


def test_forward_with_images_returns_finite_loss():
    """Sample 0: a 40 x 24 image (global view + 6 crops, a newline after the 3rd); sample 1: a 20 x 18 image
    (global view only)."""
    model = ModelHub.build(ARGS)
    model.train()
    batch = _batch([[(40, 24)], [(20, 18)]])
    assert batch["num_local_patches"].tolist() == [6, 0]
    assert tuple(batch["pixel_values"].shape) == (2, 3, 32, 32)
    assert tuple(batch["pixel_values_local"].shape) == (6, 3, 16, 16)
    assert int((batch["input_ids"] == IMAGE).sum()) == 2 * 4 + 6 * 1
    out = model(**batch, use_cache=False)
    assert out.logits.shape == (2, 40, 128)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.vision_model.embeddings.patch_embedding.weight.grad.abs().sum() > 0
    assert model.model.vision_model.downsampler2.weight.grad.abs().sum() > 0
    assert model.model.language_model.layers[1].mlp.experts.gate_up_proj.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "samples",
    [[[(40, 24)], [(20, 18)]], [[(20, 18)], []], [[], []]],
    ids=["crops", "no-crops", "no-images"],
)
def test_every_training_forward_runs_the_vision_tower_twice(samples):
    """Under FSDP every rank runs the same units the same number of times: the tower runs once for the global
    views and once for the crops, on a blank one-patch image for what the micro-batch lacks (adding 0 x its
    output), so its weights always get a (possibly zero) gradient."""
    model = ModelHub.build(ARGS)
    model.train()
    calls = []
    model.model.vision_model.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    out = model(**_batch(samples), use_cache=False)
    assert len(calls) == 2
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for p in model.model.vision_model.parameters():
        assert p.grad is not None
    assert model.model.multi_modal_projector.weight.grad is not None
    model.eval()
    calls.clear()
    with torch.no_grad():
        model(**_batch([[], []]), use_cache=False)
    assert calls == []  # evaluation without images skips the tower


def _experts(limit):
    # Step3p7Experts reads its layer's clamp from ``swiglu_limits[layer_idx]`` (0: none)
    config = Step3p7TextConfig(
        hidden_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
        swiglu_limits=[limit or 0],
    )
    torch.manual_seed(0)
    module = Step3p7Experts(config, layer_idx=0)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.5)
        module.down_proj.normal_(0, 0.5)
    return module


def _routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, generator=g)
    idx = torch.argsort(torch.rand(tokens, 4, generator=g), dim=-1)[:, :2]
    w = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return x, idx, w


@pytest.mark.parametrize("limit", [None, 0.5])
def test_expert_adapter_matches_step_experts(limit):
    """The clamp bites (limit 0.5 on weights of std 0.5) and the adapter still gives Step's outputs and
    gradients; without a limit it is mm's base adapter."""
    ref = _experts(limit)
    adapter = Step3p7ExpertParallelExperts.from_fused(ref)
    x, idx, w = _routing(11, 1)
    if limit is not None:
        up = torch.einsum("th,eih->tei", x, ref.gate_up_proj)[..., 4:]
        assert (up.abs() > limit).any()
    target = torch.randn(11, 8)
    (ref(x, idx, w) * target).sum().backward()
    out = adapter(x, idx, w)
    torch.testing.assert_close(out, ref(x, idx, w), rtol=1e-5, atol=1e-6)
    (out * target).sum().backward()
    torch.testing.assert_close(adapter.gate_up_proj.grad, ref.gate_up_proj.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapter.down_proj.grad, ref.down_proj.grad, rtol=1e-5, atol=1e-6)


RANK_TOKENS = [5, 3]  # uneven, so the all-gather dispatcher pads


def _two_ranks(rank, world, init_file):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        inputs = [_routing(n, 10 + r) for r, n in enumerate(RANK_TOKENS)]
        targets = [
            torch.randn(n, 8, generator=torch.Generator().manual_seed(r)) for r, n in enumerate(RANK_TOKENS)
        ]
        ref = _experts(0.5)
        total = sum((ref(x, i, w) * t).sum() for (x, i, w), t in zip(inputs, targets))
        total.backward()  # one process, every rank's tokens
        x, idx, w = inputs[rank]
        for dispatcher in ("alltoall", "allgather"):
            adapter = Step3p7ExpertParallelExperts.from_fused(ref, mesh, dispatcher=dispatcher)
            out = adapter(x, idx, w)
            torch.testing.assert_close(out, ref(x, idx, w), rtol=1e-5, atol=1e-6)
            (out * targets[rank]).sum().backward()
            mine = adapter.local_expert_ids
            for p, full in ((adapter.gate_up_proj, ref.gate_up_proj), (adapter.down_proj, ref.down_proj)):
                torch.testing.assert_close(
                    p.grad.to_local(), full.grad[mine.start : mine.stop], rtol=1e-5, atol=1e-6
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_adapter_dispatchers_on_two_ranks():
    """Both dispatchers on 2 gloo ranks (5 and 3 tokens): outputs and each rank's expert gradients equal one
    process's over every rank's tokens, with the clamp active."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _two_ranks, args=(2, os.path.join(tmp, "rendezvous")), nprocs=2, start_method=START_METHOD
        )


def test_router_loss_is_refused():
    """Step 3.7 routes by sigmoid scores plus a balancing bias and has no auxiliary loss; mm's Switch loss
    does not describe that routing, so a coefficient is refused (its text config has no num_experts)."""
    model = ModelHub.build(ARGS)
    assert router_aux_for(model, LossConfig()) is None
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        router_aux_for(model, LossConfig(router_aux_loss_coef=0.01))
