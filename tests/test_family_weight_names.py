"""Every model id mm ships loads a checkpoint saved by its transformers base class (the hub's weight names)
completely, and saves under the same names: transformers renames some families' checkpoint weights
(fused experts, Step's and Kimi's vision towers) and skips classes defined outside it, which mm's
registration undoes (``mm_core.models.hub.share_weight_conversions``)."""

from __future__ import annotations

import pytest
import torch
from _vlm import FAMILIES
from safetensors.torch import load_file

from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub

QWEN_TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
QWEN_VL_TEXT = {
    **QWEN_TEXT,
    **MOE,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [1, 1, 2],
        "mrope_interleaved": True,
    },
}
QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
IDS = {"vocab": 128} | {t: 100 + i for i, t in enumerate(t for f in FAMILIES.values() for t in f[1])}
OVERRIDES = {
    "qwen3_moe": {k: v for k, v in {**QWEN_TEXT, **MOE}.items() if k != "head_dim"},
    "qwen3_vl_moe": {"text_config": QWEN_VL_TEXT, "vision_config": QWEN_VISION},
    **{family: make(IDS) for family, (_, _, make) in FAMILIES.items()},
}


def _base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))


@pytest.mark.parametrize("model_id", sorted(OVERRIDES))
def test_hub_names_load_completely_and_export_unchanged(model_id, tmp_path):
    args = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=OVERRIDES[model_id])
    torch.manual_seed(0)
    reference = ModelHub.build(args)  # mm's class, random weights
    official = _base(type(reference))._from_config(reference.config)
    official.load_state_dict(reference.state_dict())
    official.save_pretrained(tmp_path / "official")  # what transformers writes: the checkpoint's names
    loaded = ModelHub.build(
        ModelConfig(model_id=model_id, model_name_or_path=str(tmp_path / "official"), config_overrides={})
    )  # raises if any weight is missing
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded.save_pretrained(tmp_path / "exported")
    names = {k for f in (tmp_path / "exported").glob("*.safetensors") for k in load_file(f)}
    assert names == {k for f in (tmp_path / "official").glob("*.safetensors") for k in load_file(f)}
