"""Qwen3-VL-MoE (``qwen3_vl_moe``) with images trains the same model on 2 FSDP ranks, with expert
parallelism 2 and with Ulysses 2 context parallelism on 2 ranks, as in 1 process: gloo, fp32, 3 steps,
images of different sizes and 0-2 images per sample (the tiny assets of the Qwen3-VL parity test, every
decoder layer 4 fused experts, top-2, router load-balancing loss on, read from the text config). Losses,
router losses and gradient norms agree within 1e-5 relative. Also, in process on a 1-rank gloo group:
meta-device init of the sharded model with the expert-parallel adapters swapped in initialises every
tensor, routers and adapters included."""

from __future__ import annotations

import pytest
from _mm import QUICKSTART, assert_close_series, train_layouts
from _vlm import make_moe_assets

from mm_core.config import load_config
from mm_core.models import ModelHub
from mm_core.parallel.apply import materialize_meta, shard_model
from mm_core.parallel.state import init_parallel_state
from mm_core.tasks.building import build_settings, prepare_and_plan
from mm_parallel.moe import ExpertParallelExperts

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4"]),
    ("fsdp2", 2, ["training.micro_batch_size=2"]),
    ("ep2", 2, ["training.micro_batch_size=2", "parallel.expert_parallel_size=2"]),
    ("ulysses2", 2, ["training.micro_batch_size=4", "parallel.ulysses_parallel_size=2"]),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = make_moe_assets(tmp_path_factory.mktemp("vlm_moe_assets"))
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, COMMON, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "ep2", "ulysses2"])
def test_qwen3_vl_moe_with_images_matches_single_process(runs, name):
    ref, got = runs["single"], runs[name]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "aux_loss"):
        assert_close_series([r[key] for r in ref], [r[key] for r in got], 1e-5, f"{name} {key}")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in got]


TINY = (
    "{text_config: {vocab_size: 64, hidden_size: 16, num_hidden_layers: 2, num_attention_heads: 2, "
    "num_key_value_heads: 1, head_dim: 8, intermediate_size: 32, num_experts: 4, num_experts_per_tok: 2, "
    "moe_intermediate_size: 8}, vision_config: {depth: 1, hidden_size: 16, intermediate_size: 32, "
    "num_heads: 2, out_hidden_size: 16}}"
)


def test_meta_init_initialises_routers_and_expert_adapters(group):
    experts = "model.language_model.layers.{*}.mlp.experts"
    cfg = load_config(
        QUICKSTART,
        [
            "training.progress_bar=false",
            "training.save=null",
            "model.model_id=qwen3_vl_moe",
            "model.model_name_or_path=null",
            f"model.config_overrides={TINY}",
            "parallel.fsdp_plan.apply_modules=[]",  # the default per-tower units
            f"parallel.ep_plan.apply_modules=[{experts}]",  # swap the adapters in, even with ep = 1
        ],
    )
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    adapters = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert len(adapters) == 2
    materialize_meta(model, state.device, init=True)  # raises naming any tensor left NaN
    weights = [a.gate_up_proj for a in adapters] + [a.down_proj for a in adapters]
    weights += [model.get_submodule(f"model.language_model.layers.{i}.mlp.gate").weight for i in range(2)]
    for weight in weights:
        assert weight.full_tensor().std().item() == pytest.approx(0.02, rel=0.3)
