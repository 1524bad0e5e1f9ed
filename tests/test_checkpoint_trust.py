"""A checkpoint is data, never code, and a broken one is one line naming the file and the tensor.

A crafted ``.metadata`` is refused without running its payload (``mm convert dcp-to-hf`` and
``training.load`` on 2 ranks); values stored as pickled objects are refused; ``mm convert`` never imports a
module named in the checkpoint's saved config; a truncated ``.distcp`` and a checkpoint of a different shape
are one line on every rank; non-finite weights are not exported unless ``--allow-nonfinite``."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, mm_here
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from mm_core.checkpoint.reader import load_dcp, read_metadata
from mm_core.config import validate_config
from mm_core.convert import dcp_to_hf
from mm_core.errors import CheckpointError, ConfigError

COMMON = [
    "training.seed=7",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=1",
    "training.gradient_accumulation_steps=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
]
PROBE_MODULE = "mm_trust_probe_plugin"


class Payload:
    """Pickles as a call of ``func(arg)``: what a crafted file would run when unpickled."""

    def __init__(self, func, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def _exec_payload(marker: Path) -> Payload:
    return Payload(exec, f"open({str(marker)!r}, 'w').write('ran')")


def _system_payload(marker: Path) -> Payload:
    return Payload(os.system, f"touch {marker}")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _run(args: list[str], env_path: Path | None = None) -> subprocess.CompletedProcess:
    """``mm`` in the repository (the quickstart's paths are relative to it), optionally with an extra
    folder on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if env_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(env_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "mm_core.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mm: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A real 2-rank checkpoint (model, optimizer, progress, data position, random state), variants of it and
    every ``mm`` command of this module, run a few at a time: name -> finished process."""
    d = tmp_path_factory.mktemp("trust")
    train = ("train", str(QUICKSTART), [*COMMON, "training.train_iters=1", f"training.save={d / 'ckpt'}",
                                         f"training.output_dir={d / 'out'}"])  # fmt: skip
    run_in_one_launch(2, [train], REPO, timeout=300)
    good = d / "ckpt" / "step_1"
    markers = d / "markers"
    markers.mkdir()

    crafted = {}
    for name, make in (("exec", _exec_payload), ("system", _system_payload)):
        path = _copy(good, d / f"crafted_{name}")
        (path / ".metadata").write_bytes(pickle.dumps(make(markers / f"{name}.txt")))
        crafted[name] = path
    truncated = _copy(good, d / "truncated")
    shard = truncated / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)

    # the saved config names a plugin module that leaves a marker when imported
    probe_dir = d / "probe"
    probe_dir.mkdir()
    (probe_dir / f"{PROBE_MODULE}.py").write_text(
        f"open({str(markers / 'plugin.txt')!r}, 'w').write('imported')\n"
    )
    with_plugin = _copy(good, d / "with_plugin")
    cfg = yaml.safe_load((good / "mm_config.yaml").read_text())
    cfg["training"]["plugin"] = [PROBE_MODULE]
    (with_plugin / "mm_config.yaml").write_text(yaml.safe_dump(cfg))

    nonfinite = _nonfinite_checkpoint(good, d / "nonfinite")

    train = [*COMMON, "training.train_iters=2", "training.save=null", "--nproc-per-node", "2"]
    # fresh processes: the launches (refused before any step) and the commands whose subject is what gets
    # imported; the other conversions go through the same entry (mm_core.cli.main) in this process
    processes = {
        "resume_crafted": (["train", str(QUICKSTART), *train, f"training.load={crafted['exec']}",
                            f"training.output_dir={d / 'o1'}"], None),
        "resume_truncated": (["train", str(QUICKSTART), *train, f"training.load={truncated}",
                              f"training.output_dir={d / 'o2'}"], None),
        "resume_shape": (["train", str(QUICKSTART), *train, f"training.load={good}",
                          "model.config_overrides.intermediate_size=64",
                          f"training.output_dir={d / 'o3'}"], None),
        "convert_plugin_named": (["convert", "dcp-to-hf", str(with_plugin), str(d / "hf_plugin")], probe_dir),
    }  # fmt: skip
    in_process = {
        "convert_exec": ["convert", "dcp-to-hf", str(crafted["exec"]), str(d / "hf_exec")],
        "convert_system": ["convert", "dcp-to-hf", str(crafted["system"]), str(d / "hf_system")],
        "convert_truncated": ["convert", "dcp-to-hf", str(truncated), str(d / "hf_truncated")],
        "convert_nonfinite": ["convert", "dcp-to-hf", str(nonfinite), str(d / "hf_nan")],
        "convert_nonfinite_forced": ["convert", "dcp-to-hf", str(nonfinite), str(d / "hf_nan_forced"),
                                     "--allow-nonfinite"],
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, args, env) for name, (args, env) in processes.items()}
        runs = {name: mm_here(*args) for name, args in in_process.items()}
        runs.update({name: fut.result() for name, fut in futures.items()})
    plugin_imported_unasked = (markers / "plugin.txt").exists()
    # the control: the same probe module named explicitly with --plugin is imported
    runs["convert_plugin_explicit"] = _run(
        ["convert", "dcp-to-hf", str(with_plugin), str(d / "hf_plugin2"), "--plugin", PROBE_MODULE], probe_dir
    )
    return {
        "dir": d,
        "good": good,
        "markers": markers,
        "truncated": truncated,
        "runs": runs,
        "plugin_imported_unasked": plugin_imported_unasked,
    }


def _nonfinite_checkpoint(good: Path, dst: Path) -> Path:
    """A weights-only checkpoint of the run's model with a NaN and an inf, with the run's config."""
    from mm_core.models import ModelHub

    text = (good / "mm_config.yaml").read_text()
    cfg = validate_config(yaml.safe_load(text))
    cwd = os.getcwd()
    os.chdir(REPO)  # the quickstart's paths are relative to the repository root
    try:
        model = ModelHub.build(cfg.model)
    finally:
        os.chdir(cwd)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    state["model.norm.weight"][0] = float("inf")
    dcp.save({"model": state}, checkpoint_id=str(dst), no_dist=True)
    (dst / "mm_config.yaml").write_text(text)
    return dst


# --------------------------------------------------------------------------------- crafted metadata
def test_the_payloads_are_live(tmp_path):
    """Control: unpickled the ordinary way, both payloads run (so the refusals below mean something)."""
    for make in (_exec_payload, _system_payload):
        marker = tmp_path / f"{make.__name__}.txt"
        pickle.loads(pickle.dumps(make(marker)))
        assert marker.is_file()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "what"), [("exec", "builtins.exec"), ("system", "posix.system")])
def test_convert_refuses_crafted_metadata(world, name, what):
    line = _one_line_error(world["runs"][f"convert_{name}"])
    meta = world["dir"] / f"crafted_{name}" / ".metadata"
    assert line.startswith(f"mm: error: mm convert dcp-to-hf: {meta}: refused: it asks to import {what},"), (
        line
    )
    assert not (world["markers"] / f"{name}.txt").exists(), "the payload ran"
    assert not (world["dir"] / f"hf_{name}").exists()


@pytest.mark.slow
def test_resume_refuses_crafted_metadata_on_every_rank(world):
    line = _one_line_error(world["runs"]["resume_crafted"])
    meta = world["dir"] / "crafted_exec" / ".metadata"
    # one line without a rank: every rank refused with the same message
    assert line.startswith(f"mm: error: training.load: {meta}: refused: it asks to import builtins.exec,"), (
        line
    )
    assert not (world["markers"] / "exec.txt").exists(), "the payload ran"


def test_real_metadata_reads_like_torch_does(world):
    """The allowlist admits everything DCP writes for a real sharded mm checkpoint."""
    ours, torchs = read_metadata(world["good"]), FileSystemReader(str(world["good"])).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata
    assert ours.storage_data == torchs.storage_data and ours.planner_data == torchs.planner_data
    assert any(len(md.chunks) == 2 for md in ours.state_dict_metadata.values() if hasattr(md, "chunks"))


def test_values_stored_as_pickled_objects_are_refused(tmp_path):
    marker = tmp_path / "ran.txt"
    state = {"model": {"w": torch.ones(2), "obj": _exec_payload(marker)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    # control: DCP's own planner unpickles the value, and the payload runs
    dcp.load(
        {"model": {"obj": None}},
        checkpoint_id=str(tmp_path / "c"),
        planner=DefaultLoadPlanner(),
        no_dist=True,
    )
    assert marker.is_file()
    marker.unlink()
    with pytest.raises(
        CheckpointError, match=r"model\.obj is stored as a pickled object; mm reads tensors only"
    ):
        load_dcp(
            {"model": {"w": torch.zeros(2), "obj": None}}, tmp_path / "c", allow_partial=False, no_dist=True
        )
    assert not marker.exists()


# ----------------------------------------------------------------------------------- plugins in a checkpoint
@pytest.mark.slow
def test_convert_does_not_import_modules_named_in_the_checkpoint(world):
    proc = world["runs"]["convert_plugin_named"]
    assert proc.returncode == 0, proc.stderr  # qwen3 comes from its installed entry point
    assert (world["dir"] / "hf_plugin" / "model.safetensors").is_file()
    assert not world["plugin_imported_unasked"], "mm convert imported a module named in the checkpoint"
    # control: the module is importable, and --plugin imports it
    explicit = world["runs"]["convert_plugin_explicit"]
    assert explicit.returncode == 0, explicit.stderr
    assert (world["markers"] / "plugin.txt").read_text() == "imported"


def test_unknown_model_names_the_checkpoints_plugins_and_remote_code_needs_a_flag(world, tmp_path):
    path = _copy(world["good"], tmp_path / "c")
    cfg = yaml.safe_load((path / "mm_config.yaml").read_text())
    cfg["model"]["model_id"] = "probe_model"
    cfg["training"]["plugin"] = [PROBE_MODULE]
    (path / "mm_config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as err:
        dcp_to_hf(path, tmp_path / "hf")
    msg = str(err.value)
    assert msg.startswith("mm convert dcp-to-hf: model.model_id: unknown model 'probe_model'")
    assert f"training.plugin ['{PROBE_MODULE}']" in msg and "pass --plugin MODULE" in msg
    assert PROBE_MODULE not in sys.modules

    cfg["model"]["model_id"], cfg["model"]["trust_remote_code"] = "qwen3", True
    (path / "mm_config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointError, match=r"model\.trust_remote_code: true .* pass --trust-remote-code"):
        dcp_to_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------- broken checkpoints
@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "where"), [("resume_truncated", "training.load"), ("convert_truncated", "mm convert dcp-to-hf")]
)
def test_truncated_shard_names_the_file_and_tensor(world, run, where):
    line = _one_line_error(world["runs"][run])
    shard = world["truncated"] / "__1_0.distcp"
    size = shard.stat().st_size
    assert line.startswith(f"mm: error: {where}: {shard}: is truncated: it has {size} bytes, but "), line
    assert " is stored at bytes " in line and "copy the checkpoint again or load an earlier one" in line


@pytest.mark.slow
def test_shape_mismatch_names_the_tensor_and_both_shapes(world):
    line = _one_line_error(world["runs"]["resume_shape"])
    good = world["good"]
    expected = (
        f"mm: error: training.load: {good}: model.model.layers.0.mlp.gate_proj.weight has shape [768, 256] "
        "in the checkpoint but [64, 256] in this model (11 more tensors differ); the checkpoint was saved "
        "from a different model: compare model.* (config_overrides, model_name_or_path) with "
        f"{good / 'mm_config.yaml'}"
    )
    assert line == expected


# ------------------------------------------------------------------------------------- non-finite export
@pytest.mark.slow
def test_nonfinite_weights_are_not_exported_unless_forced(world):
    line = _one_line_error(world["runs"]["convert_nonfinite"])
    assert line == (
        f"mm: error: mm convert dcp-to-hf: {world['dir'] / 'nonfinite'} holds non-finite weights (NaN or "
        "inf): model.layers.1.mlp.down_proj.weight (1 of 196608), model.norm.weight (1 of 256); the run "
        "diverged before this save: export an earlier checkpoint, or pass --allow-nonfinite to export these "
        "weights anyway"
    )
    assert not (world["dir"] / "hf_nan").exists()
    forced = world["runs"]["convert_nonfinite_forced"]
    assert forced.returncode == 0, forced.stderr
    from safetensors.torch import load_file

    weights = load_file(world["dir"] / "hf_nan_forced" / "model.safetensors")
    assert torch.isnan(weights["model.layers.1.mlp.down_proj.weight"][3, 5])
