"""``training.optimizer: muon`` end to end: resume gives the straight run's numbers exactly, 1 process and
2-rank FSDP agree, ``mm check`` shows the Muon/AdamW split, and the clipping policy scales the right grads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _mm import QUICKSTART, assert_close_series, mm, read_metrics
from torch import nn

from mm_core.optim.muon import clip_grad_norm_adamw_only_

SMALL = [
    "data.dataset_param.basic_parameters.seq_len=64",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.optimizer=muon",
    "training.muon.ns_dtype=fp32",
    "training.lr=0.02",
    "training.muon.adamw_lr=0.002",
    "training.log_interval=1",
    "training.save=null",  # not the repository's outputs/ folder (a test that saves says where)
]


def train(tmp: Path, name: str, *overrides: str, nproc: int = 2) -> list[dict]:
    out = tmp / name
    nprocs = ["--nproc-per-node", str(nproc)]
    mm("train", str(QUICKSTART), *SMALL, f"training.output_dir={out}", *overrides, *nprocs)
    return read_metrics(out)


def test_muon_resume_is_exact(tmp_path: Path) -> None:
    # clip_muon_params=false also exercises the AdamW-only clipping path of the trainer
    common = ["training.micro_batch_size=2", "training.train_iters=4", "training.muon.clip_muon_params=false"]
    ckpt = tmp_path / "ckpt"
    straight = train(tmp_path, "straight", *common, f"training.save={ckpt}", "training.save_interval=2")
    load = [f"training.load={ckpt / 'step_2'}", f"training.save={tmp_path / 'ckpt2'}"]
    resumed = train(tmp_path, "resumed", *common, *load)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight[2:]], key
    assert straight[-1]["loss"] < straight[0]["loss"]


def test_muon_one_process_matches_fsdp(tmp_path: Path) -> None:
    common = ["training.train_iters=5", "training.gradient_accumulation_steps=1"]
    one = train(tmp_path, "one", *common, "training.micro_batch_size=4", nproc=1)
    two = train(tmp_path, "two", *common, "training.micro_batch_size=2", nproc=2)
    assert_close_series([r["loss"] for r in one], [r["loss"] for r in two], 1e-5, "loss")
    assert_close_series([r["grad_norm"] for r in one], [r["grad_norm"] for r in two], 1e-4, "grad_norm")


def test_check_prints_split() -> None:
    out = mm("check", str(QUICKSTART), "training.optimizer=muon", "--world-size", "2").stdout
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("optimizer   : muon"))
    assert "adamw" in head
    adamw = [line for line in lines if line.lstrip().startswith("adamw")]
    muon = [line for line in lines if line.lstrip().startswith("muon ")]
    assert any("model.embed_tokens.weight" in line and "lm_head.weight" in line for line in adamw), out
    assert any("model.norm.weight" in line or "layernorm" in line for line in adamw), out
    assert muon and all("embed_tokens" not in line and "norm" not in line for line in muon), out


def test_check_rejects_unmatched_exclude() -> None:
    bad = "training.muon.exclude=[lm_hed.*]"
    proc = mm("check", str(QUICKSTART), "training.optimizer=muon", bad, check=False)
    assert proc.returncode == 2
    assert "training.muon.exclude" in proc.stderr and "lm_head.weight" in proc.stderr


def test_clip_adamw_only_scales_adamw_grads() -> None:
    muon_p, adamw_p = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    muon_p.grad, adamw_p.grad = torch.full((2, 2), 3.0), torch.full((2,), 4.0)
    groups = [{"params": [muon_p], "use_muon": True}, {"params": [adamw_p], "use_muon": False}]
    optimizer = torch.optim.SGD(groups)
    total = clip_grad_norm_adamw_only_([muon_p, adamw_p], optimizer, max_norm=1.0)
    expected = (4 * 9 + 2 * 16) ** 0.5
    assert total.item() == pytest.approx(expected)
    torch.testing.assert_close(muon_p.grad, torch.full((2, 2), 3.0))
    torch.testing.assert_close(adamw_p.grad, torch.full((2,), 4.0 / (expected + 1e-6)))
