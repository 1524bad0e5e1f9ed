"""LoRA through peft on 2 FSDP ranks: only adapters train (base weights unchanged), the loss falls, and
``mm convert dcp-to-hf`` merges the adapters into plain transformers weights."""

from __future__ import annotations

import torch
from _mm import QUICKSTART, mm, read_metrics
from safetensors.torch import load_file


def test_lora_trains_adapters_only_and_merges(tmp_path):
    from transformers import AutoConfig, Qwen3ForCausalLM

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    config = AutoConfig.from_pretrained(QUICKSTART.parent / "model")
    Qwen3ForCausalLM(config).save_pretrained(base_dir)
    base = load_file(base_dir / "model.safetensors")
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    mm(
        "train",
        str(QUICKSTART),
        f"model.model_name_or_path={base_dir}",
        "model.from_scratch=false",
        "training.lora.enable=true",
        "training.lora.rank=8",
        "training.lora.alpha=16",
        "training.lora.target_modules=[q_proj,v_proj,gate_proj]",
        "training.lr=1e-2",
        "training.train_iters=12",
        "training.lr_warmup_ratio=0",
        "training.log_interval=1",
        f"training.save={ckpt}",
        "training.save_interval=12",
        f"training.output_dir={out}",
        "training.progress_bar=false",
        "tools.tensorboard.enable=false",
        "data.dataset_param.basic_parameters.seq_len=64",
        "--nproc-per-node",
        "2",
        timeout=120,
    )
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

    mm("convert", "dcp-to-hf", str(ckpt), str(tmp_path / "hf"))
    merged = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert not any("lora" in k or "base_layer" in k for k in merged)
    a = saved["model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    b = saved["model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    expect = base["model.layers.0.self_attn.q_proj.weight"] + (16 / 8) * b @ a
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        merged["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"]
    )
