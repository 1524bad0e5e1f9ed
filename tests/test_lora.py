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


def test_adapters_only_checkpoints_resume_and_merge(tmp_path):
    """``training.lora.save_adapters_only``: the checkpoint's model part is the adapters alone; resuming from
    it continues the run exactly (base weights come from model_name_or_path), and dcp-to-hf still merges."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, Qwen3ForCausalLM

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    Qwen3ForCausalLM(AutoConfig.from_pretrained(QUICKSTART.parent / "model")).save_pretrained(base_dir)
    base = load_file(base_dir / "model.safetensors")
    common = [
        f"model.model_name_or_path={base_dir}",
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
        "--nproc-per-node",
        "2",
    ]
    ckpt = tmp_path / "ckpt"
    mm(
        "train",
        str(QUICKSTART),
        *common,
        f"training.save={ckpt}",
        "training.save_interval=4",
        f"training.output_dir={tmp_path / 'straight'}",
        timeout=180,
    )
    keys = set(FileSystemReader(str(ckpt / "step_4")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys), sorted(model_keys)[:5]

    mm(
        "train",
        str(QUICKSTART),
        *common,
        "training.save=null",
        f"training.load={ckpt / 'step_4'}",
        f"training.output_dir={tmp_path / 'resumed'}",
        timeout=180,
    )
    straight = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight")}
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resumed")}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)

    mm("convert", "dcp-to-hf", str(ckpt), str(tmp_path / "hf"))
    merged = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "step_8", tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    a = saved["model.layers.1.self_attn.v_proj.lora_A.default.weight"]
    b = saved["model.layers.1.self_attn.v_proj.lora_B.default.weight"]
    expect = base["model.layers.1.self_attn.v_proj.weight"] + (16 / 8) * b @ a
    torch.testing.assert_close(merged["model.layers.1.self_attn.v_proj.weight"], expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
