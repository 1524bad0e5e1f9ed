"""Exact resume and crash recovery, end to end on 2 ranks in fp32.

"10 steps straight" and "5 steps, stop, resume for 5" give bit-identical losses with gradient accumulation,
dataloader workers and attention dropout on; without the saved random state they do not (so the test can
fail). Under ``torchrun --max-restarts=1`` a worker killed mid-training restarts the job, which resumes from
the last checkpoint (``training.load: auto``) and ends with the same weights as the uninterrupted run; SIGTERM
to one worker of ``mm train --nproc-per-node 2`` saves a checkpoint that ``load: auto`` resumes bit-exactly.

The runs that test no launcher (the uninterrupted run, the two resumed from its step 5, the run resumed after
the SIGTERM) run in launches of 2 processes (see :mod:`_launch`); the crash and the SIGTERM go to real
``torchrun`` and ``mm train`` launches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, checkpoint_tensors, read_metrics

from mm_core.checkpoint import read_latest

COMMON = [
    "training.log_interval=1",
    "training.seed=5",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
    "data.dataloader_param.num_workers=2",
    "model.config_overrides.attention_dropout=0.1",
    "parallel.fsdp_plan.param_dtype=fp32",
    "training.lr_warmup_ratio=0.2",
    "training.lr_decay_style=cosine",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.train_iters=10",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The output folders of "10 steps straight" (saved at steps 5 and 10) and of the two runs resumed from
    its step 5 for 5 steps, with and without its saved random state: one launch of 2 processes."""
    d = {name: tmp_path_factory.mktemp(name) for name in ("straight", "resumed", "no_rng")}
    straight = [*COMMON, "training.save_interval=5", f"training.save={d['straight'] / 'ckpt'}"]
    resume = [*COMMON, f"training.load={d['straight'] / 'ckpt' / 'step_5'}", "training.save=null"]
    runs = {"straight": straight, "resumed": resume, "no_rng": [*resume, "training.no_load_rng=true"]}
    items = [(name, str(QUICKSTART), [*runs[name], f"training.output_dir={d[name]}"]) for name in runs]
    run_in_one_launch(2, items, REPO, timeout=900)
    return d


@pytest.fixture(scope="module")
def straight(runs) -> Path:
    return runs["straight"]


def test_stop_and_resume_is_bit_identical(runs, straight):
    ref = {r["step"]: r for r in read_metrics(straight)}
    resumed = read_metrics(runs["resumed"])
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    for r in resumed:
        assert (r["loss"], r["grad_norm"], r["lr"]) == (
            ref[r["step"]]["loss"],
            ref[r["step"]]["grad_norm"],
            ref[r["step"]]["lr"],
        ), r["step"]


def test_without_saved_rng_dropout_differs(runs, straight):
    """The control: dropout draws from the restored generators, so skipping them changes the losses."""
    ref = {r["step"]: r["loss"] for r in read_metrics(straight)}
    resumed = read_metrics(runs["no_rng"])
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    assert any(r["loss"] != ref[r["step"]] for r in resumed)


def _worker_pid(agent: int, rank: int) -> int | None:
    """The worker process of ``rank`` started by the torchrun agent ``agent``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def test_killed_worker_restarts_and_resumes_to_equal_weights(straight, tmp_path):
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "mm_core.train", str(QUICKSTART),
           *COMMON,
           "training.save_interval=2", f"training.save={save}", "training.load=auto",
           f"training.output_dir={tmp_path}"]  # fmt: skip
    # torchrun's c10d rendezvous shares its TCP store with the workers by default, and a restarted worker may
    # then read the previous attempt's gloo addresses (pytorch/pytorch#135712); a store per attempt avoids it
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115 - closed in the finally below
    agent = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed_at = None
    try:
        deadline = time.monotonic() + 240
        while killed_at is None:
            assert agent.poll() is None, "the run ended before a worker could be killed"
            assert time.monotonic() < deadline
            latest = (save / "latest").read_text().strip() if (save / "latest").is_file() else ""
            if latest and int(latest.split("_")[1]) >= 4 and (pid := _worker_pid(agent.pid, 1)):
                os.kill(pid, signal.SIGKILL)
                killed_at = latest
            time.sleep(0.05)
        assert agent.wait(timeout=240) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert f"loaded {save}/step_" in output, output[-3000:]  # the restarted job resumed from a checkpoint
    assert read_latest(save).name == "step_10"
    ours, ref = checkpoint_tensors(save / "step_10"), checkpoint_tensors(straight / "ckpt" / "step_10")
    assert ours.keys() == ref.keys()
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k


def _spawned_workers(launcher: int) -> list[int]:
    """The worker processes the ``mm train --nproc-per-node`` launcher ``launcher`` started."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            out.append(int(entry))
    return sorted(out)


def test_sigterm_to_one_worker_saves_and_resumes_bit_exactly(straight, tmp_path):
    """SIGTERM to one rank (as a scheduler's preemption would reach it): every rank finishes the same step,
    the checkpoint is saved and published, the launcher exits with 75, and ``load: auto`` resumes to the same
    losses as the uninterrupted run."""
    save = tmp_path / "ckpt"
    overrides = [*COMMON, "training.save_interval=100", f"training.save={save}", "training.load=auto",
                 f"training.output_dir={tmp_path}"]  # fmt: skip
    cmd = [sys.executable, "-m", "mm_core.cli", "train", str(QUICKSTART), *overrides, "--nproc-per-node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        workers = _spawned_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGTERM)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, output[-3000:]
    stopped = read_latest(save)
    assert stopped is not None and 3 <= int(stopped.name.split("_")[1]) < 10, output[-3000:]
    assert f"saved {stopped}; resume with training.load: auto" in output, output[-3000:]

    # the same run again (its workers in one launch): load: auto resumes
    run_in_one_launch(2, [("again", str(QUICKSTART), overrides)], REPO, timeout=300)
    ref = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(straight)]
    ours = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(tmp_path)]
    assert ours == ref
