"""The ``mm`` command as users run it: user errors exit 2 with one line, no traceback.

Every ``mm`` start imports torch and transformers (seconds each), so the commands of this module are run
once, in the ``runs`` fixture; each test then checks one of the finished runs. The ``mm check`` cases call
the CLI's entry point in this process as the ``mm`` script does (``_mm.mm_here``: exit status, traceback,
stdout and stderr with warnings and log records, a user's environment and working directory). The other
cases (``mm train``, the training processes of one included, ``mm plugins`` and the command-line errors) run
as real subprocesses, a few at a time, while the in-process ones run.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _mm import mm_here


@dataclass(frozen=True)
class Case:
    """``mm <command> [CFG] <args>``; with ``edit`` a config is written first (changed by ``edit``)."""

    command: str
    args: tuple[str, ...] = ()
    edit: Callable[[dict[str, Any]], Any] | None = None
    config: bool = True
    needles: tuple[str, ...] = field(default=())


def _drop_fsdp_plan(raw: dict[str, Any]) -> None:
    raw["parallel"].pop("fsdp_plan")


BAD = {
    # mm check
    "check_unknown_nested_key": Case(
        "check",
        edit=lambda r: r["parallel"]["fsdp_plan"].update(aply_modules=["model.layers.{*}"]),
        needles=("parallel.fsdp_plan.aply_modules", "did you mean parallel.fsdp_plan.apply_modules?"),
    ),
    "check_literal_override": Case(
        "check",
        ("training.lr_decay_style=cosin",),
        needles=("training.lr_decay_style: got 'cosin'", "'cosine'"),
    ),
    "check_bad_override_syntax": Case("check", ("training.lr",), needles=("'training.lr'", "KEY=VALUE")),
    "check_world_not_divisible": Case(
        "check",
        ("--world-size", "4", "parallel.fully_shard_parallel_size=3"),
        needles=("parallel.fully_shard_parallel_size: got 3", "world size 4"),
    ),
    "check_pattern_matches_nothing": Case(
        "check",
        ("parallel.fsdp_plan.apply_modules=[model.layer.{*}]",),
        needles=(
            "parallel.fsdp_plan.apply_modules",
            "'model.layer.{*}'",
            "matches no module",
            "did you mean",
            "model.layers.{*}",
        ),
    ),
    "check_missing_file": Case(
        "check", ("absent.yaml",), config=False, needles=("absent.yaml does not exist",)
    ),
    # mm train: refused before anything starts, options before or after the overrides
    "train_nproc_after": Case(
        "train",
        ("training.lr_decay_style=cosin", "--nproc-per-node", "2"),
        needles=("training.lr_decay_style: got 'cosin'",),
    ),
    "train_nproc_before": Case(
        "train",
        ("--nproc-per-node", "2", "parallel.fsdp_plan.apply_modules=[model.layer.{*}]"),
        needles=("parallel.fsdp_plan.apply_modules", "matches no module", "did you mean", "model.layers.{*}"),
    ),
    "train_no_launcher": Case(
        "train",
        ("training.lr_decay_style=cosin",),
        needles=("training.lr_decay_style: got 'cosin'",),
    ),
}

GOOD = {
    "check_fsdp": Case("check", ("--world-size", "2")),
    "check_default_plan": Case("check", edit=_drop_fsdp_plan),
    "check_hsdp": Case(
        "check", ("parallel.fully_shard_parallel_size=2", "--world-size", "4", "training.micro_batch_size=3")
    ),
    "plugins": Case("plugins", config=False),
    "unknown_command": Case("frobnicate", config=False),
    "no_command": Case("", config=False),
}


#: commands run in this process (they neither launch processes nor train)
IN_PROCESS = ("check",)


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    config_file_writer: Callable[..., Path],
    mm_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Run every case of BAD and GOOD (the subprocesses a few at a time, the ``mm check`` cases in this
    process meanwhile); name -> (finished process, its folder)."""
    jobs = []
    for name, case in {**BAD, **GOOD}.items():
        folder = tmp_path_factory.mktemp(name)
        args: list[Any] = [case.command] if case.command else []
        if case.config:
            args.append(config_file_writer(folder, case.edit))
        jobs.append((name, case.command in IN_PROCESS, folder, [*args, *case.args]))
    assert any(not local for _, local, _, _ in jobs) and any(local for _, local, _, _ in jobs)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            name: (pool.submit(mm_cli, folder, *args), folder)
            for name, local, folder, args in jobs
            if not local
        }
        done = {name: (mm_here(*args, cwd=folder), folder) for name, local, folder, args in jobs if local}
        done.update({name: (fut.result(), folder) for name, (fut, folder) in futures.items()})
    return {name: done[name] for name, _, _, _ in jobs}


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit status 2, exactly one stderr line starting ``mm: error:``, no traceback; returns that line."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("mm: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


# ------------------------------------------------------------------------------------- bad configs
@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_one_line_exit_2(case: str, runs: dict) -> None:
    proc, folder = runs[case]
    assert_user_error(proc, *BAD[case].needles)
    assert not (folder / "out").exists(), "nothing may be written when the config is refused"


def test_near_misses_come_after_did_you_mean(runs: dict) -> None:
    line = runs["check_pattern_matches_nothing"][0].stderr
    assert "model.layers.{*}" in line.split("did you mean", 1)[1]


@pytest.mark.slow
def test_train_data_error_in_workers_is_one_line(
    config_file_writer: Callable[..., Path],
    run_mm: Callable[..., subprocess.CompletedProcess[str]],
    tmp_path: Path,
) -> None:
    path = config_file_writer(
        tmp_path, lambda r: r["data"]["dataset_param"]["basic_parameters"].update(dataset="absent.jsonl")
    )
    proc = run_mm("train", path, "--nproc-per-node", "2")
    assert_user_error(proc, "data.dataset_param.basic_parameters.dataset", "'absent.jsonl'")


# ------------------------------------------------------------------------------------- good configs
def _ok(runs: dict, name: str) -> str:
    proc = runs[name][0]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc.stdout


def test_check_good_config_prints_the_plan(runs: dict, tiny_qwen_dir: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config.from_pretrained(tiny_qwen_dir))
    n_params = sum(p.numel() for p in model.parameters())

    out = _ok(runs, "check_fsdp")
    assert re.search(r"^layout\s*: FSDP x2 \(world 2: dp_replicate=1, dp_shard=2, cp=1\)", out, re.M), out
    assert re.search(r"^model\s*: qwen3 -> Qwen3ForTraining$", out, re.M), out
    assert re.search(rf"^parameters\s*: {n_params:,} total, {n_params:,} trainable, 0 frozen$", out, re.M), (
        out
    )
    assert re.search(r"^fsdp units\s*: from parallel\.fsdp_plan\.apply_modules$", out, re.M), out
    assert re.search(r"^\s+model\.layers\.\{\*\}\s+-> model\.layers\.0, model\.layers\.1$", out, re.M), out
    assert re.search(
        r"^memory/rank : [0-9.]+ GiB estimated peak = model states \(params [0-9.]+, grads", out, re.M
    ), out
    assert re.search(r"^batch\s*: micro 2 x accumulation 1 x dp 2 = 4 samples per step$", out, re.M), out
    assert not (runs["check_fsdp"][1] / "out").exists(), "mm check must not train or write outputs"


def test_check_uses_the_model_default_plan(runs: dict) -> None:
    # no fsdp_plan in the YAML: qwen3's default plan is used (the model is built on the meta device; with
    # model.from_scratch false mm check also verifies the weights files: see test_preflight.py)
    out = _ok(runs, "check_default_plan")
    assert re.search(r"^fsdp units\s*: from default plan of Qwen3ForTraining$", out, re.M), out
    assert re.search(r"model\.layers\.\{\*\}\s+-> model\.layers\.0, model\.layers\.1$", out, re.M), out
    assert re.search(r"^layout\s*: single process", out, re.M), out


def test_check_options_and_overrides_in_any_order(runs: dict) -> None:
    out = _ok(runs, "check_hsdp")
    assert re.search(r"^layout\s*: HSDP 2 replicas x 2 shards ", out, re.M), out
    assert "micro 3 x accumulation 1 x dp 4 = 12 samples per step" in out


# ------------------------------------------------------------------------------------- other commands
def test_plugins_lists_names_and_distributions(runs: dict) -> None:
    out = _ok(runs, "plugins")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][:2] == ["kind", "name"]
    found = {(r[0], r[1]): r[2] for r in rows[1:]}
    expected = {
        ("model", "qwen3"): "mm-models-qwen",
        ("dataset", "text_pretrain"): "mm-data-text",
        ("dataset", "sft"): "mm-data-text",
        ("collator", "llm_pretrain"): "mm-data-text",
        ("collator", "sft"): "mm-data-text",
        ("optimizer", "adamw"): "mm-core",
    }
    for key, dist in expected.items():
        assert found.get(key) == dist, f"{key} should be provided by {dist}:\n{out}"


def test_unknown_command_exits_2(runs: dict) -> None:
    proc = runs["unknown_command"][0]
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "mm: error: unknown command 'frobnicate'" in proc.stderr.splitlines()


def test_no_command_prints_usage_and_exits_2(runs: dict) -> None:
    proc = runs["no_command"][0]
    assert proc.returncode == 2
    assert "usage: mm" in proc.stdout
    for command in ("train", "check", "plugins", "convert"):
        assert command in proc.stdout
