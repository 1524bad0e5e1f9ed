"""No device holds the whole model before sharding: ``training.init_model_with_meta_device: auto`` (the
default) builds on the meta device whenever the model can be filled there, and the seeded per-parameter
initialisation (:mod:`mm_parallel.seeded_init`) gives the same initial weights on every layout.

- ``auto`` resolves to true for a from-scratch model and for safetensors weights, and to false with the
  reason for LoRA and for a folder whose weights are not safetensors; ``true``/``false`` are kept.
- With ``parallel.fsdp_plan.cpu_offload`` the meta-built shards are allocated on the host, whatever the
  accelerator (FSDP2's CPU offload keeps sharded parameters there).
- The weights initialised on meta are bit-identical whole tensors on 1 rank and on 2 ranks with FSDP 2 (the
  quickstart's dense Qwen3), and on 2 ranks with expert parallel 2 against 1 rank (a tiny Qwen3-MoE: the
  expert-parallel adapters, initialised after the rest of the model, get the values transformers' pass gives
  the fused experts in one process). Built in one 2-process launch; the 1-rank builds run in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO
from _vlm import make_family_assets
from test_ep_parity import moe_config

from mm_core.config import load_config
from mm_core.parallel.apply import meta_init
from mm_core.tasks.building import materialize_device

SMALL = ["training.micro_batch_size=2", "data.dataset_param.basic_parameters.seq_len=32"]
#: (name, overrides beyond SMALL, the config: None the quickstart, "moe" a tiny Qwen3-MoE, else a family
#: of tests/_vlm.py with images)
BUILDS = [
    ("dense_fsdp", [], None),
    ("moe_ep", ["parallel.expert_parallel_size=2"], "moe"),
    ("kimi_k25_ep", ["parallel.expert_parallel_size=2"], "kimi_k25"),
    ("step3p7_ep", ["parallel.expert_parallel_size=2"], "step3p7"),
]


def test_auto_builds_on_meta_where_the_model_can_be_filled(tmp_path):
    cfg = load_config(QUICKSTART, SMALL)
    assert cfg.training.init_model_with_meta_device == "auto"
    use, why = meta_init("auto", cfg.model, cfg.training.lora)
    assert use and why.startswith("training.init_model_with_meta_device: auto -> true")
    assert meta_init(False, cfg.model, cfg.training.lora) == (
        False,
        "training.init_model_with_meta_device: false",
    )
    assert meta_init(True, cfg.model, cfg.training.lora)[0]

    lora = load_config(QUICKSTART, [*SMALL, "training.lora.enable=true"]).training.lora
    use, why = meta_init("auto", cfg.model, lora)
    assert not use and "LoRA" in why

    folder = tmp_path / "official"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"")
    model = cfg.model.model_copy(update={"from_scratch": False, "model_name_or_path": str(folder)})
    use, why = meta_init("auto", model, cfg.training.lora)
    assert not use and "holds no safetensors" in why
    assert meta_init("auto", model, None)[0] is False  # another model of a task: same rule, no LoRA


def test_cpu_offload_materialises_on_the_host():
    offload = load_config(QUICKSTART, [*SMALL, "parallel.fsdp_plan.cpu_offload=true"]).parallel
    plain = load_config(QUICKSTART, SMALL).parallel
    accelerator = torch.device("cuda", 3)  # a device object only: nothing is allocated on it
    assert materialize_device(offload, accelerator) == torch.device("cpu")
    assert materialize_device(plain, accelerator) == accelerator


def _config(kind: str | None, root: Path) -> Path:
    if kind is None:
        return QUICKSTART
    if kind == "moe":
        return moe_config(root)
    return make_family_assets(root / kind, kind)


def build_whole_weights(config: str, overrides: list[str], out: str) -> None:
    """Build ``config`` on meta with the run's layout, shard, initialise (seed 7) and, on rank 0, save every
    parameter's whole tensor to ``out``. Runs on every rank of a launch (or in a 1-rank group)."""
    import torch.distributed as dist

    from mm_core.models import ModelHub
    from mm_core.parallel.apply import materialize_meta, shard_model
    from mm_core.parallel.state import init_parallel_state
    from mm_core.tasks.building import build_settings, prepare_and_plan

    cfg = load_config(config, [*SMALL, *overrides])
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    plan = prepare_and_plan(model, cfg, build_settings(cfg), state.sizes)
    shard_model(model, plan, state)
    materialize_meta(model, state.device, init=True, model_plan=plan.model_plan, seed=7)
    whole = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    if dist.get_rank() == 0:
        torch.save(whole, out)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The config of each build, and the whole tensors of its build on 2 ranks (one launch)."""
    root = tmp_path_factory.mktemp("seeded")
    configs = {name: str(_config(kind, root)) for name, _, kind in BUILDS}
    items = [
        Call(
            name,
            "test_meta_default:build_whole_weights",
            (configs[name], overrides, str(root / f"{name}.pt")),
        )
        for name, overrides, _ in BUILDS
    ]
    run_in_one_launch(2, items, REPO, 300)
    return root, configs


@pytest.mark.parametrize("name", [b[0] for b in BUILDS])
def test_initial_weights_do_not_depend_on_the_layout(sharded, name, group, tmp_path):
    root, configs = sharded
    overrides = next(b[1] for b in BUILDS if b[0] == name)
    one = [o for o in overrides if "expert_parallel_size" not in o]
    build_whole_weights(configs[name], one, str(tmp_path / "one.pt"))
    single = torch.load(tmp_path / "one.pt", weights_only=True)
    two = torch.load(root / f"{name}.pt", weights_only=True)
    assert list(single) == list(two)
    for key in single:
        assert torch.equal(single[key], two[key]), key
    # the draws are not all equal: the seeded fills differ between parameters
    weights = [t for k, t in single.items() if k.endswith("weight") and t.dim() == 2]
    a, b = weights[0], weights[1]
    assert not torch.equal(a[: b.shape[0], : b.shape[1]], b[: a.shape[0], : a.shape[1]])
