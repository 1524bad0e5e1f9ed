"""The one build plan: building a model resolves each decision once (``resolve_build``), the worker and
``mm check`` read the same frozen plan, and every decision names its YAML key. Runs in-process on a 1-rank
gloo group."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from _mm import QUICKSTART

from mm_core.check import plan_on_meta, run_check
from mm_core.config import load_config
from mm_core.parallel.plan import plan_json
from mm_core.parallel.state import init_parallel_state
from mm_core.tasks.base import TaskContext
from mm_core.tasks.standard import StandardTask

SMALL = [
    "data.dataset_param.basic_parameters.seq_len=32",
    "model.model_name_or_path=null",
    "model.config_overrides={num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, "
    "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}",
    "training.micro_batch_size=2",
    "training.progress_bar=false",
    "training.save=null",
    "tools.tensorboard.enable=false",
]

#: the resolvers of a build: each must run once while one model is built and its task set up
RESOLVERS = ("resolve_build", "plan_of", "match_modules", "plan_memory_features", "chunked_loss_plan")


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Wrap each resolver in every mm module that holds it (the test's own wrapper), counting calls."""
    calls: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(("mm_core", "mm_parallel", "mm_models")):
            continue
        for name in RESOLVERS:
            fn = vars(module).get(name)
            if callable(fn):
                monkeypatch.setattr(module, name, counting(name, fn))
    return calls


def test_each_resolver_runs_once_per_build(group, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(
        QUICKSTART, [*SMALL, "model.recompute=true", "parallel.fsdp_plan.num_to_forward_prefetch=1"]
    )
    state = init_parallel_state(cfg.parallel, "cpu")
    calls = _count_calls(monkeypatch)
    task = StandardTask(TaskContext(cfg, state, None))
    task.build()
    assert calls == Counter(dict.fromkeys(RESOLVERS, 1)), calls
    plan = task.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fsdp = plan.fsdp  # type: ignore[misc]
    assert plan.fsdp.key == "parallel.fsdp_plan.apply_modules"
    assert plan.fsdp.names == ("model.layers.0", "model.layers.1")
    assert plan.memory.recompute == ("model.layers.0", "model.layers.1")
    assert plan.chunked.path == "lm_head" and plan.gather is not None and plan.gather.num_forward == 1
    assert (plan.facts.num_layers, plan.facts.hidden_size, plan.facts.head_dim) == (2, 32, 16)


def test_check_resolves_the_plan_the_worker_applies(group, capsys: pytest.CaptureFixture[str]) -> None:
    """``mm check``'s plan (built on meta) equals the worker's (built on the CPU), decision by decision."""
    cfg = load_config(QUICKSTART, [*SMALL, "model.recompute=true"])
    state = init_parallel_state(cfg.parallel, "cpu")
    task = StandardTask(TaskContext(cfg, state, None))
    task.build()
    _, checked = plan_on_meta(cfg, state.sizes)
    assert plan_json(checked) == plan_json(task.plan)
    text = json.dumps(plan_json(checked))
    for key in ("parallel.fsdp_plan.apply_modules", "model.recompute_plan.apply_modules", "model.loss_cfg"):
        assert key in text
    run_check(cfg, 1, as_json=True)  # mm check --json: the same plan, as one JSON object
    report = json.loads(capsys.readouterr().out)
    assert report["plan"] == json.loads(json.dumps(plan_json(task.plan)))
    trainable = sum(p.numel() for p in task.model.parameters() if p.requires_grad)
    assert report["parameters"]["trainable"] == trainable
