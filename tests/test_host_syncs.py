"""The host-sync budget of a training step (docs/performance.md, "Host syncs").

Every step reads its statistics on the host once; anything else that makes the host wait for the device
(reading a value, an op whose output size depends on values, a device synchronize) stalls the queue of
launched work on a GPU or NPU. The probe (tests/_sync_probe.py) counts those calls on CPU, where they would
wait on an accelerator, in real training runs on 2 gloo ranks; a step's count is the difference between a
6-step and a 3-step run, divided by 3. With ``M`` micro-batches per step and ``L`` MoE layers:

- dense (FSDP 2): at most ``M + 1``: the step's read, and one per forward where transformers checks the
  position ids for packed sequences (``masking_utils.find_packed_sequence_indices``);
- context parallel (Ulysses 2): at most the dense count (at most one read per micro-batch of its sequence
  layout, shared by every attention layer, and the step's read);
- MoE: at ``ep`` 1 the dense count (fixed-size counts, grouped products); at ``ep`` 2, with either
  dispatcher, at most ``L x M`` more (the sizes of each MoE layer's exchange, read in its forward); none in
  backward or in the recomputed forward (``model.recompute: true``);
- no device ``synchronize()`` anywhere (``tools.profile`` off);
- the step's read comes after the optimizer update is issued (fused AdamW skips a non-finite step on the
  device).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO
from _sync_probe import per_step, read_log
from _tiny import QWEN3_MOE

MICRO = 2  # micro-batches per step
MOE_LAYERS = QWEN3_MOE["num_hidden_layers"]
COMMON = [
    "training.micro_batch_size=1",
    f"training.gradient_accumulation_steps={MICRO}",
    "training.log_interval=1",
    "training.save=null",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "data.dataset_param.basic_parameters.seq_len=32",
]
MOE = {
    "model_id": "qwen3_moe",
    "from_scratch": True,
    "config_overrides": dict(QWEN3_MOE),
    "loss_cfg": {"loss_type": "per_token_loss", "router_aux_loss_coef": 0.01},
}
#: (name, model: None for the quickstart's dense model, overrides)
LAYOUTS = [
    ("dense", None, []),
    ("cp", None, ["parallel.ulysses_parallel_size=2"]),
    ("moe_ep1", MOE, []),
    ("moe_ep2", MOE, ["parallel.expert_parallel_size=2"]),
    ("moe_ep2_recompute", MOE, ["parallel.expert_parallel_size=2", "model.recompute=true"]),
    (
        "moe_ep2_allgather_recompute",
        MOE,
        ["parallel.expert_parallel_size=2", "parallel.ep_plan.dispatcher=allgather", "model.recompute=true"],
    ),
]


def _config(tmp_path: Path, name: str, model: dict | None) -> Path:
    raw = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    params = raw["data"]["dataset_param"]
    params["preprocess_parameters"]["model_name_or_path"] = str(QUICKSTART.parent / "tokenizer")
    params["basic_parameters"]["dataset_dir"] = str(QUICKSTART.parent / "data")
    raw["model"]["model_name_or_path"] = str(QUICKSTART.parent / "model")
    if model is not None:
        raw["model"] = model
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("syncs")
    calls = [
        Call(name, "_sync_probe:measure", (name, str(_config(tmp, name, model)), [*COMMON, *extra], str(tmp)))
        for name, model, extra in LAYOUTS
    ]
    run_in_one_launch(2, calls, REPO, timeout=600)
    return tmp


def _budget(name: str) -> int:
    """Dense: one read per micro-batch (transformers' check for packed sequences in the position ids, one
    per forward) and the step's one read; the expert exchange adds one per MoE layer and micro-batch."""
    dense = MICRO + 1
    return dense + (MOE_LAYERS * MICRO if name.startswith("moe_ep2") else 0)


@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
@pytest.mark.parametrize("rank", [0, 1])
def test_host_syncs_per_step_within_the_budget(counts: Path, name: str, rank: int) -> None:
    kinds, where = per_step(counts, name, rank)
    shown = "\n  ".join(f"{k}: {v:g}" for k, v in sorted(where.items(), key=lambda kv: -kv[1]))
    total = sum(kinds.values())
    assert "synchronize" not in kinds, f"{name}: device synchronize() in a step:\n  {shown}"
    assert total <= _budget(name), (
        f"{name} (rank {rank}): {total:g} host syncs per step, budget {_budget(name)}; by place:\n  {shown}"
    )


@pytest.mark.parametrize("name", ["dense", "moe_ep2"])
def test_the_step_reads_after_issuing_the_update(counts: Path, name: str) -> None:
    """The step's read (mm_core/tasks/stats.py) comes right after the fused AdamW update is issued, so the
    device runs the update while the host waits for the statistics copied before it."""
    log = read_log(counts, name)
    reads = [i for i, entry in enumerate(log) if "tasks/stats.py" in entry]
    assert len(reads) == 6, f"{name}: {len(reads)} step reads in 6 steps:\n" + "\n".join(log)
    before = [log[i - 1] if i else "(nothing)" for i in reads]
    assert all(entry == "update" for entry in before), f"{name}: before each step's read: {before}"


# the device synchronize() calls mm may make: under the profiler (tools.profile, which times whole steps) and
# Muon's optional per-phase timing (Muon(sync_timing=True), off in training)
_ALLOWED_SYNCHRONIZE = {
    "packages/mm-core/src/mm_core/tools/profile.py",
    "packages/mm-parallel/src/mm_parallel/optim/muon.py",
}


# torch.cuda.synchronize(), getattr(torch, device_type).synchronize(), getattr(module, "synchronize"); not an
# event's synchronize(), which waits for that event only
_DEVICE_SYNCHRONIZE = r"(torch\.\w+|\))\.synchronize\(|[\"']synchronize[\"']"


def test_no_device_synchronize_in_library_code() -> None:
    """A CPU run cannot see a device ``synchronize()`` that is skipped on CPU; the sources name every one."""
    found = []
    for path in sorted(REPO.glob("packages/*/src/**/*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(_DEVICE_SYNCHRONIZE, text):
            line = text.count("\n", 0, m.start()) + 1
            source = text.splitlines()[line - 1].strip()
            if source.startswith("#") or rel in _ALLOWED_SYNCHRONIZE:
                continue
            found.append(f"{rel}:{line}: {source}")
    assert not found, "device synchronize() outside the profiler:\n" + "\n".join(found)
