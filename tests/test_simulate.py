"""``mm check --simulate`` counts what a real run holds: its parameter, gradient and optimizer bytes equal the
local tensor sizes of a real 4-rank gloo run of the same config, rank by rank, for dense FSDP, HSDP and
expert parallelism (a tiny Qwen3 and Qwen3-MoE whose dimensions do not all divide by 4, so the shards are
uneven), and a 1-trillion-parameter MoE (Kimi K2.5's text model at Kimi K2's published size) simulates at
1,024 ranks through the ``mm check`` command with its JSON report.

The real run trains one step per layout in one launch of 4 processes (:mod:`_launch`): the gradients are
counted when the optimizer steps (``register_step_pre_hook``), the optimizer's moments (its state tensors of a
parameter's shape) after the step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO, mm, quickstart_text_data
from test_ep_parity import moe_config

from mm_core.config import load_config

WORLD = 4
COMMON = [
    "training.train_iters=1",
    "training.save=null",
    "training.micro_batch_size=1",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "model.config_overrides.vocab_size=4099",  # the tokenizer's 4096 and 3 unused rows: uneven shards
]
LAYOUTS = {
    "fsdp": [],
    "hsdp": ["parallel.fully_shard_parallel_size=2"],
    "ep": ["parallel.expert_parallel_size=2"],
}


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def measure(config: str, overrides: list[str], out: str) -> None:
    """On every rank of the launch: train one step of ``config`` and write the local bytes of the
    parameters, of the gradients at the optimizer step and of the optimizer's moments to
    ``out.rank<RANK>.json``."""
    from mm_core.tasks.base import MAIN
    from mm_core.train.trainer import Trainer

    trainer = Trainer(load_config(config, overrides), config).setup()
    model, optimizer = trainer.parts.models[MAIN], trainer.parts.optimizers[MAIN]
    grads: list[int] = []

    def count_grads(opt, args, kwargs) -> None:
        grads.append(
            sum(_local_bytes(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)
        )

    optimizer.register_step_pre_hook(count_grads)
    trainer.train()
    if trainer.saver is not None:
        trainer.saver.close()
    params = list(model.parameters())
    moments = 0
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if hasattr(value, "shape") and value.shape == p.shape:
                moments += _local_bytes(value)
    record = {"params": sum(_local_bytes(p) for p in params), "grads": grads[0], "optimizer": moments}
    Path(f"{out}.rank{os.environ['RANK']}.json").write_text(json.dumps(record), encoding="utf-8")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
    moe = str(moe_config(tmp_path_factory.mktemp("moe")))
    return {
        name: (moe if name == "ep" else str(QUICKSTART), [*COMMON, *extra]) for name, extra in LAYOUTS.items()
    }


@pytest.fixture(scope="module")
def measured(configs, tmp_path_factory) -> dict[str, list[dict]]:
    work = tmp_path_factory.mktemp("measured")
    items = []
    for name, (config, overrides) in configs.items():
        out = [f"training.output_dir={work / name}"]
        items.append(Call(name, "test_simulate:measure", (config, [*overrides, *out], str(work / name))))
    run_in_one_launch(WORLD, items, REPO, timeout=600)
    return {
        name: [
            json.loads(Path(f"{work / name}.rank{r}.json").read_text(encoding="utf-8")) for r in range(WORLD)
        ]
        for name in LAYOUTS
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_simulated_bytes_equal_a_real_run(layout, configs, measured, monkeypatch):
    from mm_core.simulate import simulate

    monkeypatch.chdir(REPO)
    config, overrides = configs[layout]
    cfg = load_config(config, overrides)
    for rank in range(WORLD):
        sim = simulate(cfg, WORLD, rank=rank)
        got = {"params": sim.params, "grads": sim.grads, "optimizer": sim.optimizer}
        assert got == measured[layout][rank], (layout, rank)
    sizes = {r["params"] for r in measured[layout]}
    if layout != "hsdp":  # uneven shards: rank 0 holds more than the last rank
        assert len(sizes) > 1, sizes


KIMI_K2_TEXT = {
    # Kimi K2's published text model (moonshotai/Kimi-K2-Instruct config.json): about 1 T parameters
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "head_dim": 64,
    "v_head_dim": 128,
}


def test_a_trillion_parameter_moe_simulates_at_1024_ranks(tmp_path):
    raw = {
        "parallel": {
            "expert_parallel_size": 32,
            "fsdp_plan": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        },
        "data": quickstart_text_data(8192),
        "model": {
            "model_id": "kimi_k25",
            "from_scratch": True,
            "recompute": True,
            "config_overrides": {"text_config": KIMI_K2_TEXT},
        },
        "training": {"micro_batch_size": 1, "train_iters": 10},
    }
    path = tmp_path / "kimi_k2.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    proc = mm("check", str(path), "--world-size", "1024", "--simulate", "--json", timeout=120)
    report = json.loads(proc.stdout)
    assert report["world_size"] == 1024 and report["layout"] == "FSDP x1024"
    assert report["process_groups"] <= 4  # the world is the FSDP group; efsdp, ep and the size-1 dimensions
    per_rank = report["per_rank_bytes"]
    assert 1.0e12 < per_rank["params"] * 1024 / 4 < 1.1e12  # fp32 shards of about 1 T parameters
    assert per_rank["optimizer"] == 2 * per_rank["grads"]  # AdamW: two moments per trainable parameter
    assert report["fits"] == (per_rank["total"] <= 64 * 2**30)
    assert report["fits"]


def test_simulate_refuses_a_layout_the_world_does_not_fit():
    args = ["--world-size", "6", "--simulate", "parallel.expert_parallel_size=4"]
    proc = mm("check", str(QUICKSTART), *args, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "parallel.expert_parallel_size" in proc.stderr and "Traceback" not in proc.stderr
