"""CosyVoice3's vocoder stage trained as an ``mm train`` worker trains it: the ``cosyvoice_vocoder`` task
(HiFT generator against its multi-period + multi-resolution discriminators, two optimizers) on 1 process and
on 2 FSDP ranks (gloo). The runs go through ``_launch``: a launch of 1 process, then one launch of 2
processes for the 3-step run and, after it, the resume from its step-2 checkpoint.

A tiny speech store is written in a temporary folder (sines and chirps, their log-mel, random speech
tokens); both models are tiny (``config_overrides``). Checked:

- 1 process (2 micro-batches of one sample, accumulated) and FSDP on 2 ranks (one sample each) give the same
  losses of both models and the same gradient norms within 1e-5 for 3 steps. (One sample per micro-batch
  on purpose: a sample computed in a batch of another size rounds differently, and the mel loss amplifies
  that into the generator's gradient norm (``test_grouping``: up to 1e-4), so only per-sample computations
  that are bitwise the same on both layouts compare at 1e-5; the layouts still differ in sharding, in the
  gradient all-reduce and in the metrics' reduction.)
- one checkpoint holds ``model.*``, ``discriminator.*``, both optimizers and both schedulers, and
  "2 steps, stop, resume for 1" equals "3 steps" exactly;
- the generator learns something (the mel loss falls) and the pitch target is on (``loss_f0``);
- ``mm convert dcp-to-hf`` exports the generator alone, under the official names, as a folder
  ``HiFTGenerator.from_pretrained`` reads.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
import yaml
from _launch import run_in_one_launch
from _mm import REPO, assert_close_series, read_metrics

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.micro_batch_size=1", "training.save_interval=2"]
METRICS = ("loss", "loss_adv", "loss_fm", "loss_mel", "loss_tpr", "loss_f0", "loss_disc", "grad_norm",
           "grad_norm_discriminator")  # fmt: skip
SAMPLE_RATE = 24000


def _store(root: Path) -> Path:
    from mm_data_audio.cosyvoice.store import Utterance, write_store

    rng = np.random.default_rng(0)
    utterances = []
    for i in range(8):
        tokens = 10 + i % 3
        t = np.arange(960 * tokens) / SAMPLE_RATE
        f = 110.0 + 40.0 * i
        if i % 2:  # a chirp rising 150 Hz per second
            wave = 0.4 * np.sin(2 * math.pi * (f * t + 75.0 * t**2))
        else:  # a tone with its octave
            wave = 0.4 * np.sin(2 * math.pi * f * t) + 0.1 * np.sin(2 * math.pi * 2 * f * t)
        utterances.append(
            Utterance(id=f"u{i}", text="tone", wave=wave.astype(np.float32),
                      speech_tokens=rng.integers(0, 64, tokens))
        )  # fmt: skip
    return write_store(root / "store", utterances, speech_vocab=64)


def _config(path: Path, store: Path) -> Path:
    cfg = {
        "parallel": {"fully_shard_parallel_size": "auto"},
        "data": {
            "dataset_param": {
                "dataset_type": "cosyvoice_speech",
                "basic_parameters": {"dataset": str(store), "stage": "vocoder", "segment_samples": 1920},
            },
            "dataloader_param": {"collate_param": {"collator_id": "cosyvoice_vocoder"}},
        },
        "model": {
            "model_id": "cosyvoice3_hift",
            "from_scratch": True,
            "config_overrides": {"base_channels": 16, "f0_cond_channels": 8},
        },
        "training": {
            "task": "cosyvoice_vocoder",
            "task_param": {
                "discriminator": {"mpd_channels": [4, 8, 8, 8, 8], "mrd_channels": 4},
                "discriminator_lr": 3.0e-4,
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
    work = tmp_path_factory.mktemp("cosyvoice_vocoder")
    cfg = _config(work / "vocoder.yaml", _store(work))
    ckpt = work / "ckpt"
    out = {name: tmp_path_factory.mktemp(name) for name in ("single", "fsdp2", "resumed")}
    single = ["training.gradient_accumulation_steps=2", f"training.output_dir={out['single']}"]
    fsdp2 = [f"training.save={ckpt}", f"training.output_dir={out['fsdp2']}"]
    resumed = [f"training.load={ckpt / 'step_2'}", f"training.output_dir={out['resumed']}"]
    run_in_one_launch(1, [("single", str(cfg), [*COMMON, *single])], REPO, timeout=300)
    # the resume reads the step-2 checkpoint the 3-step run wrote (its saver closed before the next run)
    runs = [("fsdp2", str(cfg), [*COMMON, *fsdp2]), ("resumed", str(cfg), [*COMMON, *resumed])]
    run_in_one_launch(2, runs, REPO, timeout=600)
    got = {name: read_metrics(folder) for name, folder in out.items()}
    return got, ckpt


@pytest.mark.slow
def test_vocoder_gan_trains_the_same_on_one_and_two_ranks(runs):
    got, _ = runs
    ref = got["single"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in METRICS:
        assert_close_series([r[key] for r in ref], [r[key] for r in got["fsdp2"]], 1e-5, f"vocoder {key}")
    assert ref[0]["lr_discriminator"] == 3.0e-4 and ref[0]["lr"] == 1.0e-3
    assert ref[-1]["loss_mel"] < ref[0]["loss_mel"]
    assert all(math.isfinite(r[k]) and r[k] > 0 for r in ref for k in METRICS)


@pytest.mark.slow
def test_one_checkpoint_holds_both_models_and_resume_is_exact(runs):
    got, ckpt = runs
    keys = set(dcp.FileSystemReader(str(ckpt / "step_2")).read_metadata().state_dict_metadata)
    tops = {k.split(".", 1)[0] for k in keys}
    for entry in ("model", "discriminator", "optimizer", "optimizer_discriminator", "scheduler",
                  "scheduler_discriminator", "data"):  # fmt: skip
        assert entry in tops, sorted(tops)
    assert "model.conv_post.parametrizations.weight.original1" in keys
    assert "discriminator.mrd.discriminators.0.out.parametrizations.weight.original0" in keys
    straight = {r["step"]: r for r in got["fsdp2"]}
    resumed = got["resumed"]
    assert [r["step"] for r in resumed] == [3]
    for key in (*METRICS, "lr", "lr_discriminator"):
        assert resumed[0][key] == straight[3][key], key


@pytest.mark.slow
def test_the_generator_exports_under_the_official_names(runs, tmp_path):
    from safetensors.torch import load_file

    from mm_core.convert import dcp_to_hf
    from mm_core.models import ModelArguments
    from mm_models_cosyvoice.hift import HiFTGenerator

    _, ckpt = runs
    out = dcp_to_hf(ckpt / "step_3", tmp_path / "hift")
    names = set(load_file(str(out / "model.safetensors")))
    assert "conv_pre.parametrizations.weight.original1" in names and "m_source.l_linear.weight" in names
    assert not any(n.startswith(("discriminator", "mpd.", "mrd.")) for n in names)
    model = HiFTGenerator.from_pretrained(
        ModelArguments(model_id="cosyvoice3_hift", model_name_or_path=str(out))
    )
    assert model.config.base_channels == 16 and set(model.state_dict()) == names  # config.json: the structure
