"""A run never mixes into another run's outputs: a rerun into the same ``training.output_dir`` or
``training.save`` is refused unless it resumes them (``training.load: auto`` or a checkpoint under
``training.save``) or ``training.overwrite_output_dir: true`` replaces them; ``metrics.jsonl`` never lists a
step twice; outputs inside a dataset folder are refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO, mm, read_metrics

from mm_core.config import load_config
from mm_core.errors import ConfigError
from mm_core.train.outputs import check_run_outputs, dataset_dirs, open_metrics

# ------------------------------------------------------------------------------------------ the rules


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(QUICKSTART, [f"training.save={tmp_path / 'ckpt'}", *overrides])


def _fake_checkpoint(save: Path, step: int) -> Path:
    path = save / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (save / "latest").write_text(f"step_{step}\n")
    return path


def _write_metrics(out: Path, steps: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in steps]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_another_runs_metrics_are_refused(tmp_path):
    out = tmp_path / "out"
    _write_metrics(out, [1, 2])
    with pytest.raises(ConfigError) as err:
        check_run_outputs(_cfg(tmp_path), out, None)
    msg = str(err.value)
    assert msg.startswith(f"training.output_dir: '{out}' already holds metrics.jsonl of another run")
    assert "training.load: auto" in msg and "training.overwrite_output_dir: true" in msg
    # an output folder without metrics (a run that stopped before its first step) is no other run's
    (out / "metrics.jsonl").write_text("")
    check_run_outputs(_cfg(tmp_path), out, None)


def test_another_runs_checkpoints_are_refused_unless_resumed(tmp_path):
    save = tmp_path / "ckpt"
    step1 = _fake_checkpoint(save, 1)
    _fake_checkpoint(save, 2)
    out = tmp_path / "out"
    with pytest.raises(
        ConfigError, match=r"^training\.save: '.*ckpt' already holds checkpoints of another run "
    ):
        check_run_outputs(_cfg(tmp_path), out, None)
    # loading a checkpoint of some other folder is a new run: still refused
    other = _fake_checkpoint(tmp_path / "elsewhere", 5)
    with pytest.raises(ConfigError, match=r"step_1, step_2\)"):
        check_run_outputs(_cfg(tmp_path, f"training.load={other}"), out, other)
    # resuming them is fine: load auto, or a checkpoint under training.save
    _write_metrics(out, [1, 2])
    check_run_outputs(_cfg(tmp_path, "training.load=auto"), out, save / "step_2")
    check_run_outputs(_cfg(tmp_path, f"training.load={step1}"), out, step1)
    assert step1.is_dir() and (save / "step_2").is_dir()


def test_overwrite_switch_removes_the_earlier_checkpoints(tmp_path):
    save = tmp_path / "ckpt"
    for step in (1, 2):
        _fake_checkpoint(save, step)
    (save / ".step_3.partial").mkdir()
    (save / "unrelated.txt").write_text("kept")
    out = tmp_path / "out"
    _write_metrics(out, [1, 2])
    check_run_outputs(_cfg(tmp_path, "training.overwrite_output_dir=true"), out, None)
    assert sorted(p.name for p in save.iterdir()) == ["unrelated.txt"]
    # with load auto the switch does not apply: a restart resumes instead of wiping
    _fake_checkpoint(save, 4)
    check_run_outputs(_cfg(tmp_path, "training.overwrite_output_dir=true", "training.load=auto"), out, None)
    assert (save / "step_4").is_dir()


def test_outputs_inside_a_dataset_folder_are_refused(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_text("{}\n")
    base = [
        f"data.dataset_param.basic_parameters.dataset_dir={data}",
        "data.dataset_param.basic_parameters.dataset=a.jsonl",
    ]
    with pytest.raises(ConfigError) as err:
        check_run_outputs(_cfg(tmp_path, *base), data / "runs" / "x", None)
    assert str(err.value) == (
        f"training.output_dir: '{data / 'runs' / 'x'}' is inside the dataset folder '{data}' "
        "(data.dataset_param.basic_parameters.dataset_dir); files written there could be read back as "
        "training data: choose a folder outside it"
    )
    with pytest.raises(ConfigError, match=r"^training\.save: .* is inside the dataset folder"):
        check_run_outputs(_cfg(tmp_path, *base, f"training.save={data / 'ckpt'}"), tmp_path / "out", None)
    # refused even when resuming or overwriting
    with pytest.raises(ConfigError, match="inside the dataset folder"):
        check_run_outputs(
            _cfg(tmp_path, *base, "training.load=auto", "training.overwrite_output_dir=true"), data, None
        )
    check_run_outputs(_cfg(tmp_path, *base), tmp_path / "out", None)


def test_dataset_folders_of_directories_and_patterns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus" / "part").mkdir(parents=True)
    spec = "[corpus/part, 'logs/*.jsonl', 'deep/**/*.jsonl', 'a/*/b.jsonl', 'file.jsonl']"
    cfg = load_config(
        QUICKSTART,
        [
            f"data.dataset_param.basic_parameters.dataset={spec}",
            "data.dataset_param.basic_parameters.dataset_dir=null",
        ],
    )
    got = [(k.rsplit(".", 1)[1], str(p), r) for k, p, r in dataset_dirs(cfg)]
    assert got == [
        ("dataset[0]", "corpus/part", True),
        ("dataset[1]", "logs", False),  # only the files directly in logs/ match
        ("dataset[2]", "deep", True),
        ("dataset[3]", "a", True),
    ]
    # a plain pattern reads one folder: outputs below it are fine, the folder itself is not
    check_run_outputs(cfg, Path("logs/run1"), None)
    with pytest.raises(ConfigError, match=r"dataset\[1\]"):
        check_run_outputs(cfg, Path("logs"), None)
    with pytest.raises(ConfigError, match=r"dataset\[0\]"):
        check_run_outputs(cfg, Path("corpus/part/out"), None)


def test_open_metrics_keeps_steps_up_to_the_start_and_drops_the_rest(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_metrics(tmp_path, [1, 2, 3, 4])
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')  # a line cut by a crash
    with open_metrics(path, 2) as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    with open_metrics(path, 0) as f:  # a fresh start
        pass
    assert path.read_text() == ""


# ------------------------------------------------------------------------------------ end to end
COMMON = [
    "training.seed=5",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.micro_batch_size=1",
    "training.gradient_accumulation_steps=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.lr_warmup_ratio=0",
    "training.save_interval=1",
]


def _overrides(d: Path, *overrides: str) -> list[str]:
    return [*COMMON, f"training.save={d / 'ckpt'}", f"training.output_dir={d / 'out'}", *overrides]


def _train_cli(d: Path, *overrides: str, check: bool = True):
    return mm("train", str(QUICKSTART), *_overrides(d, *overrides), "--nproc-per-node", "2", check=check)


def _train_runs(d: Path, runs: list) -> None:
    """``runs`` (``(name, overrides)`` runs into ``d``, and :class:`Call` items) in one launch of 2
    processes, each run as ``mm train ... --nproc-per-node 2`` runs it in its workers."""
    items = [r if isinstance(r, Call) else (r[0], str(QUICKSTART), _overrides(d, *r[1])) for r in runs]
    run_in_one_launch(2, items, REPO, timeout=600)


def keep_metrics(d: str, name: str) -> None:
    """Rank 0: a copy of ``d/out/metrics.jsonl`` in the folder ``d/kept_<name>`` (a run's log before the next
    run of the launch rewrites it)."""
    if os.environ["RANK"] == "0":
        (Path(d) / f"kept_{name}").mkdir()
        shutil.copyfile(Path(d) / "out" / "metrics.jsonl", Path(d) / f"kept_{name}" / "metrics.jsonl")


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mm: error: "), proc.stderr
    return lines[0]


@pytest.mark.slow
def test_rerun_is_refused_resumed_or_overwritten(tmp_path):
    """The runs that train go through :mod:`_launch` (the first one alone, the other three in one launch, a
    call keeping each one's metrics before the next rewrites them); the refused rerun between them is the
    ``mm train`` command, whose one-line error is the subject."""
    _train_runs(tmp_path, [("first", ["training.train_iters=2"])])
    first = {r["step"]: r for r in read_metrics(tmp_path / "out")}
    assert sorted(first) == [1, 2]

    line = _one_line_error(_train_cli(tmp_path, "training.train_iters=3", check=False))
    assert f"training.output_dir: '{tmp_path / 'out'}' already holds metrics.jsonl of another run" in line
    assert "training.load: auto" in line and "training.overwrite_output_dir: true" in line
    assert sorted(r["step"] for r in read_metrics(tmp_path / "out")) == [1, 2]  # untouched

    keep = f"{__name__}:keep_metrics"
    _train_runs(
        tmp_path,
        [
            ("auto", ["training.train_iters=3", "training.load=auto"]),  # resumes step_2
            Call("keep auto", keep, (str(tmp_path), "auto")),
            # resuming an earlier checkpoint of the run redoes steps 2-3
            ("step_1", ["training.train_iters=3", f"training.load={tmp_path / 'ckpt' / 'step_1'}"]),
            Call("keep step_1", keep, (str(tmp_path), "step_1")),
            ("overwrite", ["training.train_iters=1", "training.overwrite_output_dir=true"]),
        ],
    )
    assert [r["step"] for r in read_metrics(tmp_path / "kept_auto")] == [1, 2, 3]

    # resuming an earlier checkpoint of the run redoes steps 2-3: they are replaced, never listed twice
    again = read_metrics(tmp_path / "kept_step_1")
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[1]["loss"] == first[2]["loss"]

    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_1"]


@pytest.mark.slow
def test_output_inside_the_dataset_folder_is_refused(tmp_path):
    run = REPO / "examples" / "quickstart" / "data" / f"run_{tmp_path.name}"
    try:
        proc = mm(
            "train",
            str(QUICKSTART),
            *COMMON,
            "training.train_iters=1",
            "training.save=null",
            f"training.output_dir={run}",
            "--nproc-per-node",
            "2",
            check=False,
        )
        line = _one_line_error(proc)
        assert line == (
            f"mm: error: training.output_dir: '{run}' is inside the dataset folder "
            "'examples/quickstart/data' (data.dataset_param.basic_parameters.dataset_dir); files written "
            "there could be read back as training data: choose a folder outside it"
        )
        assert not run.exists()
    finally:
        shutil.rmtree(run, ignore_errors=True)  # the repository stays clean even when the check is broken
