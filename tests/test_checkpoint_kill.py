"""A save killed mid-way (SIGKILL of a real process inside ``dcp.save``) leaves ``latest`` on the previous
checkpoint, which still loads; ``training.load: auto`` picks it, and the next save replaces the debris."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch
from torch import nn

from mm_core.checkpoint import TrainingState, load_checkpoint, read_latest, resolve_load_path, save_checkpoint
from mm_core.checkpoint.layout import partial_dir

SAVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from mm_core.checkpoint import TrainingState, save_checkpoint

    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(1024, 1024)) for _ in range(48)])  # 192 MB
    ts = TrainingState(model=model)
    save_checkpoint(sys.argv[1], 1, ts)
    print("saved 1", flush=True)
    with torch.no_grad():
        for p in model:
            p.add_(1.0)
    save_checkpoint(sys.argv[1], 2, ts)
    print("saved 2", flush=True)
    """
)


def _model() -> nn.Module:
    return nn.ParameterList([nn.Parameter(torch.zeros(1024, 1024)) for _ in range(48)])


def test_save_killed_midway_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(root)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        data = partial_dir(root, 2) / "__0_0.distcp"
        deadline = time.monotonic() + 120
        while not (data.is_file() and data.stat().st_size > 0):  # kill while DCP is writing step 2
            assert proc.poll() is None, "the save finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert partial_dir(root, 2).is_dir() and not (partial_dir(root, 2) / ".metadata").exists()
    assert not (root / "step_2").exists()
    assert read_latest(root).name == "step_1"
    assert resolve_load_path("auto", str(root)).name == "step_1"

    torch.manual_seed(0)
    expected = [torch.randn(1024, 1024) for _ in range(48)]
    fresh = TrainingState(model=_model())
    load_checkpoint(resolve_load_path("auto", str(root)), fresh)
    assert all(torch.equal(p, e) for p, e in zip(fresh.model, expected))

    # the next save of the same step clears the debris and completes
    save_checkpoint(root, 2, fresh)
    assert read_latest(root).name == "step_2" and not partial_dir(root, 2).exists()
