"""``mm check`` runs the worker's build pipeline, stopping before execution: for a dense model, a MoE model
with expert parallelism, LoRA, a vision-language model and a task with two models, the lines ``mm check``
prints about each model's build (parameter counts after ``model.freeze`` and LoRA, FSDP and expert units, the
loss head, the memory estimate) equal the lines the workers log when they build the same config.

One launch of 2 gloo processes builds every config (each task's ``build()``: every model, sharded); the
checks run in this process at world size 2."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import START_METHOD
from _mm import QUICKSTART, REPO

from mm_core.check import run_check
from mm_core.config import load_config
from mm_core.config.schema import MMConfig
from mm_core.parallel.state import init_parallel_state
from mm_core.registry import model_register, task_register
from mm_core.tasks.base import TaskContext, task_class

WORLD = 2
GAN = REPO / "tests" / "plugins" / "tiny-gan-task" / "src"
SMALL = [
    "data.dataset_param.basic_parameters.seq_len=32",
    "model.model_name_or_path=null",
    "training.micro_batch_size=2",
    "training.progress_bar=false",
    "training.save=null",
    "tools.tensorboard.enable=false",
]
DENSE = (
    "model.config_overrides={vocab_size: 4096, num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, "
    "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}"
)
TEXT = "vocab_size: 64, hidden_size: 16, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1"
VL_ROPE = "rope_scaling: {rope_type: default, mrope_section: [2, 1, 1]}"
VL_TEXT = f"{TEXT}, head_dim: 8, intermediate_size: 32, {VL_ROPE}"
CONFIGS: dict[str, list[str]] = {
    "dense": [DENSE, "model.recompute=true"],
    "moe_ep": [
        "model.model_id=qwen3_moe",
        f"model.config_overrides={{{TEXT}, num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 8, "
        "intermediate_size: 32}",
        "parallel.expert_parallel_size=2",
    ],
    "lora": [
        DENSE,
        "training.init_model_with_meta_device=false",
        "training.lora.enable=true",
        "training.lora.target_modules=[q_proj,v_proj]",
    ],
    "vlm": [
        "model.model_id=qwen3_vl",
        f"model.config_overrides={{text_config: {{{VL_TEXT}}}, vision_config: {{depth: 1, hidden_size: 16, "
        "intermediate_size: 32, num_heads: 2, out_hidden_size: 16, deepstack_visual_indexes: []}}",
        "parallel.fsdp_plan.apply_modules=[]",
    ],
    "two_models": [
        "model.model_id=tiny_gan_lm",
        "model.config_overrides={vocab_size: 4096, hidden: 32, n_blocks: 2}",
        "parallel.fsdp_plan.apply_modules=[]",
        "model.recompute=false",
        "training.task=lm_gan",
        "training.task_param={critic: {vocab_size: 4096, hidden: 16, n_blocks: 1}, critic_lr: 0.003}",
    ],
}


def _register_gan() -> None:
    """The tiny-gan-task plugin's task and models, registered in this process (as its entry points do)."""
    if str(GAN) not in sys.path:
        sys.path.insert(0, str(GAN))
    from tiny_gan_task.models import TinyCritic, TinyLM
    from tiny_gan_task.task import LMGanTask

    for register, name, obj in (
        (model_register, "tiny_gan_lm", TinyLM),
        (model_register, "tiny_gan_critic", TinyCritic),
        (task_register, "lm_gan", LMGanTask),
    ):
        register.unregister(name)
        register.register(name)(obj)


def _config(name: str) -> MMConfig:
    return load_config(QUICKSTART, [*SMALL, *CONFIGS[name]])


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.chdir(REPO)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _register_gan()
        for name in CONFIGS:
            cfg = _config(name)
            state = init_parallel_state(cfg.parallel, "cpu")
            ctx = TaskContext(cfg, state, None)
            task_class(cfg.training.task)(ctx).build()
            if rank == 0:
                Path(out_dir, f"{name}.json").write_text(json.dumps(ctx.build_log), encoding="utf-8")
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def worker_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    out = tmp_path_factory.mktemp("worker_logs")
    init = Path(tempfile.mkdtemp()) / "init"
    mp.start_processes(
        _worker, args=(str(init), str(out)), nprocs=WORLD, join=True, start_method=START_METHOD
    )
    return {name: json.loads((out / f"{name}.json").read_text(encoding="utf-8")) for name in CONFIGS}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_check_prints_what_the_worker_logs(
    worker_logs: dict[str, list[str]], name: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.chdir(REPO)
    _register_gan()
    run_check(_config(name), WORLD)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("build ")]
    logged = worker_logs[name]
    assert printed == logged
    assert len(logged) == 5 * (2 if name == "two_models" else 1)
    if name == "lora":  # counted after the adapters: only they train
        assert "LoRA adapters on 4)" in logged[0] and "trainable, 0 frozen" not in logged[0]
    if name == "moe_ep":
        assert "2 expert-parallel modules (ep=2)" in logged[1]
