"""The model plan end to end (in-process, 1-rank gloo): ``mm check`` prints it; meta-device init runs its
``init_weights`` hook for every MoE model (expert-parallel adapters and routers initialised); its
``expert_adapter`` is the module swapped in; a model without a plan trains with the defaults; the trainer
applies the optimizer plugin's own clipping policy."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch
from _mm import QUICKSTART
from torch import nn
from transformers.utils import ModelOutput

from mm_core.check import run_check
from mm_core.config import load_config
from mm_core.models import BaseModel, ModelHub, ModelPlan, plan_of
from mm_core.optim import OptimizerPlugin
from mm_core.parallel.apply import materialize_meta, shard_model
from mm_core.parallel.state import init_parallel_state
from mm_core.registry import model_register, optimizer_register
from mm_core.tasks.building import build_settings, prepare_and_plan
from mm_models_qwen.qwen3_moe import Qwen3MoeForTraining
from mm_parallel.moe import ExpertParallelExperts

SMALL = [
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=2",
    "training.progress_bar=false",
    "training.save=null",
    "tools.tensorboard.enable=false",
]
MOE = "{num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 8}"
TEXT = "vocab_size: 64, hidden_size: 16, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1"
MOE_MODELS = {
    "qwen3_moe": (f"{{{TEXT}, {MOE[1:-1]}, intermediate_size: 32}}", "model.layers.{*}.mlp.experts"),
    # full attention only: transformers' init of the gated-DeltaNet layers copies a plain tensor into the
    # sharded A_log, which meta-device init of those layers does not support yet
    "qwen3_5_moe_text": (
        f"{{{TEXT}, {MOE[1:-1]}, shared_expert_intermediate_size: 8, head_dim: 8, "
        "layer_types: [full_attention, full_attention]}",
        "model.layers.{*}.mlp.experts",
    ),
    "qwen3_5_moe": (
        f"{{text_config: {{{TEXT}, {MOE[1:-1]}, shared_expert_intermediate_size: 8, head_dim: 8, "
        "layer_types: [full_attention, full_attention]}, vision_config: {depth: 1, hidden_size: 16, "
        "intermediate_size: 32, num_heads: 2, out_hidden_size: 16}}",
        "model.language_model.layers.{*}.mlp.experts",
    ),
}


def test_check_prints_the_model_plan_and_the_optimizer_summary(capsys) -> None:
    run_check(load_config(QUICKSTART), 2)
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("model plan  : Qwen3ForTraining (defaults for plans the YAML leaves out)")
    assert lines[at + 1].split() == ["fsdp_units", "model.layers.{*}"]
    assert lines[at + 2].split() == ["recompute_units", "model.layers.{*}"]
    assert lines[at + 3].split() == ["expert_modules", "-"]
    assert lines[at + 6].split() == ["output_head", "lm_head"]
    assert lines[at + 7].split() == ["input_embedding", "model.embed_tokens"]
    assert lines[at + 8].split() == ["output_norm", "model.norm"]
    assert lines[at + 9].split() == ["init_weights", "-"]
    assert lines[at + 10].startswith("fsdp units  : from parallel.fsdp_plan.apply_modules")
    # the quickstart's Qwen3 ties its embedding and head: one unit with the final norm
    assert " ".join(lines[at + 12].split()) == (
        "model.embed_tokens + model.norm + lm_head -> one FSDP unit (tied embedding and head, model plan, "
        "kept gathered into the backward)"
    )
    # loss_chunk_size: auto at the quickstart's vocabulary of 4,096: 256 MiB / (4,096 x 4 x 2) tokens
    assert (
        "loss        : per_token_loss; chunked loss: lm_head computes the loss 8192 tokens at a time "
        "(loss_chunk_size: auto -> 8192 = floor(256 MiB / (4,096 vocabulary x 4 bytes x 2" in "\n".join(lines)
    )
    assert any(line.startswith("optimizer   : adamw over ") for line in lines), lines
    overrides = ["model.model_id=qwen3_moe", "model.model_name_or_path=null", f"model.config_overrides={MOE}"]
    run_check(load_config(QUICKSTART, overrides), 2)
    out = capsys.readouterr().out
    assert "expert_modules        model.layers.{*}.mlp.experts (adapter ExpertParallelExperts)" in out
    assert "muon_exclude_modules  model.layers.{*}.mlp.gate" in out
    assert "init_weights          mm_core.models.plan.init_expert_adapters" in out


@pytest.mark.parametrize("model_id", sorted(MOE_MODELS))
def test_meta_init_initialises_the_expert_adapters_of_every_moe_model(group, model_id: str) -> None:
    overrides, experts = MOE_MODELS[model_id]
    cfg = load_config(
        QUICKSTART,
        [
            *SMALL,
            f"model.model_id={model_id}",
            "model.model_name_or_path=null",
            f"model.config_overrides={overrides}",
            "parallel.fsdp_plan.apply_modules=[]",
            f"parallel.ep_plan.apply_modules=[{experts}]",  # swap the adapters in, even with ep = 1
        ],
    )
    assert plan_of(ModelHub.model_class(cfg.model)).init_weights is not None
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    adapters = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert len(adapters) == 2
    materialize_meta(model, state.device, init=True)  # raises naming any tensor left NaN
    for adapter in adapters:
        for weight in (adapter.gate_up_proj, adapter.down_proj):
            assert weight.full_tensor().std().item() == pytest.approx(0.02, rel=0.3)
    # the routers too (transformers skips them on meta-device init of the Qwen3.5-MoE subclasses)
    router = model.get_submodule(experts.replace("{*}", "0").replace("experts", "gate"))
    assert router.weight.full_tensor().std().item() == pytest.approx(0.02, rel=0.3)


class _Adapter(ExpertParallelExperts):
    """An adapter named by a model's plan."""


def test_the_plan_names_the_expert_adapter(group) -> None:
    @model_register.register("plan_test_moe")
    class Adapted(Qwen3MoeForTraining):
        mm_plan: ClassVar[ModelPlan] = dataclasses.replace(
            Qwen3MoeForTraining.mm_plan, expert_adapter=_Adapter
        )

    try:
        cfg = load_config(
            QUICKSTART,
            [
                *SMALL,
                "model.model_id=plan_test_moe",
                "model.model_name_or_path=null",
                f"model.config_overrides={{{TEXT}, {MOE[1:-1]}, intermediate_size: 32}}",
                "parallel.ep_plan.apply_modules=[model.layers.{*}.mlp.experts]",
            ],
        )
        state = init_parallel_state(cfg.parallel, "cpu")
        model = ModelHub.build(cfg.model, meta=True)
        shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
        kinds = {type(model.get_submodule(f"model.layers.{i}.mlp.experts")) for i in range(2)}
        assert kinds == {_Adapter}
    finally:
        model_register.unregister("plan_test_moe")


@dataclasses.dataclass
class _Out(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class NoPlanLM(nn.Module, BaseModel):
    """A custom model that declares no plan at all: it trains as one FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in "ab"
        )
        self.head = nn.Linear(16, 4096)

    @classmethod
    def _from_config(cls, args: Any) -> NoPlanLM:
        return cls()

    @classmethod
    def from_pretrained(cls, args: Any) -> NoPlanLM:
        return cls()

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> _Out:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return _Out(logits=self.head(h))


def _train_once(tmp_path, name: str, optimizer: str, clip: str) -> dict[str, torch.Tensor]:
    from mm_core.train import Trainer

    cfg = load_config(
        QUICKSTART,
        [
            *SMALL,
            "model.model_id=plan_test_noplan",
            "model.model_name_or_path=null",
            "parallel.fsdp_plan.apply_modules=[]",
            "training.train_iters=1",
            f"training.optimizer={optimizer}",
            f"training.clip_grad={clip}",
            f"training.output_dir={tmp_path / name}",
        ],
    )
    trainer = Trainer(cfg).setup()
    (record,) = trainer.train()
    assert record["grad_norm"] > 0 and record["loss"] > 0
    return {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}


def test_no_plan_trains_and_the_trainer_applies_the_optimizers_clipping_policy(group, tmp_path) -> None:
    assert plan_of(NoPlanLM) == ModelPlan()

    def sgd(model: nn.Module, cfg: Any, plan: ModelPlan) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=cfg.lr)

    model_register.register("plan_test_noplan")(NoPlanLM)
    optimizer_register.register("plan_test_sgd")(OptimizerPlugin(build=sgd))
    # this plugin's policy: clipping measures the norm but scales no gradient
    optimizer_register.register("plan_test_sgd_noclip")(
        OptimizerPlugin(build=sgd, clip_policy=lambda opt, cfg: lambda p: False)
    )
    try:
        unclipped = _train_once(tmp_path, "unclipped", "plan_test_sgd", "null")
        kept = _train_once(tmp_path, "kept", "plan_test_sgd_noclip", "1e-6")
        clipped = _train_once(tmp_path, "clipped", "plan_test_sgd", "1e-6")
    finally:
        for name in ("plan_test_sgd", "plan_test_sgd_noclip"):
            optimizer_register.unregister(name)
        model_register.unregister("plan_test_noplan")
    assert all(torch.equal(kept[n], unclipped[n]) for n in unclipped)
    assert not torch.equal(clipped["head.weight"], unclipped["head.weight"])
