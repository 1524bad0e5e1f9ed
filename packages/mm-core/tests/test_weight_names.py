"""A model class that extends a transformers model outside transformers (mm's ``*ForTraining`` classes, a
plugin's own) loads and saves under the weight names of the model it extends: transformers renames
checkpoint names per class and skips classes defined elsewhere, so without mm's registration a subclass of
Step 3.7 would export ``model.vision_model.conv1`` (which transformers cannot load) and load an official
checkpoint with its vision weights missing. And weights missing from a folder are an error, never a random
initialisation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.step3p7 import Step3p7Config, Step3p7ForConditionalGeneration

from mm_core.config.schema import ModelConfig
from mm_core.errors import ConfigError
from mm_core.models import ModelHub
from mm_core.registry import model_register

TEXT = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "mlp_layer_types": ["dense"],
    "sliding_window": 64,
}
VISION = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 4,
}


class PluginStep(Step3p7ForConditionalGeneration):
    """What a plugin package writes: transformers' class, unchanged weights, in a module of its own."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    model_register.register("test_plugin_step")(PluginStep)
    root = tmp_path_factory.mktemp("names")
    torch.manual_seed(0)
    official = Step3p7ForConditionalGeneration(Step3p7Config(text_config=TEXT, vision_config=VISION))
    official.save_pretrained(root / "official")  # transformers' own names (the hub checkpoint's)
    return root, official


def test_subclass_loads_an_official_checkpoint_and_exports_its_names(folders):
    root, official = folders
    args = ModelConfig(model_id="test_plugin_step", model_name_or_path=str(root / "official"))
    model = ModelHub.build(args)  # raises if any weight were missing
    for name, tensor in official.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    model.save_pretrained(root / "exported")
    names = set(load_file(root / "exported" / "model.safetensors"))
    assert names == set(load_file(root / "official" / "model.safetensors"))
    assert "vision_model.conv1.weight" in names  # the checkpoint name, not the module path
    reloaded = Step3p7ForConditionalGeneration.from_pretrained(root / "exported")
    for name, tensor in official.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_weights_missing_from_the_folder_are_an_error(folders, tmp_path):
    root, official = folders
    state = load_file(root / "official" / "model.safetensors")
    from safetensors.torch import save_file

    (tmp_path / "partial").mkdir()
    save_file(
        {k: v for k, v in state.items() if not k.startswith("vision_model.")},
        tmp_path / "partial" / "model.safetensors",
    )
    official.config.save_pretrained(tmp_path / "partial")
    args = ModelConfig(model_id="test_plugin_step", model_name_or_path=str(tmp_path / "partial"))
    with pytest.raises(ConfigError, match=r"model.model_name_or_path: .* lacks \d+ weights of PluginStep"):
        ModelHub.build(args)
