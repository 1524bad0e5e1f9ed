"""``training.optimizer: muon`` end to end: resume gives the straight run's numbers exactly, 1 process and
2-rank FSDP agree, ``mm check`` shows the Muon/AdamW split, and the clipping policy scales the right grads.

The training runs are ``mm train`` workers' runs, those of one test and one process count in one launch
(:mod:`_launch`); ``mm check`` runs as a user runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, assert_close_series, mm, read_metrics
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


def train(tmp: Path, runs: list[tuple[str, list[str]]], nproc: int = 2) -> dict[str, list[dict]]:
    """``runs`` (name, overrides) one after the other in one launch of ``nproc`` processes; their metrics."""
    items = [
        (name, str(QUICKSTART), [*SMALL, f"training.output_dir={tmp / name}", *extra]) for name, extra in runs
    ]
    run_in_one_launch(nproc, items, REPO, timeout=600 * len(items))
    return {name: read_metrics(tmp / name) for name, _ in runs}


def test_muon_resume_is_exact(tmp_path: Path) -> None:
    # clip_muon_params=false also exercises the AdamW-only clipping path of the trainer
    common = ["training.micro_batch_size=2", "training.train_iters=4", "training.muon.clip_muon_params=false"]
    ckpt = tmp_path / "ckpt"
    load = [f"training.load={ckpt / 'step_2'}", f"training.save={tmp_path / 'ckpt2'}"]
    runs = train(
        tmp_path,
        [
            ("straight", [*common, f"training.save={ckpt}", "training.save_interval=2"]),
            ("resumed", [*common, *load]),
        ],
    )
    straight, resumed = runs["straight"], runs["resumed"]
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight[2:]], key
    assert straight[-1]["loss"] < straight[0]["loss"]


def test_muon_one_process_matches_fsdp(tmp_path: Path) -> None:
    common = ["training.train_iters=5", "training.gradient_accumulation_steps=1"]
    one = train(tmp_path, [("one", [*common, "training.micro_batch_size=4"])], nproc=1)["one"]
    two = train(tmp_path, [("two", [*common, "training.micro_batch_size=2"])], nproc=2)["two"]
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
