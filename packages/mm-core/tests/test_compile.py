"""``training.compile``: each FSDP unit's forward compiled in place (inductor, the system C compiler on CPU).

Compiled and eager training give the same losses and gradient norms within fp32 tolerance: in one process
(the compile function on a 4-layer tiny Qwen3: one graph for every layer, no recompile per layer) and on 2
gloo ranks through the trainer (FSDP2 with ``model.recompute: true``, whose checkpoint moves inside the
compiled graph: the activations saved in forward stay those of the eager recompute run). Compilation is slow
on CPU, so each test compiles one graph and runs compiled and eager in the same processes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from _launch import START_METHOD, enter_rank, free_port
from torch import nn

from mm_core.check import run_check
from mm_core.config.loader import load_config
from mm_core.config.schema import MMConfig
from mm_core.errors import ConfigError
from mm_core.parallel.compile import plan_compile
from mm_core.parallel.memory import MemoryFeatures
from mm_parallel.compile import CompileError, compile_modules

RTOL, ATOL = 1e-5, 1e-6


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} values"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= ATOL + RTOL * abs(y), f"{what} step {i + 1}: compiled {x!r} vs eager {y!r}"


def _train(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


def test_compiled_blocks_match_eager_in_one_process(
    tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters
    from transformers import Qwen3Config, Qwen3ForCausalLM

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # no compile worker pool left behind
    torch.manual_seed(0)
    config = Qwen3Config.from_pretrained(
        tiny_qwen_dir, num_hidden_layers=4, layer_types=["full_attention"] * 4
    )
    eager = Qwen3ForCausalLM(config)
    compiled = copy.deepcopy(eager)
    names = compile_modules((f"model.layers.{i}", m) for i, m in enumerate(compiled.model.layers))
    assert names == [f"model.layers.{i}" for i in range(4)]
    assert set(compiled.state_dict()) == set(eager.state_dict())  # in place: the names do not change
    batches = [torch.randint(0, config.vocab_size, (2, 32)) for _ in range(3)]
    torch._dynamo.reset()  # no graph cached by an earlier test
    counters.clear()
    got = _train(compiled, batches)
    want = _train(eager, batches)
    _close(got[0], want[0], "loss")
    _close(got[1], want[1], "grad norm")
    # identical blocks share one graph: dynamo does not recompile per layer
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_failure_names_the_module_and_the_hint() -> None:
    def broken_backend(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("no code for this graph")

    layer = nn.Linear(4, 4)
    compile_modules([("blocks.0", layer)], error_hint="set training.compile: false", backend=broken_backend)
    with pytest.raises(CompileError, match=r"blocks\.0 \(Linear\).*no code.*set training\.compile: false"):
        layer(torch.ones(2, 4))


class _NoTensorWork(nn.Module):
    """A forward with no tensor operation: dynamo has nothing to capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_compile_that_captures_nothing_is_an_error() -> None:
    module = _NoTensorWork()
    compile_modules([("blocks.0", module)], error_hint="set training.compile: false")
    expected = r"captured no graph on blocks\.0 \(_NoTensorWork\).*training\.compile"
    with pytest.raises(CompileError, match=expected):
        module(torch.ones(2, 4))


def test_compile_plan_in_mm_check(
    good_raw: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def config(**model: Any) -> MMConfig:
        raw = copy.deepcopy(good_raw)
        raw["training"]["compile"] = True
        raw["model"].update(model)
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        return load_config(path)

    run_check(config(), 2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compile ")]
    assert lines == [
        "compile     : torch.compile per FSDP unit: 2 of 2 compiled (model.layers.0, model.layers.1)"
    ]
    # a unit holding an expert-parallel module runs eagerly
    plan = plan_compile(["model.layers.0", "model.layers.1"], ["model.layers.1.mlp"], MemoryFeatures())
    assert plan.compiled == ("model.layers.0",)
    assert plan.eager == {"model.layers.1": "holds the expert-parallel module model.layers.1.mlp"}
    # recompute inside a compiled unit would break its graph: refused, by mm check as by the trainer
    cfg = config(recompute=True, recompute_plan={"apply_modules": ["model.layers.{*}.mlp"]})
    with pytest.raises(ConfigError, match=r"model\.recompute_plan\.apply_modules: .*training\.compile"):
        run_check(cfg, 2, quiet=True)


# ---------------------------------------------------------------------------- 2 gloo ranks, the trainer
class _SavedActivations:
    """The numel of the tensors saved for backward in each forward of ``model`` (parameters left out)."""

    def __init__(self, model: nn.Module) -> None:
        self.per_forward: list[int] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit),
        ]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            self.per_forward[-1] += t.numel()
        return t

    def _enter(self, *_: Any) -> None:
        self.per_forward.append(0)
        self._hooks.__enter__()

    def _exit(self, *_: Any) -> None:
        self._hooks.__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _worker(rank: int, world: int, port: int, runs: list[tuple[str, str]], out: str) -> None:
    enter_rank(rank, world, port)
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mm_core.train.trainer import Trainer

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        for name, config in runs:
            cfg = load_config(config, [f"training.output_dir={out}/{name}"])
            trainer = Trainer(cfg, config).setup()
            saved = _SavedActivations(trainer.model)
            counters.clear()
            records = trainer.train()
            saved.remove()
            results[name] = {
                "loss": [r["loss"] for r in records],
                "grad_norm": [r["grad_norm"] for r in records],
                "saved": max(saved.per_forward),
                "graphs": counters["stats"]["unique_graphs"],
            }
        if rank == 0:
            Path(out, "results.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_fsdp_with_recompute_matches_eager(
    tiny_qwen_dir: Path, good_raw: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import Qwen3Config

    model_dir = tmp_path / "model"  # the 2-layer tiny Qwen3 with the quickstart tokenizer's vocabulary
    Qwen3Config.from_pretrained(tiny_qwen_dir, vocab_size=4096).save_pretrained(model_dir)
    variants = {
        "eager": {},
        "eager_recompute": {"recompute": True},
        "compiled_recompute": {"recompute": True, "compile": True},
    }
    runs = []
    for name, opts in variants.items():
        raw = copy.deepcopy(good_raw)
        raw["model"]["model_name_or_path"] = str(model_dir)
        raw["parallel"]["fsdp_plan"].update(param_dtype="fp32", reduce_dtype="fp32")
        raw["model"]["recompute"] = opts.get("recompute", False)
        raw["training"].update(train_iters=3, seed=7, log_interval=1, compile=opts.get("compile", False))
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        runs.append((name, str(path)))
    mp.start_processes(
        _worker, args=(2, free_port(), runs, str(tmp_path)), nprocs=2, start_method=START_METHOD, join=True
    )
    res = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    print(res)
    got, want = res["compiled_recompute"], res["eager_recompute"]
    _close(got["loss"], want["loss"], "loss")
    _close(got["grad_norm"], want["grad_norm"], "grad norm")
    assert got["graphs"] == 1 and want["graphs"] == 0  # both layers in one graph; FSDP2 hooks outside it
    # the recompute still happens: the compiled forward saves little more than the layers' inputs (which the
    # eager checkpoint keeps out of sight of saved-tensor hooks), far less than eager without recompute
    assert want["saved"] < got["saved"] < 0.3 * res["eager"]["saved"]
