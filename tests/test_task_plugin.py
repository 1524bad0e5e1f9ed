"""A third-party task plugin (``mm.tasks``), pip-installed, trains two models with two optimizers on 2
gloo processes (``mm train``'s worker, the runs of a process count in one launch), the same as in 1 process,
and resumes exactly.

The package is ``tests/plugins/tiny-gan-task`` (installed from a copy, uninstalled afterwards): the task
``lm_gan`` trains a tiny language model (the run's ``model:``) against a critic, least-squares GAN style,
the critic's optimizer stepping before the model's in every step (as a GAN vocoder trains). Checked:

- 1 process (4 samples per micro-batch) and FSDP on 2 ranks (2 each) give the same losses of both models and
  the same gradient norms within 1e-5 relative, for 4 steps of 2 micro-batches;
- the checkpoint holds both models, both optimizers and both schedulers (one atomic folder), and "4 steps"
  equals "2 steps, stop, resume for 2" exactly;
- ``mm plugins`` lists the task; a bad ``training.task_param`` key is a one-line error naming it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
import yaml
from _mm import REPO, assert_close_series, mm, quickstart_text_data, train_layouts
from _pip_package import installed

PACKAGE = REPO / "tests" / "plugins" / "tiny-gan-task"
STEPS = 4
COMMON = [
    f"training.train_iters={STEPS}",
    "training.gradient_accumulation_steps=2",
    "training.save_interval=2",
]
METRICS = ("loss", "loss_adv", "loss_critic", "grad_norm", "grad_norm_critic")


def _config(path: Path) -> Path:
    cfg = {
        "parallel": {"fully_shard_parallel_size": "auto"},
        "data": quickstart_text_data(32),
        "model": {
            "model_id": "tiny_gan_lm",
            "from_scratch": True,
            "config_overrides": {"vocab_size": 4096, "hidden": 32, "n_blocks": 2},
        },
        "training": {
            "task": "lm_gan",
            "task_param": {
                "critic": {"vocab_size": 4096, "hidden": 16, "n_blocks": 1},
                "critic_lr": 3.0e-3,
                "adversarial_weight": 0.5,
            },
            "lr": 1.0e-3,
            "lr_decay_style": "cosine",
            "train_iters": STEPS,
            "seed": 7,
            "log_interval": 1,
            "progress_bar": False,
        },
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("task_plugin")
    with installed(PACKAGE, "tiny-gan-task", "mm.tasks", "lm_gan", work):
        cfg = _config(work / "lm_gan.yaml")
        ckpt = work / "ckpt"
        layouts = [
            ("single", 1, ["training.micro_batch_size=4"]),
            ("fsdp2", 2, ["training.micro_batch_size=2", f"training.save={ckpt}"]),
            # after fsdp2, in the same launch: resumed from its step-2 checkpoint
            ("resumed", 2, ["training.micro_batch_size=2", f"training.load={ckpt / 'step_2'}"]),
        ]
        got = train_layouts(tmp_path_factory, cfg, layouts, COMMON, timeout=180)
        with ThreadPoolExecutor(max_workers=2) as pool:  # two independent one-process commands
            listed = pool.submit(mm, "plugins")
            refused = pool.submit(
                mm, "train", str(cfg), "training.task_param.critc_lr=1",
                f"training.output_dir={work / 'bad'}", check=False, timeout=120,
            )  # fmt: skip
            plugins, bad = listed.result().stdout, refused.result()
        yield got, ckpt, plugins, bad


@pytest.mark.slow
def test_two_models_two_optimizers_train_the_same_on_two_ranks(runs):
    got, _, _, _ = runs
    ref = got["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in METRICS:
        assert_close_series(
            [r[key] for r in ref], [r[key] for r in got["fsdp2"]], 1e-5, f"lm_gan fsdp2 {key}"
        )
    assert ref[0]["loss_critic"] != ref[1]["loss_critic"] and ref[0]["lr_critic"] != ref[0]["lr"]
    assert ref[-1]["loss"] < ref[0]["loss"]  # the model learns


@pytest.mark.slow
def test_one_checkpoint_holds_both_models_and_resume_is_exact(runs):
    got, ckpt, _, _ = runs
    keys = set(dcp.FileSystemReader(str(ckpt / "step_2")).read_metadata().state_dict_metadata)
    tops = {k.split(".", 1)[0] for k in keys}
    for entry in (
        "model",
        "critic",
        "optimizer",
        "optimizer_critic",
        "scheduler",
        "scheduler_critic",
        "data",
    ):
        assert entry in tops, sorted(tops)
    assert "critic.proj.weight" in keys and "model.head.weight" in keys
    straight = {r["step"]: r for r in got["fsdp2"]}
    resumed = got["resumed"]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        for key in (*METRICS, "lr", "lr_critic"):
            assert r[key] == straight[r["step"]][key], (key, r["step"])


@pytest.mark.slow
def test_the_task_is_listed_and_its_settings_are_checked(runs):
    _, _, plugins, bad = runs
    rows = [line.split() for line in plugins.splitlines()]
    assert any(row[:3] == ["task", "lm_gan", "tiny-gan-task"] for row in rows), plugins
    assert any(row[:2] == ["task", "standard"] for row in rows), plugins
    assert bad.returncode == 2
    assert (
        "training.task_param.critc_lr: unknown key; accepted: critic, critic_lr, adversarial_weight"
        in bad.stderr
    )
