"""The examples' launch scripts take the processes per node from NPROC_PER_NODE or, as the MindSpeed-MM
scripts name it, NPUS_PER_NODE (run here with a stand-in ``torchrun`` that prints its arguments)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _mm import REPO

SCRIPTS = sorted(REPO.glob("examples/*/train.sh"))


@pytest.fixture
def fake_torchrun(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "torchrun").write_text('#!/bin/sh\necho torchrun "$@"\n', encoding="utf-8")
    (tmp_path / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "NPUS_PER_NODE")}
    return dict(env, PATH=f"{tmp_path}:{env['PATH']}")


def _launch(env: dict[str, str], **ranks: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "examples/quickstart/train.sh"],
        cwd=REPO,
        env=dict(env, **ranks),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ({}, "2"),
        ({"NPUS_PER_NODE": "8"}, "8"),
        ({"NPROC_PER_NODE": "4"}, "4"),
        ({"NPUS_PER_NODE": "4", "NPROC_PER_NODE": "4"}, "4"),
    ],
)
def test_processes_per_node(fake_torchrun: dict[str, str], ranks: dict[str, str], expected: str) -> None:
    proc = _launch(fake_torchrun, **ranks)
    assert proc.returncode == 0, proc.stderr
    assert f"--nproc_per_node {expected} " in proc.stdout


def test_disagreeing_counts_are_refused(fake_torchrun: dict[str, str]) -> None:
    proc = _launch(fake_torchrun, NPUS_PER_NODE="8", NPROC_PER_NODE="4")
    assert proc.returncode == 2
    assert "NPUS_PER_NODE=8 and NPROC_PER_NODE=4 disagree" in proc.stderr
    assert "torchrun" not in proc.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_every_script_resolves_both_names(script: Path) -> None:
    """Every launch script resolves the count the same way before it starts any process."""
    lines = [line.strip() for line in script.read_text(encoding="utf-8").splitlines()]
    resolve = lines.index('NPROC_PER_NODE="${NPROC_PER_NODE:-${NPUS_PER_NODE:-2}}"')
    launch = next(
        i
        for i, line in enumerate(lines)
        if not line.startswith("#") and ("torchrun" in line or "--nproc-per-node" in line)
    )
    assert resolve < launch
    assert not any("${NPROC_PER_NODE:-2}" in line for line in lines)


@pytest.mark.parametrize("gpu", [True, False], ids=["nvidia-gpu", "cpu"])
def test_accelerator_runs_in_bf16_with_fp32_reduce(fake_torchrun: dict[str, str], gpu: bool) -> None:
    """On a node with an accelerator (here a stand-in ``nvidia-smi -L`` that succeeds) the launch adds bf16
    parameters and fp32 reduction before the user's overrides, which still win; on a CPU node nothing."""
    if Path("/usr/local/Ascend/ascend-toolkit/set_env.sh").is_file():
        pytest.skip("an Ascend toolkit on this machine makes every node an accelerator node")
    bindir = Path(fake_torchrun["PATH"].split(":", 1)[0])
    (bindir / "nvidia-smi").write_text(f"#!/bin/sh\nexit {0 if gpu else 1}\n", encoding="utf-8")
    (bindir / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(
        ["bash", "examples/quickstart/train.sh", "training.lr=1e-4"],
        cwd=REPO,
        env=fake_torchrun,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    dtypes = "parallel.fsdp_plan.param_dtype=bf16 parallel.fsdp_plan.reduce_dtype=fp32 training.lr=1e-4"
    assert (dtypes in proc.stdout) == gpu, proc.stdout


def test_every_script_uses_accelerator_dtypes() -> None:
    dtypes = "DTYPES=(parallel.fsdp_plan.param_dtype=bf16 parallel.fsdp_plan.reduce_dtype=fp32)"
    for script in SCRIPTS:
        text = script.read_text(encoding="utf-8")
        assert dtypes in text, script
        assert '${DTYPES[@]+"${DTYPES[@]}"} "$@"' in text, script
