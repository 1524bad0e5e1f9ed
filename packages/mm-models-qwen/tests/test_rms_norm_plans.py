"""The plugins' ``ModelPlan.rms_norm_classes``: each names exactly the RMSNorm classes of its tiny model that
compute transformers' ``weight * normalised(x)`` formula, and switching them to the kernel table (forced on
CPU, where the torch entry runs) keeps every module's output bit for bit; Qwen3.5's norms (``1 + weight``,
gated) are not listed; Qwen3-Omni's thinker lists both of its classes (layer norms, final norm)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _tiny import QWEN3, QWEN3_MOE, qwen3_5_overrides
from test_qwen_audio_plans import THINKER  # the tiny Qwen3-Omni thinker of the audio plans' tests
from torch import nn
from transformers import Qwen3Config, Qwen3MoeConfig, Qwen3VLConfig
from transformers.models.qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_vl_moe import Qwen3VLMoeConfig

from mm_core.models import plan_of
from mm_core.models.device_kernels import use_device_kernels
from mm_models_qwen.qwen3 import Qwen3ForTraining
from mm_models_qwen.qwen3_5 import Qwen3_5ForTraining
from mm_models_qwen.qwen3_moe import Qwen3MoeForTraining
from mm_models_qwen.qwen3_omni_moe import Qwen3OmniMoeThinkerForTraining
from mm_models_qwen.qwen3_vl import Qwen3VLForTraining
from mm_models_qwen.qwen3_vl_moe import Qwen3VLMoeForTraining

VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
TEXT_VL = {**QWEN3, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}

BUILDS: dict[str, Callable[[], nn.Module]] = {
    "qwen3": lambda: Qwen3ForTraining(Qwen3Config(**QWEN3)),
    "qwen3_moe": lambda: Qwen3MoeForTraining(Qwen3MoeConfig(**QWEN3_MOE)),
    "qwen3_vl": lambda: Qwen3VLForTraining(
        Qwen3VLConfig(text_config=TEXT_VL, vision_config={**VISION, "deepstack_visual_indexes": [0]})
    ),
    "qwen3_vl_moe": lambda: Qwen3VLMoeForTraining(
        Qwen3VLMoeConfig(
            text_config={**TEXT_VL, **MOE}, vision_config={**VISION, "deepstack_visual_indexes": [0]}
        )
    ),
    "qwen3_5": lambda: Qwen3_5ForTraining(Qwen3_5Config(**qwen3_5_overrides("qwen3_5"))),
    "qwen3_omni_moe": lambda: Qwen3OmniMoeThinkerForTraining(Qwen3OmniMoeThinkerConfig(**THINKER)),
}
LISTED = {
    "qwen3": {"Qwen3RMSNorm"},
    "qwen3_moe": {"Qwen3MoeRMSNorm"},
    "qwen3_vl": {"Qwen3VLTextRMSNorm"},
    "qwen3_vl_moe": {"Qwen3VLMoeTextRMSNorm"},
    "qwen3_5": set(),
    "qwen3_omni_moe": {"Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm"},
}


def _standard(module: nn.Module) -> bool:
    """Whether ``module`` computes ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (fp32 inside)."""
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(eps, float):
        return False
    x = torch.randn(3, module.weight.shape[-1], dtype=torch.bfloat16)
    h = x.float()
    expected = module.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    try:
        got = module(x)
    except TypeError:  # a gated norm takes a second input
        return False
    return bool(got.dtype == expected.dtype and torch.equal(got, expected))


@pytest.mark.parametrize("model_id", list(BUILDS))
def test_plan_lists_exactly_the_standard_norms(model_id: str) -> None:
    torch.manual_seed(0)
    model = BUILDS[model_id]()
    assert set(plan_of(model).rms_norm_classes) == LISTED[model_id]
    norms = {name: m for name, m in model.named_modules() if "RMSNorm" in type(m).__name__}
    for m in norms.values():
        with torch.no_grad():
            m.weight.normal_()  # the formulas differ visibly only away from the initial weights
    standard = {type(m).__name__ for m in norms.values() if _standard(m)}
    assert standard == LISTED[model_id], f"{model_id}: standard-formula norms {standard}"
    x = {name: torch.randn(2, 5, m.weight.shape[-1], dtype=torch.bfloat16) for name, m in norms.items()}
    before = {name: m(x[name]) for name, m in norms.items() if type(m).__name__ in standard}
    classes = {name: type(m).__name__ for name, m in norms.items()}
    assert use_device_kernels(model, "cpu") == []  # CPU keeps the model's own modules
    switched = use_device_kernels(model, "cpu", force=True)
    assert set(switched) == set(before) and (bool(switched) == bool(LISTED[model_id]))
    for name in switched:
        module = model.get_submodule(name)
        assert type(module).__name__ == "Kernel" + classes[name]
        assert torch.equal(module(x[name]), before[name])
