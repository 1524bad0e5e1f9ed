"""Accelerator readiness of the training step (issue #12): every collective of a training run gets tensors on
the trainer's configured device, and the loop makes at most one host sync per optimizer step (for logging).

Two real gloo ranks train the quickstart model in-process under :class:`_device_audit.DeviceAudit` (test-side
torch modes; nothing in mm or torch is patched, no collective is faked). On a CPU machine the configured
device is the CPU, so the audit gives tensors that mm's step code creates without a device the ``meta``
device: the device check then fails on every machine exactly where it would fail on a GPU or NPU. The
controls at the end show that the instruments catch a misplaced collective, an implicit-device tensor and
extra host syncs.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _device_audit import DeviceAudit
from _launch import START_METHOD
from _mm import QUICKSTART, REPO

WORLD = 2
STEPS = 2
OVERRIDES = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",  # the worst case: a logged record every step
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.save=null",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "parallel.timeout_minutes=2",  # a rank that fails alone must not leave the other waiting for 30 minutes
]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
    )
    from mm_core.config.loader import load_config
    from mm_core.train.trainer import Trainer

    torch.set_num_threads(1)
    os.chdir(REPO)  # the quickstart's paths are relative to the repository root
    cfg = load_config(str(QUICKSTART), [*OVERRIDES, f"training.output_dir={out}/run"])
    trainer = Trainer(cfg, str(QUICKSTART)).setup()
    try:
        audit = DeviceAudit(trainer.state.device)
        start = trainer.progress.step
        with audit:
            trainer.train()
        result = {
            "device": str(trainer.state.device),
            "backend": str(dist.get_backend()),
            "steps": trainer.progress.step - start,
            **audit.summary(),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    finally:
        trainer.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("device_placement")
    mp.start_processes(
        _worker, args=(_free_port(), str(out)), nprocs=WORLD, start_method=START_METHOD, join=True
    )
    return [json.loads(Path(out, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(WORLD)]


def test_every_collective_of_training_is_on_the_configured_device(audited):
    for rank, result in enumerate(audited):
        ops = " ".join(result["collectives"])
        # the instrument really saw the step's traffic: FSDP2's all-gathers and reduce-scatters, all-reduces
        assert "allgather" in ops or "all_gather" in ops, (rank, result["collectives"])
        assert "reduce_scatter" in ops, (rank, result["collectives"])
        assert "allreduce" in ops or "all_reduce" in ops, (rank, result["collectives"])
        assert result["implicit_device"] == {}, (
            f"rank {rank}: tensors created by the step code without a device (they would land on the CPU on "
            f"an accelerator): {result['implicit_device']}"
        )
        off = result["violations"]
        assert off == [], f"rank {rank}: collectives off {result['device']}: {off}"


def test_at_most_one_host_sync_per_optimizer_step(audited):
    for rank, result in enumerate(audited):
        total = sum(result["syncs"].values())
        assert total <= result["steps"], (
            f"rank {rank}: {total} host syncs in {result['steps']} optimizer steps (at most one per step, "
            f"for logging): {result['syncs']}"
        )


def test_process_group_backend(audited):
    """On CPU the group is plain gloo (on accelerators ``cuda:nccl,cpu:gloo``, see mm_parallel.device)."""
    assert {r["backend"] for r in audited} == {"gloo"}
    assert {r["device"] for r in audited} == {"cpu"}


# ------------------------------------------------------------------------------------------------ controls
def _as_step_code(source: str, name: str = "mm_core.train._control") -> types.FunctionType:
    """A function whose frames belong to module ``name``, as a function of mm's step code would."""
    namespace = {"__name__": name, "torch": torch, "dist": dist}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace["step"]


@pytest.fixture
def one_rank_group():
    """A real 1-rank gloo group (collectives run; nothing is faked)."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(minutes=1)
    )
    yield
    dist.destroy_process_group()


def test_control_collective_off_the_configured_device_is_caught(one_rank_group):
    step = _as_step_code("def step():\n    t = torch.ones(2, device='cpu')\n    dist.all_reduce(t)\n")
    with DeviceAudit(torch.device("cpu")) as audit:
        step()
    assert audit.violations == [] and len(audit.collectives) == 1
    with DeviceAudit(torch.device("meta")) as audit:  # declared device differs from where the tensor is
        step()
    assert [c.op for c in audit.violations] == ["c10d::allreduce_"]
    assert "mm_core.train._control:3" in audit.violations[0].site


def test_control_tensor_without_device_is_caught(one_rank_group):
    step = _as_step_code("def step():\n    t = torch.tensor([1.0, 2.0])\n    dist.all_reduce(t)\n")
    caught = pytest.raises(AssertionError, match=r"mm_core.train._control:3 .*created without a device")
    with caught, DeviceAudit(torch.device("cpu")):
        step()
    # the same code outside mm's step code (e.g. the data pipeline's host tensors) is not touched
    with DeviceAudit(torch.device("cpu")) as audit:
        _as_step_code(
            "def step():\n    t = torch.tensor([1.0])\n    dist.all_reduce(t)\n", name="mm_core.data._x"
        )()
    assert audit.implicit_device == {} and audit.violations == []


def test_control_host_syncs_are_counted(one_rank_group):
    step = _as_step_code(
        "def step(x):\n"
        "    a = x.sum().item()\n"
        "    b = float(x.max())\n"
        "    c = x.tolist()\n"
        "    d = int(x[0])\n"
        "    return x * 2\n"
    )
    with DeviceAudit(torch.device("cpu")) as audit:
        step(torch.arange(3.0))
    assert sorted(audit.syncs) == [
        "mm_core.train._control:2 (step) .item()",
        "mm_core.train._control:3 (step) .__float__()",
        "mm_core.train._control:4 (step) .tolist()",
        "mm_core.train._control:5 (step) .__int__()",
    ]
    with DeviceAudit(torch.device("cpu")) as audit:  # arithmetic alone is no sync
        _as_step_code("def step(x):\n    return (x * 2).sum()\n")(torch.arange(3.0))
    assert audit.syncs == {}
