"""LoRA through peft on 2 FSDP ranks: only adapters train (base weights unchanged), the loss falls, and
``mm convert dcp-to-hf`` merges the adapters into plain transformers weights.

The module's three training runs are ``mm train --nproc-per-node 2`` workers' runs in one launch of 2
processes (see :mod:`_launch`), followed by a call that exports each test's checkpoints with the function
behind ``mm convert dcp-to-hf`` (its default options)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO, read_metrics
from safetensors.torch import load_file

#: the overrides of test_lora_trains_adapters_only_and_merges's run (into the folder ``{d}``)
MERGED = [
    "model.model_name_or_path={d}/base",
    "model.from_scratch=false",
    "training.lora.enable=true",
    "training.lora.rank=8",
    "training.lora.alpha=16",
    "training.lora.target_modules=[q_proj,v_proj,gate_proj]",
    "training.lr=1e-2",
    "training.train_iters=12",
    "training.lr_warmup_ratio=0",
    "training.log_interval=1",
    "training.save={d}/ckpt",
    "training.save_interval=12",
    "training.output_dir={d}/run",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "data.dataset_param.basic_parameters.seq_len=64",
]
#: test_adapters_only_checkpoints_resume_and_merge: the overrides both its runs share, then each run's own
ADAPTERS_COMMON = [
    "model.model_name_or_path={d}/base",
    "model.from_scratch=false",
    "training.lora.enable=true",
    "training.lora.save_adapters_only=true",
    "training.lora.target_modules=[q_proj,v_proj]",
    "training.lr=1e-2",
    "training.train_iters=8",
    "training.lr_warmup_ratio=0",
    "training.log_interval=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.micro_batch_size=2",
    "data.dataset_param.basic_parameters.seq_len=64",
]
STRAIGHT = [
    *ADAPTERS_COMMON,
    "training.save={d}/ckpt",
    "training.save_interval=4",
    "training.output_dir={d}/straight",
]
RESUMED = [
    *ADAPTERS_COMMON,
    "training.save=null",
    "training.load={d}/ckpt/step_4",
    "training.output_dir={d}/resumed",
]


def export(*folders: str) -> None:
    """Rank 0: ``mm convert dcp-to-hf FOLDER/ckpt FOLDER/hf`` for each folder (the function behind it)."""
    if os.environ["RANK"] == "0":
        from mm_core import convert

        for folder in folders:
            convert.dcp_to_hf(Path(folder) / "ckpt", Path(folder) / "hf")


def _save_base(d: Path) -> dict[str, torch.Tensor]:
    """A random base model in ``d/base``; its weights as written (read before any run)."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(AutoConfig.from_pretrained(QUICKSTART.parent / "model")).save_pretrained(d / "base")
    return load_file(d / "base" / "model.safetensors")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """Per test (``merged``, ``adapters_only``): its folder, with its random base model (``base``), its runs'
    outputs and checkpoints and the Hugging Face export of its checkpoints (``hf``); and the base weights."""
    d = {name: tmp_path_factory.mktemp(name) for name in ("merged", "adapters_only")}
    bases = {name: _save_base(folder) for name, folder in d.items()}

    def run(name: str, overrides: list[str], folder: Path):
        return (name, str(QUICKSTART), [o.format(d=folder) for o in overrides])

    items = [
        run("merged", MERGED, d["merged"]),
        run("straight", STRAIGHT, d["adapters_only"]),
        run("resumed", RESUMED, d["adapters_only"]),
        Call("export", f"{__name__}:export", (str(d["merged"]), str(d["adapters_only"]))),
    ]
    run_in_one_launch(2, items, REPO, timeout=600)
    return {name: (d[name], bases[name]) for name in d}


def test_lora_trains_adapters_only_and_merges(trained):
    from transformers import Qwen3ForCausalLM

    tmp_path, base = trained["merged"]
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    losses = [r["loss"] for r in read_metrics(out)]
    assert losses[-1] < losses[0] - 0.3, losses
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "step_12", tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    adapters = [k for k in saved if ".lora_" in k]
    assert adapters, "no adapter weights in the checkpoint"
    for k, v in saved.items():
        name = k.replace(".base_layer", "")
        if ".lora_" not in k and name in base:
            assert torch.equal(v, base[name]), f"base weight {name} changed"
    assert any(not torch.all(saved[k] == 0) for k in adapters if "lora_B" in k)

    merged = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert not any("lora" in k or "base_layer" in k for k in merged)
    a = saved["model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    b = saved["model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    expect = base["model.layers.0.self_attn.q_proj.weight"] + (16 / 8) * b @ a
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        merged["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"]
    )


def test_adapters_only_checkpoints_resume_and_merge(trained):
    """``training.lora.save_adapters_only``: the checkpoint's model part is the adapters alone; resuming from
    it continues the run exactly (base weights come from model_name_or_path), and dcp-to-hf still merges."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import Qwen3ForCausalLM

    tmp_path, base = trained["adapters_only"]
    ckpt = tmp_path / "ckpt"
    keys = set(FileSystemReader(str(ckpt / "step_4")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys), sorted(model_keys)[:5]

    straight = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight")}
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resumed")}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)

    merged = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "step_8", tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    a = saved["model.layers.1.self_attn.v_proj.lora_A.default.weight"]
    b = saved["model.layers.1.self_attn.v_proj.lora_B.default.weight"]
    expect = base["model.layers.1.self_attn.v_proj.weight"] + (16 / 8) * b @ a
    torch.testing.assert_close(merged["model.layers.1.self_attn.v_proj.weight"], expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
