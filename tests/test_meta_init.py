"""Meta-device init materialises every tensor (or fails naming the ones it could not), and ``model.freeze``
keeps frozen weights unchanged. Runs in-process on a 1-rank gloo group (FSDP's parameters are DTensors there
as on any number of ranks).

The Qwen3.5 family (dense and MoE vision-language, MoE text) on meta: initialised from scratch, and loaded
from a Hugging Face folder equal to a load without meta. Its Gated DeltaNet ``A_log`` init copies a plain
tensor into the sharded parameter (it stopped with "got mixed torch.Tensor and DTensor")."""

from __future__ import annotations

import math

import pytest
import torch
from _mm import QUICKSTART
from _tiny import qwen3_5_overrides
from torch import nn
from transformers import AutoConfig

from mm_core.config import load_config
from mm_core.config.schema import ModelConfig
from mm_core.convert import load_hf_weights
from mm_core.errors import ConfigError
from mm_core.models import BaseModel, ModelHub
from mm_core.parallel.apply import check_initialised, materialize_meta, shard_model
from mm_core.parallel.state import init_parallel_state
from mm_core.tasks.building import build_settings, prepare_and_plan

SMALL = [
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=2",
    "training.progress_bar=false",
    "training.save=null",
    "tools.tensorboard.enable=false",
]


def test_meta_init_initialises_every_tensor(group):
    cfg = load_config(QUICKSTART, SMALL)
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    assert all(p.is_meta for p in model.parameters())
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    materialize_meta(model, state.device, init=True)
    check_initialised(model)  # no NaN sentinel left anywhere
    ref = ModelHub.build(cfg.model)
    # the same init distributions as a normal build: norms are ones, rotary frequencies equal
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert torch.all(model.model.norm.weight.full_tensor() == 1)
    std = model.model.layers[0].mlp.up_proj.weight.full_tensor().std().item()
    assert std == pytest.approx(
        AutoConfig.from_pretrained(cfg.model.model_name_or_path).initializer_range, rel=0.1
    )


class ForgetfulModel(nn.Module, BaseModel):
    """A custom model whose init_weights forgets one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Parameter(torch.empty(3))

    @classmethod
    def _from_config(cls, args):
        return cls()

    @classmethod
    def from_pretrained(cls, args):
        return cls()

    def init_weights(self) -> None:
        self.a.reset_parameters()


def test_uninitialised_parameter_is_named(group):
    init_parallel_state(load_config(QUICKSTART, SMALL).parallel, "cpu")
    with torch.device("meta"):
        model = ForgetfulModel()
    with pytest.raises(ConfigError, match=r"left uninitialised.*\bb\b"):
        materialize_meta(model, torch.device("cpu"), init=True)


def test_freeze_keeps_frozen_weights(group, tmp_path):
    from mm_core.train import Trainer

    cfg = load_config(
        QUICKSTART,
        [
            *SMALL,
            "training.train_iters=2",
            f"training.output_dir={tmp_path}",
            "tools.tensorboard.enable=true",
            "training.log_interval=1",
            "model.freeze=[model.embed_tokens, model.layers.{0-1}.self_attn]",
        ],
    )
    trainer = Trainer(cfg).setup()
    frozen = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trained = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert "model.embed_tokens.weight" in frozen and "model.layers.1.self_attn.q_proj.weight" in frozen
    assert "model.layers.2.self_attn.q_proj.weight" in trained
    trainer.train()
    after = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(after[n], v) for n, v in frozen.items())
    key = "model.layers.2.self_attn.q_proj.weight"
    assert not torch.equal(after[key], trained[key])
    # run outputs: metrics, resolved config, TensorBoard events
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert "freeze" in (tmp_path / "config.yaml").read_text()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_meta_init_with_load_auto_and_no_checkpoint_initialises(group, tmp_path):
    """`training.load: auto` before any checkpoint exists is a fresh start: the meta-built model must be
    initialised, not left waiting for weights that never come."""
    import math

    from mm_core.train import Trainer

    cfg = load_config(
        QUICKSTART,
        [
            *SMALL,
            "training.train_iters=1",
            f"training.output_dir={tmp_path}",
            "training.init_model_with_meta_device=true",
            "training.load=auto",
            f"training.save={tmp_path / 'ckpt'}",
        ],
    )
    trainer = Trainer(cfg).setup()
    check_initialised(trainer.model)
    (record,) = trainer.train()
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


def test_dataloader_modes_of_the_guide_are_accepted_and_other_samplers_refused():
    from mm_core.config.support import check_supported

    check_supported(load_config(QUICKSTART, ["data.dataloader_param.dataloader_mode=base"]))
    cfg = load_config(QUICKSTART, ["data.dataloader_param.sampler_type=Other"])
    with pytest.raises(ConfigError, match=r"data\.dataloader_param\.sampler_type: got 'Other'"):
        check_supported(cfg)


def _sharded_on_meta(model_cfg: ModelConfig, state) -> nn.Module:
    cfg = load_config(QUICKSTART, [*SMALL, "parallel.fsdp_plan.apply_modules=[]"])  # the model's own plan
    cfg.model = model_cfg
    model = ModelHub.build(model_cfg, meta=True)
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    return model


@pytest.mark.parametrize("model_id", ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_qwen3_5_family_initialises_on_meta(model_id, group):
    state = init_parallel_state(load_config(QUICKSTART, SMALL).parallel, "cpu")
    scratch = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=qwen3_5_overrides(model_id))
    model = _sharded_on_meta(scratch, state)
    materialize_meta(model, state.device, init=True)  # raises naming any tensor left NaN
    a_log = next(p for n, p in model.named_parameters() if n.endswith("linear_attn.A_log")).full_tensor()
    assert torch.all((a_log >= math.log(0.01)) & (a_log <= math.log(16)))  # log of uniform(0.01, 16)


@pytest.mark.parametrize("model_id", ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_qwen3_5_loads_a_hugging_face_folder_on_meta_as_without(model_id, group, tmp_path):
    state = init_parallel_state(load_config(QUICKSTART, SMALL).parallel, "cpu")
    scratch = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=qwen3_5_overrides(model_id))
    torch.manual_seed(0)
    ModelHub.build(scratch).save_pretrained(tmp_path / "hf")
    folder = ModelConfig(model_id=model_id, model_name_or_path=str(tmp_path / "hf"), config_overrides={})
    reference = ModelHub.build(folder).state_dict()  # a load without meta
    loaded = _sharded_on_meta(folder, state)
    materialize_meta(loaded, state.device, init=False)
    load_hf_weights(loaded, tmp_path / "hf")
    check_initialised(loaded)
    for name, tensor in loaded.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        assert not full.is_meta, name
        assert torch.equal(full, reference[name]), name
