"""The ``qwen3`` model plugin through mm-core's ModelHub: build, default plan, weights, config overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _tiny import QWEN3
from transformers import Qwen3Config, Qwen3ForCausalLM

from mm_core.config.schema import ModelConfig
from mm_core.errors import ConfigError
from mm_core.models import ModelHub, plan_of
from mm_core.registry import model_register
from mm_models_qwen.qwen3 import Qwen3ForTraining
from mm_parallel.patterns import match_modules

TINY = QWEN3  # the shared tiny Qwen3 (tests/_tiny.py)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder with only config.json (no weights)."""
    path = tmp_path_factory.mktemp("qwen3_config")
    Qwen3Config(**TINY).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder with config.json and model.safetensors."""
    path = tmp_path_factory.mktemp("qwen3_weights")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(path)
    return path


def args(path: Path | None, **kw: Any) -> ModelConfig:
    return ModelConfig(model_id="qwen3", model_name_or_path=str(path) if path else None, **kw)


def test_qwen3_entry_point_is_the_training_class() -> None:
    assert model_register.get("qwen3") is Qwen3ForTraining
    assert issubclass(Qwen3ForTraining, Qwen3ForCausalLM)


def test_build_from_scratch(config_dir: Path) -> None:
    model = ModelHub.build(args(config_dir, from_scratch=True))
    assert type(model) is Qwen3ForTraining
    assert len(model.model.layers) == 2
    assert model.config.hidden_size == 32 and model.config.vocab_size == 128
    assert model.config.use_cache is False
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    out = model(input_ids=torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8)))
    assert out.logits.shape == (2, 8, 128)
    assert torch.isfinite(out.loss)


def test_build_on_meta(config_dir: Path) -> None:
    model = ModelHub.build(args(config_dir, from_scratch=True), meta=True)
    assert all(p.is_meta for p in model.parameters())
    assert len(model.model.layers) == 2


@pytest.mark.parametrize("n_layers", [2, 5])
def test_default_plan_matches_every_layer(tmp_path: Path, n_layers: int) -> None:
    Qwen3Config(**{**TINY, "num_hidden_layers": n_layers}).save_pretrained(tmp_path)
    model = ModelHub.build(args(tmp_path, from_scratch=True), meta=True)
    plan = plan_of(model)
    assert plan.fsdp_units == ("model.layers.{*}",)
    assert plan.recompute_units == ("model.layers.{*}",)
    hits = match_modules(model, plan.fsdp_units)["model.layers.{*}"]
    assert hits == [f"model.layers.{i}" for i in range(n_layers)]
    layers = {id(layer) for layer in model.model.layers}
    assert hits == [name for name, module in model.named_modules() if id(module) in layers]


def test_folder_without_weights_needs_from_scratch(config_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ModelHub.build(args(config_dir, from_scratch=False))
    msg = str(info.value)
    assert msg.startswith("model.model_name_or_path: ")
    assert str(config_dir) in msg
    assert "model.from_scratch: true" in msg


def test_no_folder_and_no_from_scratch_is_an_error() -> None:
    with pytest.raises(ConfigError, match="from_scratch"):
        ModelHub.build(args(None))


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ModelHub.build(args(tmp_path, from_scratch=True))
    assert "model.model_name_or_path" in str(info.value) and "config.json" in str(info.value)


def test_weights_are_loaded_when_present(weights_dir: Path) -> None:
    reference = Qwen3ForCausalLM.from_pretrained(weights_dir)
    model = ModelHub.build(args(weights_dir))
    assert type(model) is Qwen3ForTraining
    ref = reference.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)
    # and from_scratch ignores them: a fresh initialisation differs
    fresh = ModelHub.build(args(weights_dir, from_scratch=True))
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(fresh.state_dict()[key], ref[key])


def test_config_overrides_are_applied(config_dir: Path) -> None:
    model = ModelHub.build(
        args(
            config_dir,
            from_scratch=True,
            config_overrides={
                "intermediate_size": 48,
                "rms_norm_eps": 1e-5,
                "vocab_size": 96,
            },
        ),
        meta=True,
    )
    assert model.config.intermediate_size == 48
    assert model.model.layers[0].mlp.up_proj.weight.shape == (48, 32)
    assert model.model.embed_tokens.weight.shape == (96, 32)
    assert model.config.rms_norm_eps == 1e-5


def test_num_hidden_layers_override_on_a_folder(config_dir: Path) -> None:
    model = ModelHub.build(
        args(config_dir, from_scratch=True, config_overrides={"num_hidden_layers": 3}), meta=True
    )
    assert len(model.model.layers) == 3
    assert len(model.config.layer_types) == 3


def test_config_overrides_without_a_folder_start_from_the_class_default() -> None:
    model = ModelHub.build(args(None, from_scratch=True, config_overrides=TINY), meta=True)
    assert len(model.model.layers) == 2 and model.config.hidden_size == 32


def test_unknown_config_override_names_the_key(config_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ModelHub.build(
            args(config_dir, from_scratch=True, config_overrides={"num_hiden_layers": 3}), meta=True
        )
    msg = str(info.value)
    assert msg.startswith("model.config_overrides.num_hiden_layers: ")
    assert "Qwen3Config" in msg and "'num_hiden_layers'" in msg
