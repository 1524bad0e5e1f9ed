"""Every registered model that extends a transformers mixture-of-experts class runs transformers' grouped GEMM
experts at expert_parallel_size 1, whatever the build order (:class:`mm_core.models.TransformersExperts`).

transformers decides it per class by reading the class's own source file and caches the answer on the class,
so each check runs in a fresh interpreter where no class was asked before."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _tiny import QWEN3_MOE

_ALL_REGISTERED = textwrap.dedent(
    """
    import inspect, json, sys
    from transformers import PreTrainedModel
    from mm_core.models import TransformersExperts
    from mm_core.registry import model_register

    CACHE = "_can_set_experts_implementation_cached_value"
    out = {}
    for name in model_register.names():
        cls = model_register.get(name)
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
            continue
        base = next((b for b in cls.__mro__ if b.__module__.startswith("transformers.models.")), None)
        source = inspect.getsource(sys.modules[base.__module__]) if base is not None else ""
        if "@use_experts_implementation" not in source:
            continue  # not a transformers MoE class
        asked_before = CACHE in vars(base) or CACHE in vars(cls)
        out[name] = {
            "class": cls.__name__,
            "mixin": issubclass(cls, TransformersExperts),
            "asked_before": asked_before,
            "can_set": cls._can_set_experts_implementation(),
        }
    print(json.dumps(out))
    """
)

_BUILD_FIRST = textwrap.dedent(
    """
    import json, sys
    from transformers import Qwen3MoeConfig
    from mm_models_qwen.qwen3_moe import Qwen3MoeForTraining

    model = Qwen3MoeForTraining(Qwen3MoeConfig(**json.loads(sys.argv[1])))
    print(json.dumps(model.config._experts_implementation))
    """
)


def _run(code: str, *args: str):
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def registered() -> dict[str, dict]:
    return _run(_ALL_REGISTERED)


def test_every_transformers_moe_model_is_found(registered: dict[str, dict]) -> None:
    # the models of the guide's MoE cases; a new one is covered without editing this list
    expected = {"qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "qwen3_omni_moe"}
    expected |= {"minimax_m3_vl", "step3p7"}
    assert expected <= set(registered), sorted(registered)


def test_each_may_switch_its_experts_implementation_when_asked_first(registered: dict[str, dict]) -> None:
    for name, info in registered.items():
        assert not info["asked_before"], f"{name}: transformers was asked before the check: not a fresh class"
        assert info["mixin"], f"{name}: {info['class']} does not list TransformersExperts before its base"
        assert info["can_set"], f"{name}: {info['class']} would run the eager per-expert loop"


def test_a_training_class_built_first_runs_grouped_mm() -> None:
    assert _run(_BUILD_FIRST, json.dumps(QWEN3_MOE)) == "grouped_mm"
