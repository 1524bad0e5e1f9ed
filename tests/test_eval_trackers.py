"""Validation loss (``data.eval_dataset_param``) and the trackers (``tools.wandb``, ``tools.swanlab``),
end to end.

The quickstart's tiny Qwen3 on two training sources and two validation sources (pieces of the Python
reference), evaluated at every step:

- the same ``eval_loss``, ``eval_loss/<source>`` and ``loss/<source>`` at 1 rank, 2 ranks (FSDP), 2 ranks
  under Ulysses context parallelism, and for a tiny MoE at 1 rank and 2 ranks with expert parallelism 2,
  within 1e-5;
- evaluation changes no training figure (the run without it has bit-identical losses and grad norms), and a
  run resumed from step 2 repeats steps 3-4 bit-exactly, eval losses included (attention dropout on: the
  random state must be the training run's);
- the per-source losses are the losses of the sources: the loss of the mixed set is their token-weighted mean;
- W&B (offline) and SwanLab (offline) write their runs, with the run's config, from rank 0 only.

The 2-rank runs share one launch of 2 processes (see :mod:`_launch`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, read_metrics
from _tiny import QWEN3_MOE

TRAIN = ["train_a.jsonl", "train_b.jsonl"]
#: a tiny Qwen3-MoE (with its router loss) instead of the dense model
MOE = [
    "model.model_id=qwen3_moe",
    "model.model_name_or_path=null",
    "model.config_overrides=" + json.dumps(QWEN3_MOE),
    "model.loss_cfg.router_aux_loss_coef=0.02",
]
EVAL = ["eval_a.jsonl", "eval_b.jsonl"]


def _split_data(folder: Path) -> None:
    """Four files of the quickstart's documents: two training sources, two validation sources."""
    lines = (QUICKSTART.parent / "data" / "python_reference.jsonl").read_text(encoding="utf-8").splitlines()
    parts = {"train_a": lines[0:6], "train_b": lines[6:12], "eval_a": lines[40:44], "eval_b": lines[60:63]}
    for name, part in parts.items():
        (folder / f"{name}.jsonl").write_text("\n".join(part) + "\n", encoding="utf-8")


def _common(data: Path, cache: Path) -> list[str]:
    basic = "data.dataset_param.basic_parameters"
    return [
        f"{basic}.dataset_dir={data}",
        f"{basic}.dataset=[{', '.join(TRAIN)}]",
        f"{basic}.weights=[1, 2]",
        f"{basic}.seq_len=32",
        f"{basic}.cache_dir={cache}",
        "data.eval_dataset_param={dataset_type: text_pretrain, "
        f"basic_parameters: {{dataset_dir: {data}, dataset: [{', '.join(EVAL)}], seq_len: 32, "
        f"cache_dir: {cache}}}, "
        f"preprocess_parameters: {{model_name_or_path: {QUICKSTART.parent / 'tokenizer'}}}}}",
        "data.dataset_param.preprocess_parameters.model_name_or_path=" + str(QUICKSTART.parent / "tokenizer"),
        "model.model_name_or_path=" + str(QUICKSTART.parent / "model"),
        "parallel.fsdp_plan.param_dtype=fp32",
        "training.train_iters=4",
        "training.eval_interval=1",
        "training.eval_iters=2",
        "training.log_interval=2",
        "training.gradient_accumulation_steps=1",
        "training.seed=7",
        "training.progress_bar=false",
        "training.save=null",
        "tools.tensorboard.enable=false",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    data = root / "data"
    data.mkdir()
    _split_data(data)
    cache = root / "cache"
    names = ("one", "fsdp", "cp", "moe_one", "moe_ep", "two", "no_eval", "resumed")
    d = {name: root / name for name in names}
    common = _common(data, cache)
    # the layouts compared run 2 steps without dropout (its masks differ between layouts); the runs compared
    # bit for bit run 4 steps with attention dropout (so the random state must be the training run's)
    one = [*common, "training.micro_batch_size=4", "training.train_iters=2"]
    two = [
        *common,
        "training.micro_batch_size=2",
        "model.config_overrides.attention_dropout=0.1",
        "model.attn_implementation=sdpa",  # (mm_varlen, the text models' auto choice, has no dropout)
    ]
    ckpt = d["two"] / "ckpt"
    items = {
        "one": one,
        "fsdp": [*one, "training.micro_batch_size=2"],
        "two": [
            *two,
            f"training.save={ckpt}",
            "training.save_interval=2",
            "tools.tensorboard.enable=true",
            "tools.wandb={enable: true, project: mm-test, mode: offline, dir: " + str(root / "wandb") + "}",
            "tools.swanlab={enable: true, project: mm-test, mode: offline, logdir: "
            + str(root / "swanlog")
            + "}",
        ],
        "cp": [*one, "parallel.ulysses_parallel_size=2"],
        "moe_one": [*one, *MOE],
        "moe_ep": [*one, *MOE, "training.micro_batch_size=2", "parallel.expert_parallel_size=2"],
        "no_eval": [*two, "data.eval_dataset_param=null"],
        "resumed": [*two, f"training.load={ckpt / 'step_2'}"],
    }
    launch = {1: ["one", "moe_one"], 2: ["fsdp", "cp", "moe_ep", "two", "no_eval", "resumed"]}
    for nproc, which in launch.items():
        batch = [(n, str(QUICKSTART), [*items[n], f"training.output_dir={d[n]}"]) for n in which]
        run_in_one_launch(nproc, batch, REPO, timeout=600)
    return {**d, "root": root}


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def test_eval_records_every_step_and_the_same_on_every_layout(runs):
    one, two, cp = (read_metrics(runs[n]) for n in ("one", "fsdp", "cp"))
    assert [r["step"] for r in one] == [1, 2]  # eval steps are logged whatever log_interval says
    keys = ["eval_loss", "eval_loss/eval_a", "eval_loss/eval_b", "loss", "loss/train_a", "loss/train_b"]
    for r in one:
        assert all(k in r and math.isfinite(r[k]) for k in keys), r
        assert r["eval_loss/eval_a"] != r["eval_loss/eval_b"]
        # the mixed loss lies between the per-source losses (it is their token-weighted mean)
        for prefix, (a, b) in (("eval_loss", ("eval_a", "eval_b")), ("loss", ("train_a", "train_b"))):
            lo, hi = sorted((r[f"{prefix}/{a}"], r[f"{prefix}/{b}"]))
            assert lo - 1e-9 <= r[prefix] <= hi + 1e-9, (prefix, r)
    moe_one, moe_ep = read_metrics(runs["moe_one"]), read_metrics(runs["moe_ep"])
    for ref, other, name in (
        (one, two, "2 ranks"),
        (one, cp, "2 ranks, Ulysses 2"),
        (moe_one, moe_ep, "MoE, EP 2"),
    ):
        assert [r["step"] for r in other] == [1, 2]
        for a, b in zip(ref, other):
            for k in keys:
                assert _close(a[k], b[k]), (name, a["step"], k, a[k], b[k])


def test_eval_changes_no_training_figure(runs):
    assert [r["step"] for r in read_metrics(runs["two"])] == [1, 2, 3, 4]
    with_eval, without = read_metrics(runs["two"]), read_metrics(runs["no_eval"])
    assert [r["step"] for r in without] == [2, 4]
    assert not any("eval_loss" in r for r in without)
    by_step = {r["step"]: r for r in with_eval}
    for r in without:
        for k in ("loss", "grad_norm", "loss/train_a", "loss/train_b"):
            assert r[k] == by_step[r["step"]][k], (r["step"], k)


def test_resume_with_eval_is_bit_identical(runs):
    ref = {r["step"]: r for r in read_metrics(runs["two"])}
    resumed = read_metrics(runs["resumed"])
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        for k in ("loss", "grad_norm", "eval_loss", "eval_loss/eval_a", "loss/train_b"):
            assert r[k] == ref[r["step"]][k], (r["step"], k)


def test_tensorboard_gets_eval_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["two"] / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/loss/train_a", "eval/loss", "eval/loss/eval_b"} <= tags
    assert [e.step for e in acc.Scalars("eval/loss")] == [1, 2, 3, 4]


def test_wandb_offline_run_has_config_and_scalars(runs):
    found = list((runs["root"] / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(found) == 1, found  # rank 0 only
    raw = found[0].read_bytes()
    # the run's config (every block of the resolved YAML) and the logged scalars are in the run's records
    assert str(runs["two"]).encode() in raw  # training.output_dir, from the config
    for needle in (b"eval_dataset_param", b"eval_interval", b"eval/loss", b"train/loss/train_a"):
        assert needle in raw, needle


def test_swanlab_offline_run_has_config(runs):
    found = list((runs["root"] / "swanlog").glob("run-*/files/config.yaml"))
    assert len(found) == 1, found  # rank 0 only
    config = yaml.safe_load(found[0].read_text(encoding="utf-8"))
    text = json.dumps(config)
    assert str(runs["two"]) in text and "eval_dataset_param" in text
    assert list((runs["root"] / "swanlog").glob("run-*/backup.swanlab"))


# ---------------------------------------------------------------------------- tools keys (no launch)
def _load(*overrides: str):
    from mm_core.config import load_config

    return load_config(str(QUICKSTART), list(overrides))


def test_mindspeed_profile_static_param_profiles_its_window(tmp_path):
    """``static_param`` as MindSpeed-MM writes it: the window ``[start_step, end_step)``, folded into mm's
    inclusive one; the CPU run records it."""
    import torch

    from mm_core.tools import StepProfiler

    cfg = _load(
        "tools.profile={enable: true, profile_type: static, ranks: [0], static_param: {start_step: 2, "
        f"end_step: 4, with_cpu: true, record_shapes: true, save_path: {tmp_path}}}}}"
    ).tools.profile
    assert (cfg.start_step, cfg.end_step, cfg.record_shapes, cfg.save_path) == (2, 3, True, str(tmp_path))
    prof = StepProfiler(cfg, 0, "cpu", tmp_path / "unused")
    for step in range(1, 5):
        prof.step_begin(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        prof.step_end(step)
    prof.close()
    assert prof.trace_path == tmp_path / "trace_rank0_steps2-3.json" and prof.trace_path.is_file()
    first_two = _load("tools.profile.static_param={start_step: 0, end_step: 2}").tools.profile
    assert (first_two.start_step, first_two.end_step) == (1, 2)  # start_step 0: from the first step


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tools.profile.profile_type=dynamic", "dynamic profiling"),
        ("tools.profile.static_param={start_step: 3, end_step: 3}", "profiles no step"),
        ("tools.profile={start_step: 2, static_param: {start_step: 3, end_step: 5}}", "disagrees"),
        ("tools.profile.static_param.analyse_flag=false", "analysed result"),
        ("tools.memory_profile={ranks: [0], dump_ranks: [1]}", "disagree"),
        ("tools.tensorboard={log_dir: a, dir: b}", "disagree"),
        ("tools.wandb.mode=cloud", "tools.wandb.mode"),
    ],
)
def test_tools_keys_refused_with_the_reason(override, message):
    from mm_core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(override)


def test_memory_profile_dump_ranks_and_tensorboard_dir(tmp_path):
    from mm_core.tools import MemoryProfiler
    from mm_core.train.metrics import MetricsLogger

    tools = _load(
        "tools.memory_profile={enable: true, dump_ranks: [1], stacks: python, max_entries: 10, "
        "mem_info: true}",
        f"tools.tensorboard={{enable: true, dir: {tmp_path / 'events'}, interval: 5}}",
    ).tools
    assert tools.memory_profile.ranks == [1]
    assert not MemoryProfiler(tools.memory_profile, 0, "cpu", tmp_path).enabled
    assert MemoryProfiler(tools.memory_profile, 1, "cpu", tmp_path).enabled
    logger = MetricsLogger(tmp_path / "out", enabled=True, total_steps=1, tools=tools, progress_bar=False)
    logger.log({"step": 1, "loss": 2.0, "eval_loss": 3.0})
    logger.close()
    assert list((tmp_path / "events").glob("events.out.tfevents.*"))
    assert read_metrics(tmp_path / "out") == [{"step": 1, "loss": 2.0, "eval_loss": 3.0}]


@pytest.mark.parametrize("tracker", ["wandb", "swanlab"])
def test_enabled_tracker_without_its_library_says_what_to_install(tracker, tmp_path, monkeypatch):
    import sys

    from mm_core.errors import ConfigError
    from mm_core.train.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, tracker, None)  # what `import` sees when the library is not installed
    tools = _load(f"tools.{tracker}.enable=true").tools
    with pytest.raises(ConfigError, match=rf"pip install 'mm-core\[{tracker}\]'"):
        MetricsLogger(tmp_path, enabled=True, total_steps=1, tools=tools, progress_bar=False)
    assert (tmp_path / "metrics.jsonl").exists()  # the sinks opened before were closed (no leaked file)


def test_mm_check_verifies_the_eval_data(tmp_path):
    """``mm check`` runs the same data checks on ``data.eval_dataset_param`` as on the training data."""
    from mm_core.errors import MMError
    from mm_core.preflight import check_data

    data = tmp_path / "data"
    data.mkdir()
    _split_data(data)
    base = _common(data, tmp_path / "cache")
    lines = check_data(_load(*base))
    assert any(line.startswith("eval data") for line in lines), lines
    broken = [*base, "data.eval_dataset_param.basic_parameters.dataset=[missing.jsonl]"]
    with pytest.raises(MMError, match=r"data\.eval_dataset_param \(the validation data\).*missing\.jsonl"):
        check_data(_load(*broken))
