"""``mm check`` verifies every path the run reads before anything starts: dataset files, the tokenizer, the
weights (unless ``model.from_scratch``) and ``training.load`` — one line each, without loading weights.

Most checks run in-process (:mod:`mm_core.preflight`); a few real ``mm`` commands, run concurrently once,
show that the CLI reports them as one line with exit status 2 (``mm check``, ``mm train --nproc-per-node``).
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_core.config import validate_config
from mm_core.config.schema import MMConfig
from mm_core.errors import CheckpointError, ConfigError, DataError
from mm_core.preflight import check_data, check_load, check_weights, run_preflight
from mm_core.registry import data_register


def cfg_of(raw: dict[str, Any], edit: Callable[[dict[str, Any]], Any] | None = None) -> MMConfig:
    raw = copy.deepcopy(raw)
    if edit is not None:
        edit(raw)
    return validate_config(raw)


def one_line(info: pytest.ExceptionInfo) -> str:
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory, tiny_qwen_dir: Path) -> Path:
    """The tiny Qwen3 with real safetensors weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny_weights")
    Qwen3ForCausalLM(Qwen3Config.from_pretrained(tiny_qwen_dir)).save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


# ---------------------------------------------------------------------------------------------- weights
def test_from_scratch_needs_no_weights(good_raw: dict[str, Any]) -> None:
    assert check_weights(cfg_of(good_raw).model) == [
        "weights     : none: model.from_scratch is true (random initialisation)"
    ]


def test_weights_headers_are_read(good_raw: dict[str, Any], weights_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(weights_dir / "model.safetensors"), "pt") as f:
        n = len(list(f.keys()))
    model = cfg_of(good_raw).model.model_copy(
        update={"from_scratch": False, "model_name_or_path": str(weights_dir)}
    )
    (line,) = check_weights(model)
    assert line.startswith(f"weights     : {weights_dir}: 1 safetensors file(s), {n:,} tensors, "), line


@pytest.mark.parametrize("path", ["config_only", "Qwen/Qwen3-0.6B", None])
def test_missing_weights_are_named(good_raw: dict[str, Any], tiny_qwen_dir: Path, path: str | None) -> None:
    where = str(tiny_qwen_dir) if path == "config_only" else path
    model = cfg_of(good_raw).model.model_copy(update={"from_scratch": False, "model_name_or_path": where})
    with pytest.raises(ConfigError) as info:
        check_weights(model)
    msg = one_line(info)
    assert msg.startswith("model.model_name_or_path: "), msg
    expected = {
        "config_only": "has no model.safetensors or model.safetensors.index.json",
        "Qwen/Qwen3-0.6B": "'Qwen/Qwen3-0.6B' is not a local folder",
        None: "not set, but model.from_scratch is false",
    }[path]
    assert expected in msg, msg
    assert "from_scratch" in msg, msg


def test_weights_under_another_name_are_mentioned(
    good_raw: dict[str, Any], weights_dir: Path, tmp_path
) -> None:
    (tmp_path / "config.json").write_bytes((weights_dir / "config.json").read_bytes())
    (tmp_path / "weights.safetensors").write_bytes((weights_dir / "model.safetensors").read_bytes())
    model = cfg_of(good_raw).model.model_copy(
        update={"from_scratch": False, "model_name_or_path": str(tmp_path)}
    )
    with pytest.raises(
        ConfigError, match=r"it holds weights\.safetensors, but transformers loads only those names unless"
    ):
        check_weights(model)
    # with meta-device init the folder is read through DCP's Hugging Face reader, which takes any name
    (line,) = check_weights(model, meta_init=True)
    assert line.startswith(f"weights     : {tmp_path}: 1 safetensors file(s), "), line


def test_a_missing_shard_is_named(good_raw: dict[str, Any], weights_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(
        (weights_dir / "model.safetensors").read_bytes()
    )
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = cfg_of(good_raw).model.model_copy(
        update={"from_scratch": False, "model_name_or_path": str(tmp_path)}
    )
    with pytest.raises(CheckpointError) as info:
        check_weights(model)
    assert "names the shard 'model-00002-of-00002.safetensors', which does not exist" in one_line(info)


def test_a_truncated_weights_file_is_named(
    good_raw: dict[str, Any], weights_dir: Path, tmp_path: Path
) -> None:
    data = (weights_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    model = cfg_of(good_raw).model.model_copy(
        update={"from_scratch": False, "model_name_or_path": str(tmp_path)}
    )
    with pytest.raises(CheckpointError) as info:
        check_weights(model)
    msg = one_line(info)
    assert msg.startswith(f"model.model_name_or_path: {tmp_path / 'model.safetensors'} is not a readable"), (
        msg
    )


# ---------------------------------------------------------------------------------------- training.load
def _checkpoint(root: Path, step: int, metadata: bytes = b"") -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(metadata)
    (root / "latest").write_text(f"step_{step}\n")
    return path


def test_load_unset_or_auto_without_checkpoint_is_fine(good_raw: dict[str, Any], tmp_path: Path) -> None:
    assert check_load(cfg_of(good_raw).training) == []
    training = cfg_of(
        good_raw, lambda r: r["training"].update(load="auto", save=str(tmp_path / "ck"))
    ).training
    assert check_load(training) == [
        f"load        : auto: no checkpoint in {tmp_path / 'ck'} yet, so the run starts fresh"
    ]
    ckpt = _checkpoint(tmp_path / "ck", 4)
    assert check_load(training) == [f"load        : auto: resumes from {ckpt}"]


def test_load_auto_needs_save(good_raw: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match="training.load: auto needs training.save"):
        check_load(cfg_of(good_raw, lambda r: r["training"].update(load="auto")).training)


def test_missing_load_path_is_named(good_raw: dict[str, Any], tmp_path: Path) -> None:
    absent = str(tmp_path / "nope" / "step_9")
    with pytest.raises(CheckpointError) as info:
        check_load(cfg_of(good_raw, lambda r: r["training"].update(load=absent)).training)
    assert one_line(info).startswith(f"training.load: {absent!r} does not exist"), str(info.value)


def test_load_path_that_is_not_a_checkpoint_is_named(good_raw: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"training\.load: .* is neither a checkpoint folder"):
        check_load(cfg_of(good_raw, lambda r: r["training"].update(load=str(tmp_path))).training)


class _Marker:
    """Unpickling this creates a file: proof that the checkpoint's metadata was (wrongly) unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_load_checks_the_checkpoint_without_unpickling_it(good_raw: dict[str, Any], tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    ckpt = _checkpoint(tmp_path / "ck", 2, pickle.dumps(_Marker(marker)))
    for load in (str(ckpt), str(tmp_path / "ck")):
        assert check_load(cfg_of(good_raw, lambda r, v=load: r["training"].update(load=v)).training) == [
            f"load        : {ckpt}"
        ]
    assert not marker.exists(), "mm check must not unpickle a checkpoint it has not verified"


# ------------------------------------------------------------------------------------------------- data
def test_data_uses_the_dataset_preflight_hook(good_raw: dict[str, Any]) -> None:
    line, cache = check_data(cfg_of(good_raw))
    assert line.startswith("data        : text_pretrain: 1 file(s), "), line
    assert "python_reference.jsonl" in line and "first document: " in line, line
    assert cache.strip().startswith("tokens "), cache  # prepared, current, stale or not yet (docs/data.md)


def test_data_missing_file_and_tokenizer_are_named(good_raw: dict[str, Any]) -> None:
    basic = "data.dataset_param.basic_parameters.dataset"
    with pytest.raises(ConfigError) as info:
        check_data(
            cfg_of(
                good_raw, lambda r: r["data"]["dataset_param"]["basic_parameters"].update(dataset="x.jsonl")
            )
        )
    assert one_line(info).startswith(f"{basic}: 'x.jsonl' does not exist"), str(info.value)

    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check_data(
            cfg_of(
                good_raw,
                lambda r: r["data"]["dataset_param"]["preprocess_parameters"].update(
                    model_name_or_path="Qwen/Qwen3-0.6B"
                ),
            )
        )
    assert time.monotonic() - start < 5, "a hub id must fail at once, not after network retries"
    msg = one_line(info)
    assert msg.startswith(
        "data.dataset_param.preprocess_parameters.model_name_or_path: 'Qwen/Qwen3-0.6B' is not a local folder"
    ), msg


def test_a_dataset_without_hook_is_built_in_full(good_raw: dict[str, Any]) -> None:
    built: list[int] = []

    class Tiny(torch.utils.data.Dataset):
        def __init__(self, basic_param, preprocess_param, dataset_param=None, seed: int = 0) -> None:
            built.append(seed)
            if not Path(basic_param["dataset"]).is_file():
                raise DataError(f"{basic_param['dataset']}: no such file")

        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.tensor(i)}

    data_register.register("tiny_no_preflight")(Tiny)
    try:
        cfg = cfg_of(
            good_raw,
            lambda r: r["data"]["dataset_param"].update(
                dataset_type="tiny_no_preflight",
                basic_parameters={"dataset": __file__},
                preprocess_parameters={},
            ),
        )
        assert check_data(cfg) == [
            "data        : tiny_no_preflight: 3 samples (built in full: the dataset has no preflight hook)"
        ]
        assert built == [cfg.training.seed]
        cfg.data.dataset_param.basic_parameters["dataset"] = "absent"
        with pytest.raises(DataError, match="absent: no such file"):
            check_data(cfg)
    finally:
        data_register.unregister("tiny_no_preflight")


def test_run_preflight_prints_data_then_weights(good_raw: dict[str, Any]) -> None:
    lines: list[str] = []
    run_preflight(cfg_of(good_raw), lines.append)
    labels = [line.split(":")[0].strip() for line in lines if not line.startswith(" ")]  # not continuations
    assert labels == ["data", "weights"]


# ------------------------------------------------------------------------------------- the real command
BAD = {
    "check_missing_dataset": (
        ("check",),
        lambda r: r["data"]["dataset_param"]["basic_parameters"].update(dataset="absent.jsonl"),
        ("data.dataset_param.basic_parameters.dataset: 'absent.jsonl' does not exist",),
    ),
    "check_hub_tokenizer": (
        ("check",),
        lambda r: r["data"]["dataset_param"]["preprocess_parameters"].update(
            model_name_or_path="Qwen/Qwen3-0.6B"
        ),
        ("data.dataset_param.preprocess_parameters.model_name_or_path: 'Qwen/Qwen3-0.6B' is not a local",),
    ),
    "check_no_weights": (
        ("check", "model.from_scratch=false"),
        None,
        ("model.model_name_or_path: ", "has no model.safetensors", "model.from_scratch: true"),
    ),
    "check_missing_load": (
        ("check", "training.load=absent/step_3"),
        None,
        ("training.load: 'absent/step_3' does not exist",),
    ),
    "train_missing_dataset": (
        ("train", "--nproc-per-node", "2"),
        lambda r: r["data"]["dataset_param"]["basic_parameters"].update(dataset="absent.jsonl"),
        ("data.dataset_param.basic_parameters.dataset: 'absent.jsonl' does not exist",),
    ),
}


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    config_file_writer: Callable[..., Path],
    mm_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    jobs = {}
    for name, (args, edit, _) in BAD.items():
        folder = tmp_path_factory.mktemp(name)
        jobs[name] = (folder, [args[0], config_file_writer(folder, edit), *args[1:]])
    good = tmp_path_factory.mktemp("check_ok")
    jobs["check_ok"] = (
        good,
        ["check", config_file_writer(good), "training.load=auto", f"training.save={good / 'ck'}"],
    )
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            name: (pool.submit(mm_cli, folder, *args), folder) for name, (folder, args) in jobs.items()
        }
        return {name: (fut.result(), folder) for name, (fut, folder) in futures.items()}


@pytest.mark.parametrize("case", list(BAD))
def test_missing_paths_are_one_line_before_anything_starts(case: str, runs: dict) -> None:
    proc, folder = runs[case]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mm: error: "), proc.stderr
    for needle in BAD[case][2]:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert not (folder / "out").exists()


def test_check_prints_what_it_verified(runs: dict) -> None:
    proc, folder = runs["check_ok"]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "data        : text_pretrain: 1 file(s)" in out, out
    assert "weights     : none: model.from_scratch is true" in out, out
    assert f"load        : auto: no checkpoint in {folder / 'ck'} yet, so the run starts fresh" in out, out
    assert not (folder / "ck").exists() and not (folder / "out").exists(), "mm check writes nothing"
